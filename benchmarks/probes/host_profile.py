"""Where the host's time goes in a training step: cProfile of a few steps of one bench system.

A step whose GPU idles between kernels is bound by the host (Python dispatch, autograd, launches).
This runs a ``lightning_sloth.bench`` system, then profiles ``--steps`` steps with ``cProfile`` and
prints the functions with the most own time, the number of device synchronizations the step
triggers (``torch.cuda.set_sync_debug_mode("warn")``) and the host time per step without the
profiler::

    python benchmarks/probes/host_profile.py --system sloth_kernels_offload --out host.json
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

GAP_BINS_US = (10.0, 50.0, 200.0, 1000.0)


def gpu_gaps(events, wall_us: float, top: int) -> dict:
    """Where a profiled step's GPU waited: the step's time before its first kernel and after its last
    one, and the idle time between kernels, binned by the gap's length, with the ``top`` longest gaps and their neighbours.

    Many short gaps all through the step mean the host queues kernels about as fast as the GPU runs
    them; a few long ones point at a place (a synchronization, a host-side stretch of Python).
    """
    import torch

    from lightning_sloth.bench.measure import gpu_busy_ms

    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not kernels:
        return {
            "wall_ms": wall_us / 1e3,
            "busy_ms": 0.0,
            "outside_ms": 0.0,
            "idle_ms_by_gap": {},
            "longest": [],
            "kernels_by_time": [],
        }
    origin = kernels[0][0]
    end, before = kernels[0][0], ""
    gaps = []
    for start, stop, name in kernels:
        if start > end and before:
            gaps.append((start - end, end - origin, before, name))
        if stop > end:
            end, before = stop, name
    labels = [f"<{GAP_BINS_US[0]:g}us"] + [f"{a:g}-{b:g}us" for a, b in zip(GAP_BINS_US, GAP_BINS_US[1:])]
    labels.append(f">{GAP_BINS_US[-1]:g}us")
    by_bin = dict.fromkeys(labels, 0.0)
    for length, *_ in gaps:
        index = sum(length >= edge for edge in GAP_BINS_US)
        by_bin[labels[index]] += length / 1e3
    longest = sorted(gaps, reverse=True)[:top]
    by_name: dict[str, list[float]] = {}
    for start, stop, name in kernels:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += (stop - start) / 1e3
        entry[1] += 1
    heaviest = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {
        "wall_ms": wall_us / 1e3,
        "busy_ms": gpu_busy_ms(events),
        "outside_ms": max(0.0, wall_us - (end - origin)) / 1e3,
        "kernels": len(kernels),
        "gaps": len(gaps),
        "idle_ms_by_gap": by_bin,
        "longest": [
            {"gap_ms": g / 1e3, "at_ms": at / 1e3, "before": b, "after": a} for g, at, b, a in longest
        ],
        "kernels_by_time": [{"name": n, "ms": ms, "count": c} for n, (ms, c) in heaviest],
    }


def main(argv: list[str] | None = None) -> dict:
    import torch

    from lightning_sloth.bench.measure import environment, forward_backward, make_optimizer, stage_batch
    from lightning_sloth.bench.systems import resolve
    from lightning_sloth.bench.workload import SHAPES, Workload

    parser = argparse.ArgumentParser(description="host-side profile of one training step (CUDA)")
    parser.add_argument("--system", default="sloth_kernels")
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gaps", type=int, default=25, help="longest GPU idle intervals to list")
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
        forward_backward(model, micro_batches, num_items, targets)
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
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kernel_profiler:
        begin = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - begin) * 1e6
    gaps = gpu_gaps(kernel_profiler.events(), wall_us, args.gaps)
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
        "gpu_gaps": gaps,
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(
        f"{args.system}: host enqueue {sum(report['host_enqueue_ms']) / args.steps:.1f} ms of "
        f"{sum(report['step_ms']) / args.steps:.1f} ms per step; {len(syncs)} device syncs in a step"
    )
    for site in syncs:
        print("  sync at:", site)
    print(
        f"profiled step {gaps['wall_ms']:.1f} ms, GPU busy {gaps['busy_ms']:.1f} ms; before the first kernel "
        f"and after the last {gaps['outside_ms']:.2f} ms; idle between kernels by gap length: "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in gaps["idle_ms_by_gap"].items())
    )
    for row in gaps.get("kernels_by_time", []):
        print(f"  {row['ms']:8.2f} ms {row['count']:5d}x  {row['name'][:110]}")
    for gap in gaps["longest"]:
        print(
            f"  {gap['gap_ms']:7.3f} ms at {gap['at_ms']:7.2f} ms: {gap['before'][:60]} -> {gap['after'][:60]}"
        )
    print("\n".join(text.getvalue().splitlines()[: args.top + 12]))
    return report


if __name__ == "__main__":
    main()
