"""The LoRA up factor's two rank-r gradient products in one pass against two GEMMs.

GPT-OSS-20B's expert GEMMs at 16k tokens (top-4 of 32 experts, rank 16). ``first_op``: the first
GEMM's output gradient ``grad [S, 5760]`` in expert order gives ``g = grad B_e`` (the LoRA side of
the input gradient) and ``dB = grad^T (s xa)`` per expert; ``two_gemms`` is what the fused op ran
before (``torch._grouped_mm`` twice on Hopper bf16). ``second_op``: the second GEMM's output
gradient, ``[T, 2880]`` in token order, read through the permutation and scaled by the routing
weights; ``two_gemms`` is the Triton GEMM and weight gradient reading it that way. ``one_pass`` is
``kernels.moe_lora_pair.lora_grad_pair``. Device time by CUDA events (median of 30 after 3 warm-up
calls) and each result's relative difference to float64::

    python benchmarks/lora_grad_pair_bench.py lora_grad_pair.json  # gpu
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from lightning_sloth.kernels import moe_lora_pair as kernels

from lightning_sloth.moe import group_by_expert
from lightning_sloth.moe.gemm import _mm, _weight_grad
from lightning_sloth.moe.indexed import indexed_grouped_mm, indexed_weight_grad

TOKENS, TOP_K, EXPERTS, RANK = 16384, 4, 32, 16


def _timed(fn, reps: int = 30) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


def _case(grouping, grad, up, side, idx=None, scale=None) -> dict:
    """Both ways on one gradient: time and difference to float64 of g and dB."""
    ends = [0, *grouping.ends.tolist()]
    spans = list(zip(ends, ends[1:]))
    rows = grad.double() if idx is None else grad.double()[idx // TOP_K] * scale.double()[idx, None]
    want_g = torch.cat([rows[a:b] @ up[e].double() for e, (a, b) in enumerate(spans)])
    want_up = torch.stack([rows[a:b].t() @ side[a:b].double() for a, b in spans])

    def rel(got, want):
        return float((got.double() - want).norm() / want.norm())

    if idx is None:
        two = lambda: (_mm(grad, up, grouping.ends, w_is_kn=True), _weight_grad(grad, side, grouping.ends))  # noqa: E731
    else:

        def two():
            g = indexed_grouped_mm(grad, up, grouping.ends, True, a_idx=idx, div=TOP_K, scale=scale)
            return g, indexed_weight_grad(grad, side, grouping.ends, a_idx=idx, a_div=TOP_K, a_scale=scale)

    def one():
        kw = {} if idx is None else dict(idx=idx, div=TOP_K, scale=scale)
        return kernels.lora_grad_pair(grad, up, side, grouping.ends, **kw)

    out = {"grad": list(grad.shape), "rank": up.shape[2]}
    for name, fn in (("two_gemms", two), ("one_pass", one)):
        g, d_up = fn()
        median, best = _timed(fn)
        out[name] = {
            "median_ms": median,
            "min_ms": best,
            "g_rel_diff_vs_float64": rel(g, want_g),
            "dB_rel_diff_vs_float64": rel(d_up, want_up),
        }
    return out


def main(out_path: str) -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    grouping = group_by_expert(torch.rand(TOKENS, EXPERTS, device=dev).topk(TOP_K, dim=-1).indices, EXPERTS)
    rows = TOKENS * TOP_K
    side = torch.randn(rows, RANK, device=dev, dtype=bf16)
    results = {}
    for name, width, indexed in (("first_op", 5760, False), ("second_op", 2880, True)):
        up = (torch.randn(EXPERTS, width, RANK, device=dev) * 0.1).to(bf16)
        if indexed:
            grad = torch.randn(TOKENS, width, device=dev, dtype=bf16)
            scale = torch.rand(rows, device=dev)
            results[name] = _case(grouping, grad, up, side, grouping.perm, scale)
        else:
            results[name] = _case(grouping, torch.randn(rows, width, device=dev, dtype=bf16), up, side)
        print(name, json.dumps(results[name]), flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lora_grad_pair.json")
