"""Loss curves of LoRA over FP8 base weights against bf16 base weights, same data, same seed.

Each variant is one run of the ``lightning-sloth`` app (``python -m lightning_sloth.train``) in its
own directory; the script reads every run's per-step train loss (``csv/version_0/metrics.csv``) and
its final validation (``metrics.json``: loss and ``exact_match``, the documents whose whole response
is right, which under teacher forcing is greedy decoding's exact match) and compares each FP8 variant
with the bf16 run::

    final loss      mean train loss of the last 20 steps, relative to bf16's (target: within 1%)
    exact match     validation exact match minus bf16's (target: within 0.02)

Tasks: ``default`` (the app's default run: LoRA on the packaged tiny base, synthetic task) and
``llama_1b`` (``experiment=llama_1b_bench``: the Llama-3.2-1B shape, random weights, 16k-token
batches). Variants: ``bf16`` (the baseline), ``fp8`` (e4m3 gradients), ``fp8_e5m2``,
``fp8_bf16grad``; ``nf4`` and ``nf4_fp8`` (QLoRA, NF4 bases requantised to FP8) on request::

    python benchmarks/fp8_loss_curves.py --task default  --steps 200          # about 2 minutes
    python benchmarks/fp8_loss_curves.py --task llama_1b --steps 200 --variants bf16,fp8

Writes ``fp8_loss_curves_<task>.json`` under ``$OUT`` (else ``benchmarks/results/``); the runs
themselves go under ``--runs-dir`` (``/tmp/fp8_runs/<task>/<variant>``), and
``--reuse`` reads a variant already run there instead of running it again (split a long comparison
over several commands). ``--dry-run`` prints the commands without running them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

TASKS = {
    "default": [],
    "llama_1b": ["experiment=llama_1b_bench"],
}
VARIANTS = {
    "bf16": [],
    "fp8": ["precision=fp8_lora"],
    "fp8_e5m2": ["precision=fp8_lora", "precision.fp8_grad=e5m2"],
    "fp8_bf16grad": ["precision=fp8_lora", "precision.fp8_grad=bf16"],
    "nf4": ["precision=qlora_nf4"],
    "nf4_fp8": ["precision=fp8_lora", "precision.quantize=nf4"],
}
LAST = 20  # steps averaged for the final loss


def overrides(task: str, variant: str, steps: int, run_dir: Path) -> list[str]:
    """The app's overrides for one run: the task's, the variant's precision (keeping the task's
    compute mode: bf16-true for llama_1b, auto elsewhere), and a loss logged every step."""
    args = list(TASKS[task]) + list(VARIANTS[variant])
    if task == "llama_1b" and variant != "bf16":
        args.append("precision.precision=bf16_true")
    return args + [
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        f"trainer.checkpoint_every_n_steps={steps}",
        "resume=null",
        f"hydra.run.dir={run_dir}",
    ]


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, train loss)`` per logged step of a run."""
    losses = []
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                losses.append((int(row["step"]), float(row["train/loss"])))
    return losses


def summarise(run_dir: Path, seconds: float) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    losses = train_losses(run_dir)
    tail = [loss for _, loss in losses[-LAST:]]
    return {
        "train_loss": losses,
        "final_train_loss": sum(tail) / len(tail),
        "val_loss": metrics["val"].get("loss"),
        "val_exact_match": metrics["val"].get("exact_match"),
        "real_tokens_per_s": metrics.get("real_tokens_per_s"),
        "seconds": seconds,
    }


def compare(results: dict) -> dict:
    """Each variant against bf16 (or nf4_fp8 against nf4): relative final loss, exact-match change."""
    out = {}
    for name, result in results.items():
        base = results.get("nf4" if name == "nf4_fp8" else "bf16")
        if base is None or base is result:
            continue
        rel = result["final_train_loss"] / base["final_train_loss"] - 1
        em = None
        if result["val_exact_match"] is not None and base["val_exact_match"] is not None:
            em = result["val_exact_match"] - base["val_exact_match"]
        out[name] = {
            "final_loss_relative": rel,
            "exact_match_change": em,
            "loss_within_1pct": abs(rel) <= 0.01,
            "exact_match_within_0_02": None if em is None else abs(em) <= 0.02,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="default")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default="bf16,fp8,fp8_e5m2,fp8_bf16grad")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="read a variant's finished run from --runs-dir instead of rerunning it",
    )
    parser.add_argument(
        "--runs-dir", default="/tmp/fp8_runs", help="where the runs write (not under the repository)"
    )
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    runs = Path(args.runs_dir) / args.task
    results = {}
    for variant in variants:
        command = [sys.executable, "-m", "lightning_sloth.train"]
        command += overrides(args.task, variant, args.steps, runs / variant)
        print(" ".join(command), flush=True)
        if args.dry_run:
            continue
        if args.reuse and (runs / variant / "metrics.json").is_file():
            results[variant] = summarise(runs / variant, float("nan"))
            continue
        start = time.perf_counter()
        subprocess.run(command, check=True)
        results[variant] = summarise(runs / variant, time.perf_counter() - start)
        print(variant, {k: v for k, v in results[variant].items() if k != "train_loss"}, flush=True)
    if args.dry_run:
        return
    import torch

    record = {
        "task": args.task,
        "steps": args.steps,
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "results": results,
        "against_baseline": compare(results),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"fp8_loss_curves_{args.task}.json"
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["against_baseline"], indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
