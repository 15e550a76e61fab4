"""What the model writes while it trains: greedy samples of fixed validation prompts.

At every validation (the sanity check included, as the "before" picture) :class:`SampleGenerations`
greedy-decodes the same validation prompts with the KV cache, compares each generation with the
expected response, and logs ``val/generated_exact_match``: exact match computed from what the
model generates, not from teacher-forced next-token predictions. The prompt / expected /
generated table goes to TensorBoard (text), to a JSON Lines file (one line per validation) and,
for the last validation, to the console when training ends.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_sloth.generation import generation_mode, greedy_generate

log = logging.getLogger(__name__)


def _cell(text: str, width: int | None = None) -> str:
    text = text.replace("\n", "\\n").replace("|", "\\|")
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def samples_table(rows: list[dict[str, Any]], width: int | None = None) -> str:
    """A Markdown table of ``{"prompt", "expected", "generated", "match"}`` rows (newlines as ``\\n``)."""
    lines = ["| prompt | expected | generated | ok |", "|---|---|---|---|"]
    for row in rows:
        cells = [_cell(row[key], width) for key in ("prompt", "expected", "generated")]
        lines.append(f"| {' | '.join(cells)} | {'yes' if row['match'] else 'no'} |")
    return "\n".join(lines)


class SampleGenerations(Callback):
    """Greedy-decodes fixed validation prompts at each validation and scores them by exact match.

    The prompts are ``num_prompts`` validation samples spread evenly over the validation split
    (``PackedDataModule.validation_examples``), the same at every validation. Generation runs
    inside :func:`~lightning_sloth.generation.generation_mode` (cache on, standard attention) and
    the model is back in its training state afterwards.

    Args:
        num_prompts: prompts decoded and scored at each validation.
        max_new_tokens: most tokens generated per prompt.
        path: JSON Lines file that receives one line per validation (``None``: none written).
        show: rows of the last table printed to the console when training ends.
    """

    def __init__(
        self, num_prompts: int = 32, max_new_tokens: int = 64, path: str | Path | None = None, show: int = 8
    ) -> None:
        if num_prompts <= 0 or max_new_tokens <= 0:
            raise ValueError(
                f"num_prompts and max_new_tokens must be positive, got {num_prompts} and {max_new_tokens}"
            )
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.path = None if path is None else Path(path)
        self.show = show
        self.history: list[dict[str, Any]] = []

    def generate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any] | None:
        """Decode and score the prompts now; ``None`` when the data module has no validation split."""
        datamodule = trainer.datamodule
        examples = datamodule.validation_examples(self.num_prompts) if datamodule is not None else []
        if not examples:
            return None
        tokenizer = datamodule.tokenizer
        with generation_mode(pl_module):
            outputs = greedy_generate(
                pl_module.model,
                [prompt for prompt, _ in examples],
                eos_token_id=tokenizer.eos_token_id,
                max_new_tokens=self.max_new_tokens,
            )
        rows = []
        for (prompt, expected), generated in zip(examples, outputs):
            rows.append(
                {
                    "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                    "expected": tokenizer.decode(expected, skip_special_tokens=True),
                    "generated": tokenizer.decode(generated, skip_special_tokens=True),
                    "match": generated == list(expected),
                }
            )
        exact = sum(row["match"] for row in rows) / len(rows)
        return {"step": trainer.global_step, "exact_match": exact, "samples": rows}

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = self.generate(trainer, pl_module)
        if record is None:
            return
        self.history.append(record)
        if not trainer.sanity_checking:
            pl_module.log(
                "val/generated_exact_match", record["exact_match"], batch_size=len(record["samples"])
            )
        self._write(trainer, record)

    @rank_zero_only
    def _write(self, trainer: Trainer, record: dict[str, Any]) -> None:
        title = f"step {record['step']}: generated exact match {record['exact_match']:.3f}"
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(
                    "samples", f"{title}\n\n{samples_table(record['samples'])}", record["step"]
                )
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    @rank_zero_only
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.history:
            return
        last = self.history[-1]
        table = samples_table(last["samples"][: self.show], width=40)
        print(f"\nsamples at step {last['step']} (generated exact match {last['exact_match']:.3f}):\n{table}")
