"""Where one MoE block's step waits on the host: CUDA-event time against the GPU's busy time.

``benchmarks/moe_bench.py`` times a block's forward + backward with CUDA events from an idle GPU;
the event time is the kernels' time plus every interval in which the GPU waited for the host to
queue the next kernel. This probe times each system that way, then profiles one step for the GPU's
busy time and its idle gaps (longest first, with the kernels either side), the host's enqueue time
(from the start of the step until ``backward`` returns, before the synchronization) and, with
``cProfile``, the Python functions with the most own time::

    python benchmarks/probes/moe_block_gaps.py --out gaps.json [--systems grouped_mm,sloth,sloth_fused] [--trace DIR [--stack]]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_bench, probes/


def main(argv: list[str] | None = None) -> dict:
    import moe_bench as bench
    from probes.host_profile import gpu_gaps

    from lightning_sloth.bench.measure import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3_30b_a3b,gpt_oss_20b")
    parser.add_argument("--systems", default="grouped_mm,sloth,sloth_fused")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--timed", type=int, default=20)
    parser.add_argument("--gaps", type=int, default=12)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--trace", default=None, help="a folder for a Chrome trace (host and device) of one step"
    )
    parser.add_argument(
        "--stack",
        action="store_true",
        help="the trace with Python frames and the ops' shapes (a larger file)",
    )
    args = parser.parse_args(argv)

    report = {"environment": environment(), "tokens": args.tokens, "results": []}
    for shape in args.shapes.split(","):
        block = bench._block(shape)
        for param in block.parameters():
            param.requires_grad_(False)
        block = bench._with_lora(block)
        hidden = bench.SHAPES[shape]["hidden_size"]
        torch.manual_seed(1)
        x = torch.randn(1, args.tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        for system in args.systems.split(","):
            bench._select(block, system)
            timing = bench.measure(block, x, grad, warmup=3, timed=args.timed, pipelined=False)

            def step(block=block, x=x, grad=grad) -> float:
                torch.cuda.synchronize()
                start = time.perf_counter()
                bench._step(block, x, grad)
                host = time.perf_counter() - start
                torch.cuda.synchronize()
                x.grad = None
                for param in block.parameters():
                    param.grad = None
                return host * 1e3

            enqueue = statistics.median(step() for _ in range(5))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                begin = time.perf_counter()
                step()
                wall_us = (time.perf_counter() - begin) * 1e6
            gaps = gpu_gaps(prof.events(), wall_us, args.gaps)
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(
                    activities=activities, with_stack=args.stack, record_shapes=args.stack
                ) as traced:
                    step()
                traced.export_chrome_trace(os.path.join(args.trace, f"{shape}_{system}.json"))
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(3):
                step()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
            row = {
                "shape": shape,
                "system": system,
                "event_median_ms": timing["median_ms"],
                "host_enqueue_ms": enqueue,
                "gpu_gaps": gaps,
                "cprofile_3_steps": text.getvalue(),
            }
            report["results"].append(row)
            print(
                f"{shape:14s} {system:12s} event {timing['median_ms']:7.2f} ms  busy {gaps['busy_ms']:7.2f} ms"
                f"  host enqueue {enqueue:6.2f} ms  before/after {gaps['outside_ms']:.2f} ms  idle "
                + ", ".join(f"{k} {v:.2f}" for k, v in gaps["idle_ms_by_gap"].items()),
                flush=True,
            )
            for gap in gaps["longest"][:6]:
                print(
                    f"    {gap['gap_ms']:6.3f} ms at {gap['at_ms']:6.2f}: {gap['before'][:50]} -> {gap['after'][:50]}"
                )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
