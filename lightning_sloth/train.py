"""The ``lightning-sloth`` app: fine-tune a causal LM with lightning_sloth's plugins, configured by Hydra.

::

    lightning-sloth                                         # LoRA on the packaged tiny base, no download
    lightning-sloth trainer.max_steps=100 optimizer.lr=3e-3
    lightning-sloth model=hf model.name_or_path=meta-llama/Llama-3.2-1B data=jsonl data.train_path=t.jsonl
    lightning-sloth -m optimizer.lr=1e-3,3e-3               # a sweep, one job dir each
    python -m lightning_sloth.train --help                  # the config groups and their options

A run writes to ``HydraConfig.get().runtime.output_dir``::

    .hydra/                     the composed config and overrides
    checkpoints/last.ckpt       resumable state (``resume=auto`` picks it up when rerun in the same dir)
    csv/version_N/metrics.csv   logged metrics; tensorboard/version_N/ the same for TensorBoard
    adapter/                    the LoRA adapter in PEFT's format (the full model with ``lora=none``)
    merged/                     with ``export=merged``: the adapter merged into the base, 16-bit,
                                transformers' layout (also ``lightning-sloth-export RUN_DIR``)
    samples.jsonl               greedy samples of validation prompts at each validation
    metrics.json                final validation metrics, first/last train loss, real tokens/s and
                                MFU of the training steps, packing, steps, time
"""

from __future__ import annotations

import json
import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from lightning_sloth import build, export
from lightning_sloth.build import ADAPTER_DIR, CHECKPOINT_DIR, LAST_CHECKPOINT, SAMPLES_FILE
from lightning_sloth.config import ExportMode, register_configs, validate
from lightning_sloth.export import MERGED_DIR
from lightning_sloth.plugins.callbacks import OutOfMemoryAdvice, SlothThroughputMonitor, StepOutOfMemoryError
from lightning_sloth.plugins.compile_cache import configure_compile_caches

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"

register_configs()


