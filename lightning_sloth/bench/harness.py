"""The argparse harness (``python -m lightning_sloth.bench --out results.json ...``): systems by name,
one JSON of their records, a printed table. Most runs use the Hydra suite
(:mod:`lightning_sloth.bench.suite`); this harness remains for the scripts under ``benchmarks/`` and
for one-off comparisons::

    python -m lightning_sloth.bench --shape llama_3_2_1b --systems hf_padded,sloth --out results.json

Each system runs in its own fresh process (``--same-process`` turns that off), so no system's
memory or allocator state leaks into the next one's peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_sloth.bench.measure import (
    environment,
    forward_backward,
    inactive_expert_parameters,
    make_optimizer,
    memory_plan_record,
    stage_batch,
    step_flops,
    write_profile,
)
from lightning_sloth.bench.systems import resolve_system
from lightning_sloth.bench.workload import SHAPES, Workload
from lightning_sloth.module import flop_parameters


def run_system(
    name: str, workload: Workload, samples, peak_flops: float, profile_to: str | None = None
) -> dict:
    """Train ``warmup_steps + timed_steps`` steps of one system and measure the timed ones.

    With ``profile_to``, one extra step after the timed ones runs under ``torch.profiler`` and
    its per-kernel CUDA time table is written there (not part of the timings).
    """
    setup, batches = resolve_system(name)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = setup(workload)
    model.train()
    n_params = flop_parameters(model) - inactive_expert_parameters(model)
    optimizer = make_optimizer(model)
    times, tokens, flops, losses = [], [], [], []
    grad_norm = float("nan")
    warmup_peak = 0
    steps = workload.warmup_steps + workload.timed_steps
    profiler = None
    for step, (micro_batches, real_tokens, sum_sq, targets) in enumerate(batches(workload, samples, 0)):
        if step == steps + (profile_to is not None):
            break
        if step == steps:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            profiler.__enter__()
        micro_batches, num_items = stage_batch(micro_batches, targets)
        torch.cuda.synchronize()
        if step == workload.warmup_steps:  # the timed steps' own peak, warm-up (and planning) excluded
            warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = forward_backward(model, micro_batches, num_items, targets)
        if step == steps - 1:
            grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
            grad_norm = float(torch.stack(grads).norm())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.__exit__(None, None, None)
            write_profile(profile_to, name, profiler, elapsed)
            break
        losses.append(float(loss))
        if step >= workload.warmup_steps:
            times.append(elapsed)
            tokens.append(real_tokens)
            flops.append(step_flops(n_params, model.config, real_tokens, sum_sq))
    if len(times) < workload.timed_steps:
        raise RuntimeError(f"{name}: only {len(times)} timed steps; raise the sample count")
    result = {
        "system": name,
        "tokens_per_s": sum(tokens) / sum(times),
        "median_step_s": statistics.median(times),
        "median_tokens_per_step": statistics.median(tokens),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "warmup_peak_allocated_gib": warmup_peak / 2**30,
        "mfu": sum(flops) / sum(times) / peak_flops,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "trainable_grad_norm": grad_norm,
        "timed_steps": len(times),
    }
    result |= memory_plan_record(getattr(model, "_sloth_report", None))
    del model, optimizer, loss, micro_batches
    gc.collect()
    torch.cuda.empty_cache()
    return result


def run_isolated(
    name: str, workload: Workload, samples, peak_flops: float, profile_to: str | None = None
) -> dict:
    """:func:`run_system` in a fresh spawned process: a clean CUDA context and allocator per system."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_system, name, workload, samples, peak_flops, profile_to).result()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="lightning_sloth fine-tuning benchmark (CUDA)")
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--systems", default="hf_padded,sloth")
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--profile", default=None, help="a system to profile one extra step of")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    parser.add_argument(
        "--same-process", action="store_true", help="run every system in this process (default: one each)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    for name in systems:
        resolve_system(name)  # unknown names fail before any model is built
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU")
    workload = Workload(
        shape=args.shape,
        tokens_per_step=args.tokens_per_step,
        timed_steps=args.timed_steps,
        warmup_steps=args.warmup_steps,
    )
    samples = workload.samples(SHAPES[args.shape].get("vocab_size", 32000))
    profile_to = str(Path(args.out).with_suffix("")) + "_profile.txt"
    run = run_system if args.same_process else run_isolated
    results = []
    for name in systems:
        profile = profile_to if name == args.profile else None
        try:
            result = run(name, workload, samples, args.peak_tflops * 1e12, profile)
        except Exception as err:  # an out-of-memory system is a result, not the end of the run
            if "out of memory" not in str(err).lower():
                raise
            result = {"system": name, "oom": True, "error": str(err).splitlines()[0][:300]}
            print(f"{name}: out of memory", flush=True)
        else:
            print(
                f"{name}: {result['tokens_per_s']:.0f} tok/s, {result['peak_allocated_gib']:.2f} GiB",
                flush=True,
            )
        results.append(result)
    report = {"environment": environment(), "workload": asdict(workload), "results": results}
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"{'system':<34} {'tok/s':>9} {'step s':>7} {'peak GiB':>9} {'MFU':>6} {'loss first→last':>18}")
    for r in results:
        if r.get("oom"):
            print(f"{r['system']:<34} {'OOM':>9}")
            continue
        print(
            f"{r['system']:<34} {r['tokens_per_s']:>9.0f} {r['median_step_s']:>7.3f} "
            f"{r['peak_allocated_gib']:>9.2f} {r['mfu']:>6.1%} {r['first_loss']:>8.3f}→{r['last_loss']:.3f}"
        )
        if "layer_plan" in r:
            print(
                f"    plan {r['layer_plan']} for {r['plan_budget_gib']} GiB; measured per layer "
                f"{r.get('measured_layer_activation_mib', float('nan')):.0f} MiB saved, "
                f"{r.get('measured_layer_input_mib', float('nan')):.0f} MiB input; "
                f"estimated activation peak {r.get('plan_estimated_activation_gib', float('nan')):.2f} GiB"
            )
    return report


if __name__ == "__main__":
    main()
