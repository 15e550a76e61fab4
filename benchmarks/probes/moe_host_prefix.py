"""How long the host takes to reach an MoE block's first expert GEMM, and what the pieces before it cost.

In a synchronised step (``benchmarks/moe_bench.py``'s figure) the GPU idles from the router's kernels
until the host has queued the first expert GEMM: the grouping's sort, the LoRA factors, the ops'
dispatch and the Triton launches. For the fused path of each shape this probe reports:

- ``prefix_us``: host time from the block's call to the entry of the first expert GEMM
  (``lightning_sloth.kernels.moe_fused.grouped_mm``), median of synchronised steps;
- ``checkpoints_us``: the same for each stage on the way (the router's return, PEFT's factors,
  ``experts_forward``, the grouping, the first projection, the op's call);
- ``pieces_us``: host time of each piece alone, the median of repeated enqueues: the stable sort of
  the int64 expert ids against the narrow keys :func:`~lightning_sloth.moe.routing.group_by_expert`
  sorts, the grouping, the PEFT factors (``experts_and_lora``), the router's linear, the tile table's
  launch, one fused grouped GEMM's launch (a small one), a whole forward and a whole forward + backward;
- ``after_sync_us``: the router and the whole forward called right after a synchronisation, with and
  without a 10 ms wait for the GPU before it (as a synchronised step waits for the previous one), and
  called again.

::

    python benchmarks/probes/moe_host_prefix.py --out prefix.json [--shapes qwen3_30b_a3b,gpt_oss_20b]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_bench


def host_us(fn, reps: int = 200, sync_every: int = 20) -> float:
    """Median host time of ``fn()`` in microseconds (the queue drained every ``sync_every`` calls)."""
    times = []
    for i in range(reps):
        if i % sync_every == 0 and torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def after_sync_us(fns: dict, reps: int = 50, wait_ms: float = 0.0) -> dict[str, float]:
    """Median host time of each function in ``fns`` called in order right after a synchronisation
    (that waited ``wait_ms`` for a GPU sleep, as a synchronised step waits for the previous one): the
    first one pays whatever the first launches after an idle queue and a long wait cost."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    try:
        mhz = torch.cuda.clock_rate()  # through pynvml
    except Exception:  # noqa: BLE001 - no pynvml: Hopper's boost clock is near enough for a sleep
        mhz = 1980
    cycles = int(wait_ms * 1e-3 * mhz * 1e6) if wait_ms else 0
    for _ in range(reps):
        if cycles:
            torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def _checkpoints(block, stamps: dict[str, float]) -> list[tuple[object, str, object]]:
    """Wrap the functions on the way to the first expert GEMM so each records the host time it is
    first entered (or, for the router, left) in ``stamps``; returns ``(module, name, original)`` to undo."""
    from lightning_sloth.kernels import moe_fused

    from lightning_sloth.moe import experts as moe_experts
    from lightning_sloth.moe import fused as moe_fused_ops
    from lightning_sloth.moe import peft as moe_peft

    patches = []

    def wrap(module, name, label, after=False):
        original = getattr(module, name)

        def recorded(*a, **k):
            if not after:
                stamps.setdefault(label, time.perf_counter())
            result = original(*a, **k)
            if after:
                stamps.setdefault(label, time.perf_counter())
            return result

        patches.append((module, name, original))
        setattr(module, name, recorded)

    router = getattr(block, "router", None) or block.gate
    wrap(router, "forward", "router_returned", after=True)
    wrap(moe_peft, "experts_and_lora", "peft_factors")
    wrap(moe_peft, "experts_forward", "experts_forward")
    wrap(moe_experts, "group_by_expert", "grouping")
    wrap(moe_experts, "group_by_expert", "grouped", after=True)
    wrap(moe_experts, "_fused_project", "first_projection")
    wrap(moe_fused_ops, "call", "op_call")
    wrap(moe_fused, "grouped_mm", "first_expert_gemm")
    return patches


