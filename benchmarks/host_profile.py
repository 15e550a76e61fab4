"""Where the host's time goes in a training step: cProfile of a few steps of one bench system.

A step whose GPU idles between kernels is bound by the host (Python dispatch, autograd, launches).
This runs a ``lightning_sloth.bench`` system, then profiles ``--steps`` steps with ``cProfile`` and
prints the functions with the most own time, the number of device synchronizations the step
triggers (``torch.cuda.set_sync_debug_mode("warn")``) and the host time per step without the
profiler::

    python benchmarks/host_profile.py --system sloth_kernels_offload --out host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import traceback
import warnings


def main(argv: list[str] | None = None) -> dict:
    import torch

    from lightning_sloth.bench import (
        SHAPES,
        Workload,
        environment,
        forward_backward,
        make_optimizer,
        stage_batch,
    )
    from lightning_sloth.bench_systems import resolve

    parser = argparse.ArgumentParser(description="host-side profile of one training step (CUDA)")
    parser.add_argument("--system", default="sloth_kernels")
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    workload = Workload(shape=args.shape, warmup_steps=3, timed_steps=2 * args.steps + 1)
    samples = workload.samples(SHAPES[args.shape].get("vocab_size", 32000))
    system = resolve(args.system)
    if system.setup is None:
        raise SystemExit(f"{args.system} is run by Lightning's Trainer; host_profile takes loop systems")
    setup, batches = system.setup, system.batches
    model = setup(workload).train()
    optimizer = make_optimizer(model)
    steps = iter(batches(workload, samples, 0))

    def step() -> tuple[float, float]:
        micro_batches, *_rest, targets = next(steps)
        micro_batches, num_items = stage_batch(micro_batches, targets)
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward(model, micro_batches, num_items)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        return host, time.perf_counter() - start

    for _ in range(workload.warmup_steps):
        step()
    timings = [step() for _ in range(args.steps)]
    syncs: list[str] = []

    def record(message, *_args, **_kwargs) -> None:  # called inside the synchronizing call
        if "called a synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            syncs.append(
                " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:6])
            )

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(args.top)
    stats.print_callees(1)  # what the function with the most own time calls
    report = {
        "environment": environment(),
        "system": args.system,
        "host_enqueue_ms": [1e3 * h for h, _ in timings],
        "step_ms": [1e3 * s for _, s in timings],
        "synchronizations": len(syncs),
        "synchronization_sites": syncs,
        "profile": text.getvalue(),
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(
        f"{args.system}: host enqueue {sum(report['host_enqueue_ms']) / args.steps:.1f} ms of "
        f"{sum(report['step_ms']) / args.steps:.1f} ms per step; {len(syncs)} device syncs in a step"
    )
    for site in syncs:
        print("  sync at:", site)
    print("\n".join(text.getvalue().splitlines()[: args.top + 12]))
    return report


if __name__ == "__main__":
    main()
