"""Which projections FP8 rounding hurts: the validation loss of a model trained in bf16/float32
(an app run's base and LoRA adapter) with its frozen base layers swapped to FP8 e4m3, one kind of
projection at a time, every kind, and the ``fp8_lora`` preset's choice (``FP8_SKIP`` kept).

No training happens here: the adapter is the run's, so the loss change is the forward's alone (the
rounding of the activations and of the weight in each product), before LoRA has had a chance to
adapt to it. On a CPU the FP8 products are the plain-torch emulation, the GPU kernels' oracle::

    lightning-sloth seed=0 trainer.max_steps=200 hydra.run.dir=/tmp/runs/bf16_s0
    python benchmarks/fp8_sensitivity.py /tmp/runs/bf16_s0 [/tmp/runs/bf16_s1 ...]

Writes ``fp8_sensitivity.json`` under ``--out`` (default ``$OUT``, else ``benchmarks/results/``):
per run and in the mean over runs, each configuration's validation loss relative to the run's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from omegaconf import OmegaConf
from peft import PeftModel
from torch.nn import functional as F

from lightning_sloth.attention import enable_packed_attention
from lightning_sloth.build import build_datamodule, build_model, build_tokenizer
from lightning_sloth.export import load_run_config
from lightning_sloth.module import LLAMA_PROJECTIONS as PROJECTIONS
from lightning_sloth.module import shifted_targets
from lightning_sloth.quant.fp8 import FP8_SKIP, fp8_base_model


def configurations() -> dict[str, tuple[str, ...] | None]:
    """Name -> the layers kept out of FP8 (``None``: no FP8 at all, the run as trained)."""
    configs: dict[str, tuple[str, ...] | None] = {"trained": None, "all": ()}
    configs["preset (k/v kept)"] = FP8_SKIP
    for name in PROJECTIONS:
        configs[f"{name} alone"] = tuple(p for p in PROJECTIONS if p != name)
    return configs


@torch.no_grad()
def _loss(model, batches) -> float:
    total, count = 0.0, 0
    for batch in batches:
        logits = model(**batch.model_inputs()).logits[0].float()
        targets = shifted_targets(batch.labels)[0]
        total += F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    return total / count


def evaluate_run(run_dir: Path) -> dict[str, float]:
    """Validation loss per configuration for one app run (its saved config, base and adapter)."""
    cfg = load_run_config(run_dir)
    if OmegaConf.select(cfg, "data.num_val") is None:
        raise ValueError(f"{run_dir}: not a run of the synthetic task (data.num_val missing)")
    tokenizer = build_tokenizer(cfg.model)
    data = build_datamodule(cfg.data, tokenizer)
    data.setup("fit")
    batches = list(data.val_dataloader())
    losses = {}
    for name, kept in configurations().items():
        model = PeftModel.from_pretrained(build_model(cfg.model, tokenizer).float(), run_dir / "adapter")
        if kept is not None:
            fp8_base_model(model, skip=("lm_head", *kept))
        enable_packed_attention(model)
        losses[name] = _loss(model.eval(), batches)
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="app run directories (with .hydra/ and adapter/)")
    parser.add_argument(
        "--out", default=None, help="the JSON's folder (default: $OUT, else benchmarks/results)"
    )
    args = parser.parse_args(argv)
    per_run = {}
    for run in args.runs:
        losses = evaluate_run(run)
        per_run[str(run)] = {
            name: {"val_loss": loss, "relative": loss / losses["trained"] - 1}
            for name, loss in losses.items()
        }
    names = list(configurations())
    mean = {name: sum(r[name]["relative"] for r in per_run.values()) / len(per_run) for name in names}
    print(f"{'FP8 products':24s} val loss vs trained (mean of {len(per_run)} runs)")
    for name in names:
        print(f"{name:24s} {mean[name]:+.2%}")
    record = {
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "runs": per_run,
        "mean_relative": mean,
    }
    out = Path(args.out or os.environ.get("OUT") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_sensitivity.json").write_text(json.dumps(record, indent=1))
    print("wrote", out / "fp8_sensitivity.json")


if __name__ == "__main__":
    main()
