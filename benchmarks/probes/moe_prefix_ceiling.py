"""How much of a synchronised MoE block step the host's prefix costs: the fused block with pieces of
its forward replayed instead of computed.

Variants, each timed in three interleaved rounds of 20 synchronised steps (CUDA events; the GPU idle
at each step's start, as ``benchmarks/moe_bench.py`` times it) and 20 steps back to back:

- ``as_is``: the block as the benchmark runs it (transformers' router, the fused experts);
- ``router_cached``: the router's forward returns the outputs of an earlier call (its weights a leaf
  that takes the gradient, so the experts' backward is the same; the router's own backward is gone);
- ``factors_cached``: PEFT's factors (``experts_and_lora``) read once;
- ``router_group_cached``: the router's outputs and the grouping (``group_by_expert``) both replayed;
- ``all_cached``: all three.

A ceiling, not a path: what any faster router, grouping or factor lookup could at most save. The
transformers ``grouped_mm`` block's synchronised time in the same process is the ratio's base::

    python benchmarks/probes/moe_prefix_ceiling.py --out ceiling.json [--shapes qwen3_30b_a3b,gpt_oss_20b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_bench
import moe_bench as bench  # noqa: E402

from lightning_sloth.moe import experts as moe_experts  # noqa: E402
from lightning_sloth.moe import peft as moe_peft  # noqa: E402


def timed(block, x, grad, steps=20):
    """``(median ms of synchronised steps, ms per step back to back)``: ``moe_bench.measure``'s two figures."""
    timing = bench.measure(block, x, grad, warmup=0, timed=steps)
    return timing["median_ms"], timing["pipelined_ms"]


def run(shape, out):
    """Time one shape's variants (module docstring) and append its row to ``out``."""
    block = bench._with_lora(bench._block(shape))
    for n, p in block.named_parameters():
        p.requires_grad_("lora_" in n)
    bench._select(block, "sloth_fused")
    hidden = bench.SHAPES[shape]["hidden_size"]
    torch.manual_seed(1)
    x = torch.randn(1, 16384, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    router = getattr(block, "router", None) or block.gate
    for _ in range(3):
        bench._step(block, x, grad)
    with torch.no_grad():
        logits, w, idx = router(x.view(-1, hidden))
    orig_forward = router.forward
    orig_factors = moe_peft.experts_and_lora
    orig_group = moe_experts.group_by_expert
    memo = {}

    def cached_router(h):
        return logits, w.detach().requires_grad_(True), idx

    def cached_factors(m):
        if "f" not in memo:
            memo["f"] = orig_factors(m)
        return memo["f"]

    def cached_group(index, n):
        if "g" not in memo:
            memo["g"] = orig_group(index, n)
        return memo["g"]

    def setv(router_c, factors_c, group_c):
        router.forward = cached_router if router_c else orig_forward
        moe_peft.experts_and_lora = cached_factors if factors_c else orig_factors
        moe_experts.group_by_expert = cached_group if group_c else orig_group
        memo.clear()

    variants = {
        "as_is": (0, 0, 0),
        "router_cached": (1, 0, 0),
        "factors_cached": (0, 1, 0),
        "router_group_cached": (1, 0, 1),
        "all_cached": (1, 1, 1),
    }
    res = {k: {"sync_ms": [], "b2b_ms": []} for k in variants}
    for _round in range(3):
        for name, v in variants.items():
            setv(*v)
            for _ in range(2):
                bench._step(block, x, grad)
            s, b = timed(block, x, grad)
            res[name]["sync_ms"].append(s)
            res[name]["b2b_ms"].append(b)
    setv(0, 0, 0)
    gm = bench._with_lora(bench._block(shape))
    for n, p in gm.named_parameters():
        p.requires_grad_("lora_" in n)
    bench._select(gm, "grouped_mm")
    for _ in range(3):
        bench._step(gm, x, grad)
    base = [timed(gm, x, grad)[0] for _ in range(2)]
    row = {"shape": shape, "grouped_mm_sync_ms": base, "variants": res}
    out.append(row)
    g = statistics.median(base)
    print(f"{shape}: grouped_mm {g:.2f} ms")
    for name, r in res.items():
        s = statistics.median(r["sync_ms"])
        print(
            f"  {name:22s} sync {s:6.2f} ms ({g / s:.2f}x)  rounds {[f'{t:.2f}' for t in r['sync_ms']]}  b2b {statistics.median(r['b2b_ms']):.2f}"
        )


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3_30b_a3b,gpt_oss_20b")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = []
    for shape in args.shapes.split(","):
        run(shape, out)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
