"""What an MoE router costs: transformers' bf16 router, lightning_sloth's one-kernel router and its
float32 plain-torch rule, forward and forward + backward, and the router kernels alone.

For each shape (the routers of ``benchmarks/moe_bench.py``'s blocks, 16k tokens, bf16 x that takes
a gradient, the router's weight frozen as under LoRA) this probe reports:

- ``routers``: per router, ``[[forward event us, forward host us], [forward+backward event us,
  forward+backward host us]]``, medians of 50 synchronised calls (so the event time includes the
  GPU's wait for the host): ``transformers_bf16`` (the class's forward), ``sloth_kernel``
  (``install_router``: ``sloth::moe_router_topk``) and ``sloth_fp32_torch`` (the same router through
  ``router_logits`` and the family's rule of ``ROUTERS``, the forward before the kernel);
- ``kernel_sweep_us``: the forward and backward kernels alone, time per call over 50 calls queued
  back to back, for several tile choices (``kernels.moe_router.TILES``, ``BACKWARD_TILES``; a call
  whose host time exceeds the kernel's shows its host time), beside torch's softmax + top-k on the
  same logits.

::

    python benchmarks/probes/moe_router.py --out router.json [--shapes qwen3_30b_a3b,gpt_oss_20b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_bench

FORWARD_TILES = [(64, 64), (32, 128), (16, 128), (32, 64), (64, 128)]
BACKWARD_TILES = [(32, 128), (16, 128), (64, 64), (16, 256), (32, 64)]


def synchronised_us(fn, reps: int = 50) -> tuple[float, float]:
    """``(event us, host us)``: medians over ``reps`` calls, each started on an idle GPU."""
    events, hosts = [], []
    for _ in range(5):
        fn()
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        host = time.perf_counter() - began
        torch.cuda.synchronize()
        events.append(start.elapsed_time(end) * 1e3)
        hosts.append(host * 1e6)
    return round(statistics.median(events), 1), round(statistics.median(hosts), 1)


def back_to_back_us(fn, reps: int = 50) -> float:
    """Time per call of ``reps`` calls queued back to back (one synchronisation at the end)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps * 1e3, 1)


def _routers(bench, shape: str, tokens: int) -> dict:
    from lightning_sloth.patching import experts as patched_experts
    from lightning_sloth.patching import install_router, uninstall_router

    block = bench._block(shape)
    router = getattr(block, "router", None) or block.gate
    config = block.experts.config
    hidden, top_k = bench.SHAPES[shape]["hidden_size"], bench.SHAPES[shape]["num_experts_per_tok"]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn(tokens, top_k, device="cuda")
    for param in router.parameters():
        param.requires_grad_(False)

    def forward():
        return router(x)

    def step():
        _, weights, _ = router(x)
        (weights.float() * probe).sum().backward()
        x.grad = None

    rows = {}
    uninstall_router(router)
    rows["transformers_bf16"] = [synchronised_us(forward), synchronised_us(step)]
    install_router(router, config.model_type, config)
    rows["sloth_kernel"] = [synchronised_us(forward), synchronised_us(step)]
    rule = patched_experts.fused_router_rule
    patched_experts.fused_router_rule = lambda *args: None  # the plain-torch rule of ROUTERS
    try:
        rows["sloth_fp32_torch"] = [synchronised_us(forward), synchronised_us(step)]
    finally:
        patched_experts.fused_router_rule = rule
        uninstall_router(router)
    return rows


def _kernels(bench, shape: str, tokens: int) -> dict:
    from lightning_sloth.kernels import moe_router as kernels

    block = bench._block(shape)
    router = getattr(block, "router", None) or block.gate
    hidden, top_k = bench.SHAPES[shape]["hidden_size"], bench.SHAPES[shape]["num_experts_per_tok"]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weight = router.weight.detach()
    bias = None if getattr(router, "bias", None) is None else router.bias.detach()
    softmax_first = shape.startswith("qwen")
    logits, weights, index = kernels.router_topk(x, weight, bias, top_k, softmax_first, softmax_first)
    grad = torch.randn_like(weights)
    sweep = {}
    try:
        for tiles in FORWARD_TILES:
            kernels.TILES = tiles
            sweep[f"forward {tiles}"] = back_to_back_us(
                lambda: kernels.router_topk(x, weight, bias, top_k, softmax_first, softmax_first)
            )
        kernels.TILES = None
        for tiles in BACKWARD_TILES:
            kernels.BACKWARD_TILES = tiles
            sweep[f"backward {tiles}"] = back_to_back_us(
                lambda: kernels.router_topk_backward(grad, weights, index, logits, None, weight, False)
            )
    finally:
        kernels.TILES = kernels.BACKWARD_TILES = None
    sweep["torch softmax + top-k"] = back_to_back_us(lambda: torch.topk(torch.softmax(logits, -1), top_k, -1))
    return sweep


def main(argv: list[str] | None = None) -> dict:
    import moe_bench as bench

    from lightning_sloth.bench.measure import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3_30b_a3b,gpt_oss_20b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    report = {"environment": environment(), "tokens": args.tokens, "results": {}}
    for shape in args.shapes.split(","):
        row = {
            "routers": _routers(bench, shape, args.tokens),
            "kernel_sweep_us": _kernels(bench, shape, args.tokens),
        }
        report["results"][shape] = row
        for name, ((fwd_event, fwd_host), (step_event, step_host)) in row["routers"].items():
            print(
                f"{shape:14s} {name:18s} forward {fwd_event:7.1f} us (host {fwd_host:6.1f}) | "
                f"forward + backward {step_event:7.1f} us (host {step_host:6.1f})",
                flush=True,
            )
        for name, value in row["kernel_sweep_us"].items():
            print(f"    {name:28s} {value:6.1f} us per call")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