class RunSummary(Callback):
    """Writes ``metrics.json`` when training ends (on global rank zero, also inside DDP workers).

    Keys: ``steps`` (optimizer steps, resumed ones included); ``val`` (the last validation's
    metrics, names without the ``val/`` prefix) and ``val_step``; ``val_history`` (every
    validation of this run, with its step); ``train_loss_first`` (first step of this run) and
    ``train_loss_last``; ``real_tokens_per_s``, ``model_tflops_per_s`` and ``mfu`` of this run's
    training steps (validation excluded; ``None`` where unknown, such as MFU off CUDA;
    :meth:`SlothThroughputMonitor.summary`); ``packing_efficiency`` per split; ``train_time_s``
    (``fit``), ``wall_time_s`` (from ``start_time``); ``resumed_from``.

    Args:
        path: the JSON file to write.
        start_time: ``time.time()`` when the app started.
        resumed_from: the checkpoint the run resumed from, if any.
    """

    def __init__(self, path: str | Path, start_time: float, resumed_from: str | None = None) -> None:
        self.path = Path(path)
        self.start_time = start_time
        self.resumed_from = resumed_from
        self.train_loss_first: float | None = None
        self.val_history: list[dict[str, float | int]] = []
        self._fit_start = start_time

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        if self.train_loss_first is None and outputs is not None:
            # One host read, on the first step only.
            self.train_loss_first = float(outputs["loss"])

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {
            k.removeprefix("val/"): _number(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("val/")
        }
        self.val_history.append({"step": trainer.global_step, **metrics})

    @rank_zero_only
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        last_val = dict(self.val_history[-1]) if self.val_history else {}
        val_step = last_val.pop("step", None)
        train_loss = trainer.callback_metrics.get("train/loss")
        stats = getattr(trainer.datamodule, "packing_stats", {})
        monitor = next((c for c in trainer.callbacks if isinstance(c, SlothThroughputMonitor)), None)
        throughput = monitor.summary() if monitor is not None else {}
        summary = {
            "steps": trainer.global_step,
            "val": last_val,
            "val_step": val_step,
            "val_history": self.val_history,
            "train_loss_first": self.train_loss_first,
            "train_loss_last": None if train_loss is None else _number(train_loss),
            "real_tokens_per_s": throughput.get("real_tokens_per_s"),
            "model_tflops_per_s": throughput.get("model_tflops_per_s"),
            "mfu": throughput.get("mfu"),
            "packing_efficiency": {split: s.efficiency for split, s in stats.items()},
            "train_time_s": round(time.time() - self._fit_start, 3),
            "wall_time_s": round(time.time() - self.start_time, 3),
            "resumed_from": self.resumed_from,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(summary, indent=2) + "\n")


def _number(value: Any) -> float | str:
    """A JSON-safe number: non-finite values become strings ("nan", "inf")."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def format_summary(summary: dict[str, Any], output_dir: str | Path) -> str:
    """A few lines for the console from a ``metrics.json`` dict: metrics, then where the outputs are."""
    output_dir = Path(output_dir)
    where = [
        ("adapter", output_dir / ADAPTER_DIR),
        ("merged model", output_dir / MERGED_DIR),
        ("samples", output_dir / SAMPLES_FILE),
        ("checkpoint", output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT),
    ]
    outputs = [f"  {name}: {path}" for name, path in where if path.exists()]
    if not (output_dir / MERGED_DIR).exists():
        outputs.append(f"  merged model: not written (export=merged, or lightning-sloth-export {output_dir})")

    def fmt(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    val = ", ".join(f"{k} {fmt(v)}" for k, v in summary["val"].items()) or "not run"
    rate, mfu = summary.get("real_tokens_per_s"), summary.get("mfu")
    throughput = "not measured" if rate is None else f"{rate:,.0f} real tokens/s"
    if rate is not None:
        throughput += ", MFU n/a" if mfu is None else f", MFU {100 * mfu:.1f}%"
    packing = ", ".join(f"{k} {100 * v:.1f}%" for k, v in summary["packing_efficiency"].items())
    return "\n".join(
        [
            f"lightning-sloth: {summary['steps']} steps in {summary['train_time_s']:.1f} s "
            f"(wall {summary['wall_time_s']:.1f} s)",
            f"  train loss {fmt(summary['train_loss_first'])} -> {fmt(summary['train_loss_last'])}",
            f"  throughput: {throughput}",
            f"  validation (step {summary['val_step']}): {val}",
            f"  packing efficiency: {packing}",
            f"  outputs: {output_dir}",
            *outputs,
        ]
    )


def _out_of_memory_message(callbacks: list[Callback], output_dir: Path, error: BaseException) -> str:
    """:class:`OutOfMemoryAdvice`'s message and the state of the last checkpoint."""
    advice = next((c for c in callbacks if isinstance(c, OutOfMemoryAdvice)), None)
    message = advice.message if advice is not None and advice.message else f"out of memory: {error}"
    last = output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT
    if last.exists():
        message += f"\nThe last checkpoint, {last}, is intact: rerun with one of these to resume from it."
    return message


def run(cfg: DictConfig, output_dir: str | Path, multirun: bool = False) -> dict[str, Any] | None:
    """Train once from a composed config; returns the ``metrics.json`` dict on global rank zero.

    Config problems surface before anything heavy is built: :func:`~lightning_sloth.config.validate`
    first, then the Trainer (strategy, precision plugin, callbacks), then tokenizer, data and model.
    """
    from lightning.pytorch import seed_everything

    start = time.time()
    validate(cfg)
    configure_compile_caches()
    output_dir = Path(output_dir)
    if cfg.trainer.enable_progress_bar and build.progress_lines(cfg.trainer):
        # In a log: no "Loading weights" bars, and Lightning's notices (devices found, tips) left
        # to the progress lines' first line; its warnings stay.
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    resume = build.resolve_resume(cfg.resume, output_dir)
    # The Trainer (strategy, precision, callbacks) is cheap: its argument errors come before a model load.
    callbacks = build.build_callbacks(
        cfg.trainer, output_dir, build.offload_enabled(cfg), build.out_of_memory_hints(cfg)
    )
    callbacks.append(RunSummary(output_dir / METRICS_FILE, start_time=start, resumed_from=resume))
    if cfg.export is ExportMode.merged:
        export.check_exportable(cfg)
        merged = output_dir / export.MERGED_DIR
        callbacks.append(export.ExportMerged(partial(export.build_base, cfg), merged, cfg.export_dtype.value))
    trainer = build.build_trainer(cfg, output_dir, multirun=multirun, callbacks=callbacks)

    seed_everything(cfg.seed, workers=True, verbose=False)
    tokenizer = build.build_tokenizer(cfg.model)
    datamodule = build.build_datamodule(cfg.data, tokenizer, static_shapes=cfg.sloth.cuda_graphs)
    model = build.build_model(cfg.model, tokenizer, meta=build.builds_per_shard(cfg))
    module = build.build_module(cfg, model)
    if resume:
        log.info("resuming from %s", resume)
    # weights_only=True explicitly: no environment variable (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD) can
    # turn the resumed checkpoint into code; AtomicCheckpointIO enforces it for files as well.
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    except torch.OutOfMemoryError as error:
        raise StepOutOfMemoryError(_out_of_memory_message(callbacks, output_dir, error)) from error

    metrics_file = output_dir / METRICS_FILE
    if not trainer.is_global_zero:
        return None
    if trainer.interrupted or not metrics_file.is_file():
        log.warning(
            "training stopped early; no %s written (resume=auto continues from the last checkpoint)",
            METRICS_FILE,
        )
        return None
    summary = json.loads(metrics_file.read_text())
    log.info("%s", format_summary(summary, output_dir))
    return summary


@hydra.main(version_base="1.3", config_path="pkg://lightning_sloth.conf", config_name="train")
def main(cfg: DictConfig) -> None:
    """Entry point of the ``lightning-sloth`` console script and ``python -m lightning_sloth.train``."""
    hydra_cfg = HydraConfig.get()
    run(cfg, hydra_cfg.runtime.output_dir, multirun=hydra_cfg.mode == RunMode.MULTIRUN)


if __name__ == "__main__":
    main()