def probe_shape(bench, shape: str, args) -> dict:
    """One shape's row of the report (module docstring)."""
    from lightning_sloth.kernels import moe_fused
    from lightning_sloth.kernels.moe import _build_tile_table

    from lightning_sloth.moe.peft import experts_and_lora
    from lightning_sloth.moe.routing import group_by_expert, sort_key_dtype

    block = bench._with_lora(bench._block(shape))
    for name, param in block.named_parameters():
        param.requires_grad_("lora_" in name)
    bench._select(block, args.system)
    hidden = bench.SHAPES[shape]["hidden_size"]
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    timing = bench.measure(block, x, grad, warmup=3, timed=args.steps, pipelined=False)

    marks: dict[str, list[float]] = {}
    stamps: dict[str, float] = {}
    patches = _checkpoints(block, stamps)
    try:
        for _ in range(args.steps):
            torch.cuda.synchronize()
            stamps.clear()
            start = time.perf_counter()
            bench._step(block, x, grad)
            for name, at in stamps.items():
                marks.setdefault(name, []).append((at - start) * 1e6)
        torch.cuda.synchronize()
    finally:
        for module, name, original in reversed(patches):
            setattr(module, name, original)
    checkpoints = {name: statistics.median(values) for name, values in marks.items()}

    experts = next(m for m in block.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts"))
    wrapper = next(m for m in block.modules() if type(m).__name__ == "ParamWrapper")
    num_experts = experts.num_experts
    router = getattr(block, "router", None) or block.gate
    router_linear = functools.partial(
        torch.nn.functional.linear, weight=router.weight, bias=getattr(router, "bias", None)
    )
    index = torch.randint(
        0, num_experts, (args.tokens, bench.SHAPES[shape]["num_experts_per_tok"]), device="cuda"
    )
    flat = index.reshape(-1)
    narrow = sort_key_dtype(num_experts)
    grouping = group_by_expert(index, num_experts)
    block_m = moe_fused._tiles(x.device, x.dtype, 2048, 2048)[0]
    max_tiles = -(-flat.numel() // block_m) + num_experts
    small_x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    small_w = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    small_ends = torch.tensor([64, 128, 192, 256], device="cuda", dtype=torch.int32)
    pieces = {
        "sort_int64_keys": host_us(lambda: torch.sort(flat, stable=True)),
        f"sort_{str(narrow).removeprefix('torch.')}_keys_with_cast": host_us(
            lambda: torch.sort(flat.to(narrow), stable=True)
        ),
        "group_by_expert": host_us(lambda: group_by_expert(index, num_experts)),
        "experts_and_lora": host_us(lambda: experts_and_lora(wrapper)),
        "router_linear": host_us(lambda: router_linear(x.view(-1, hidden))),
        "tile_table_launch": host_us(lambda: _build_tile_table(grouping.ends, block_m, max_tiles)),
        "grouped_mm_launch_small": host_us(lambda: moe_fused.grouped_mm(small_x, small_w, small_ends, True)),
        "forward": host_us(lambda: block(x), reps=30, sync_every=1),
        "forward_backward": host_us(lambda: bench._step(block, x, grad), reps=30, sync_every=1),
    }
    h = x.view(-1, hidden)
    sequences = {
        "router_first_after_10ms_wait": after_sync_us(
            {"router": lambda: router(h), "router_again": lambda: router(h)}, reps=20, wait_ms=10.0
        ),
        "router_first": after_sync_us(
            {"router": lambda: router(h), "router_again": lambda: router(h)}, reps=20
        ),
        "block_forward_first_after_10ms_wait": after_sync_us(
            {"forward": lambda: block(x), "forward_again": lambda: block(x)}, reps=10, wait_ms=10.0
        ),
        "block_forward_first": after_sync_us(
            {"forward": lambda: block(x), "forward_again": lambda: block(x)}, reps=10
        ),
    }
    torch.cuda.synchronize()
    return {
        "shape": shape,
        "after_sync_us": sequences,
        "event_median_ms": timing["median_ms"],
        "prefix_us": checkpoints.get("first_expert_gemm", float("nan")),
        "checkpoints_us": dict(sorted(checkpoints.items(), key=lambda item: item[1])),
        "pieces_us": pieces,
    }


def main(argv: list[str] | None = None) -> dict:
    import moe_bench as bench

    from lightning_sloth.bench.measure import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3_30b_a3b,gpt_oss_20b")
    parser.add_argument("--system", default="sloth_fused")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    report = {"environment": environment(), "tokens": args.tokens, "system": args.system, "results": []}
    for shape in args.shapes.split(","):
        row = probe_shape(bench, shape, args)
        report["results"].append(row)
        print(
            f"{shape:14s} event {row['event_median_ms']:6.2f} ms  host to first expert GEMM {row['prefix_us']:6.0f} us",
            flush=True,
        )
        for name, value in row["checkpoints_us"].items():
            print(f"    at {name:31s} {value:8.1f} us")
        for name, value in row["pieces_us"].items():
            print(f"    {name:34s} {value:8.1f} us")
        for name, seq in row["after_sync_us"].items():
            print(f"    after a sync, {name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in seq.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
