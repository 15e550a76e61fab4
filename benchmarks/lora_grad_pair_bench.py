"""The LoRA up factor's two rank-r gradient products in one pass against two GEMMs.

GPT-OSS-20B's first expert GEMM at 16k tokens (top-4 of 32 experts, rank 16): its output's
gradient ``grad [S, 5760]`` in expert order gives ``g = grad B_e`` (the LoRA side of the input
gradient) and ``dB = grad^T (s xa)`` per expert. ``two_gemms`` is what the fused op ran before
(``torch._grouped_mm`` twice on Hopper bf16), ``one_pass`` is
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

TOKENS, TOP_K, EXPERTS, WIDTH, RANK = 16384, 4, 32, 5760, 16


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


def main(out_path: str) -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    grouping = group_by_expert(torch.rand(TOKENS, EXPERTS, device=dev).topk(TOP_K, dim=-1).indices, EXPERTS)
    rows = TOKENS * TOP_K
    grad = torch.randn(rows, WIDTH, device=dev, dtype=bf16)
    up = (torch.randn(EXPERTS, WIDTH, RANK, device=dev) * 0.1).to(bf16)
    side = torch.randn(rows, RANK, device=dev, dtype=bf16)
    ends = [0, *grouping.ends.tolist()]
    spans = list(zip(ends, ends[1:]))
    want_g = torch.cat([grad[a:b].double() @ up[e].double() for e, (a, b) in enumerate(spans)])
    want_up = torch.stack([grad[a:b].double().t() @ side[a:b].double() for a, b in spans])

    def rel(got, want):
        return float((got.double() - want).norm() / want.norm())

    systems = {
        "two_gemms": lambda: (
            _mm(grad, up, grouping.ends, w_is_kn=True),
            _weight_grad(grad, side, grouping.ends),
        ),
        "one_pass": lambda: kernels.lora_grad_pair(grad, up, side, grouping.ends),
    }
    results = {"shape": {"rows": rows, "width": WIDTH, "rank": RANK, "experts": EXPERTS}}
    for name, fn in systems.items():
        g, d_up = fn()
        median, best = _timed(fn)
        results[name] = {
            "median_ms": median,
            "min_ms": best,
            "g_rel_diff_vs_float64": rel(g, want_g),
            "dB_rel_diff_vs_float64": rel(d_up, want_up),
        }
        print(f"{name:10s} {json.dumps(results[name])}", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lora_grad_pair.json")
