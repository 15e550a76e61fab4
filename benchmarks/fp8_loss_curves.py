"""Loss curves of LoRA over FP8 base weights against bf16 base weights, same data, same seed.

Each variant is one run of the ``lightning-sloth`` app (``python -m lightning_sloth.train``) in its
own directory; the script reads every run's per-step train loss (``csv/version_0/metrics.csv``) and
its final validation (``metrics.json``: loss and ``exact_match``, the documents whose whole response
is right, which under teacher forcing is greedy decoding's exact match) and compares each FP8 variant
with the bf16 run::

    final loss      mean train loss of the last 20 steps, relative to bf16's (target: within 1%)
    exact match     validation exact match minus bf16's (target: within 0.02)

With ``--seeds 0,1,2`` every variant runs once per seed (the app's ``seed``: LoRA's initialisation
and the data order) and the verdict compares the means over seeds; each seed's own comparison
(variant and bf16 at the same seed) and the spread of bf16's final loss over its seeds (the
largest relative distance from their mean: how far one bf16 run lies from another) are recorded
beside it (``seeds`` in the JSON).

Tasks: ``default`` (the app's default run: LoRA on the packaged tiny base, synthetic task) and
``llama_1b`` (``experiment=llama_1b_bench``: the Llama-3.2-1B shape, random weights, 16k-token
batches; validated once, at the end, on 128 documents: each validation generates every response,
which at 512 documents takes longer than the 200 training steps), and ``moe_tiny``
(``model=qwen3_moe_tiny lora=moe_experts``: a small random Qwen3-MoE with LoRA on attention and
experts; with ``fp8`` its expert weights are in FP8 too: ``precision.fp8_experts=true``). Variants: ``bf16`` (the baseline), ``fp8`` (the ``fp8_lora`` preset: e4m3 gradients,
k/v projections kept in bf16), ``fp8_all`` (k/v in FP8 too), ``fp8_e5m2``, ``fp8_bf16grad``,
``fp8_exact_accum`` (the sums promoted to float32: ``precision.fp8_fast_accum=false``);
``nf4`` and ``nf4_fp8`` (QLoRA, NF4 bases requantised to FP8) on request::

    python benchmarks/fp8_loss_curves.py --task default  --steps 200          # about 2 minutes
    python benchmarks/fp8_loss_curves.py --task llama_1b --steps 200 --variants bf16,fp8
    python benchmarks/fp8_loss_curves.py --task default  --seeds 0,1,2 --variants bf16,fp8,fp8_bf16grad
    python benchmarks/fp8_loss_curves.py --task moe_tiny --seeds 0,1,2 --variants bf16,fp8

On a machine without FP8 tensor cores (a CPU) the FP8 variants run the plain-torch emulation, the
GPU kernels' oracle, and ``bf16`` runs the app's ``auto`` precision there: float32 (``compute`` in
the JSON names it).

Writes ``fp8_loss_curves_<task>.json`` under ``$OUT`` (else ``benchmarks/results/``, or ``--out``);
the runs themselves go under ``--runs-dir`` (``/tmp/fp8_runs/<task>/<variant>``, ``<variant>_s<seed>``
with several seeds), and
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
    "moe_tiny": ["model=qwen3_moe_tiny", "lora=moe_experts"],
}
VARIANTS = {
    "bf16": [],
    "fp8": ["precision=fp8_lora"],
    "fp8_all": ["precision=fp8_lora", "precision.fp8_skip=[]"],
    "fp8_e5m2": ["precision=fp8_lora", "precision.fp8_grad=e5m2"],
    "fp8_bf16grad": ["precision=fp8_lora", "precision.fp8_grad=bf16"],
    "fp8_exact_accum": ["precision=fp8_lora", "precision.fp8_fast_accum=false"],
    "nf4": ["precision=qlora_nf4"],
    "nf4_fp8": ["precision=fp8_lora", "precision.quantize=nf4"],
}
LAST = 20  # steps averaged for the final loss


def overrides(task: str, variant: str, steps: int, run_dir: Path, seed: int | None = None) -> list[str]:
    """The app's overrides for one run: the task's, the variant's precision (keeping the task's
    compute mode: bf16-true for llama_1b, auto elsewhere), the seed if given, and a loss logged
    every step."""
    args = list(TASKS[task]) + list(VARIANTS[variant])
    if task == "llama_1b":
        args += ["data.num_val=128", f"trainer.val_check_interval={steps}"]
        if variant != "bf16":
            args.append("precision.precision=bf16_true")
    if task == "moe_tiny" and "precision=fp8_lora" in args:
        args.append("precision.fp8_experts=true")  # its experts are narrower than the FP8 default's
    if seed is not None:
        args.append(f"seed={seed}")
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
        "val_generated_exact_match": metrics["val"].get("generated_exact_match"),
        "real_tokens_per_s": metrics.get("real_tokens_per_s"),
        "seconds": seconds,
    }


def _baseline(name: str) -> str:
    return "nf4" if name == "nf4_fp8" else "bf16"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def compare(results: dict) -> dict:
    """Each variant against bf16 (or nf4_fp8 against nf4): relative final loss, exact-match change.

    A result with ``seeds`` (one summary per seed) is compared through the means over its seeds,
    and each seed's own comparison and the baseline's spread over its seeds are added."""
    out = {}
    for name, result in results.items():
        base = results.get(_baseline(name))
        if base is None or base is result:
            continue
        runs, base_runs = result.get("seeds", [result]), base.get("seeds", [base])
        loss = _mean([r["final_train_loss"] for r in runs])
        base_loss = _mean([r["final_train_loss"] for r in base_runs])
        rel = loss / base_loss - 1
        em = None
        if all(r["val_exact_match"] is not None for r in runs + base_runs):
            em = _mean([r["val_exact_match"] for r in runs]) - _mean(
                [r["val_exact_match"] for r in base_runs]
            )
        out[name] = {
            "final_loss_relative": rel,
            "exact_match_change": em,
            "loss_within_1pct": abs(rel) <= 0.01,
            "exact_match_within_0_02": None if em is None else abs(em) <= 0.02,
        }
        if "seeds" in result:
            by_seed = {r["seed"]: r for r in base_runs}
            out[name]["seeds"] = len(runs)
            out[name]["per_seed_final_loss_relative"] = {
                str(r["seed"]): r["final_train_loss"] / by_seed[r["seed"]]["final_train_loss"] - 1
                for r in runs
                if r["seed"] in by_seed
            }
            out[name]["baseline_seed_spread"] = max(
                abs(r["final_train_loss"] / base_loss - 1) for r in base_runs
            )
    return out


def combine_seeds(per_seed: dict[int, dict]) -> dict:
    """One variant's runs over several seeds: the first seed's summary (curves and all) with every
    seed's final figures under ``seeds``."""
    first = per_seed[min(per_seed)]
    keep = ("final_train_loss", "val_loss", "val_exact_match", "val_generated_exact_match")
    keep += ("real_tokens_per_s", "seconds")
    seeds = [{"seed": seed} | {k: run.get(k) for k in keep} for seed, run in sorted(per_seed.items())]
    return first | {"seed": min(per_seed), "seeds": seeds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="default")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default="bf16,fp8,fp8_e5m2,fp8_bf16grad")
    parser.add_argument(
        "--seeds", default=None, help="comma-separated app seeds, e.g. 0,1,2 (default: the app's)"
    )
    parser.add_argument(
        "--out", default=None, help="the JSON's folder (default: $OUT, else benchmarks/results)"
    )
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
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None]
    out_dir = Path(args.out or os.environ.get("OUT") or "benchmarks/results")
    runs = Path(args.runs_dir) / args.task
    results = {}
    for variant in variants:
        per_seed = {}
        for seed in seeds:
            run_dir = runs / (variant if seed is None else f"{variant}_s{seed}")
            command = [sys.executable, "-m", "lightning_sloth.train"]
            command += overrides(args.task, variant, args.steps, run_dir, seed)
            print(" ".join(command), flush=True)
            if args.dry_run:
                continue
            if args.reuse and (run_dir / "metrics.json").is_file():
                per_seed[seed] = summarise(run_dir, float("nan"))
                continue
            start = time.perf_counter()
            subprocess.run(command, check=True)
            per_seed[seed] = summarise(run_dir, time.perf_counter() - start)
            shown = {k: v for k, v in per_seed[seed].items() if k != "train_loss"}
            print(variant, f"seed {seed}", shown, flush=True)
        if not args.dry_run:
            results[variant] = per_seed[None] if seeds == [None] else combine_seeds(per_seed)
    if args.dry_run:
        return
    import torch

    from lightning_sloth.plugins.precision import resolve_precision

    record = {
        "task": args.task,
        "steps": args.steps,
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "compute": resolve_precision("auto"),
        "seeds": seeds if seeds != [None] else None,
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
