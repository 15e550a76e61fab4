"""GPT-OSS's clamped SwiGLU backward in the epilogue of the second expert GEMM's input gradient.

One GEMM of the GPT-OSS-20B block at 16k tokens (top-4 of 32 experts, ``[S, 2880] @ W_e^T`` with
the rows read through the permutation and scaled by the routing weights, the rank-16 LoRA term in
the epilogue): alone, with the separate activation backward after it, and with that backward made
in its epilogue in each of the ways ``kernels.moe_fused.ACT_EPILOGUE`` names. Device time by CUDA
events (median of 30 after 3 warm-up calls), the compiled kernel's registers and spills, and
whether h's gradient equals the separate pass's bit for bit::

    python benchmarks/act_epilogue_probe.py act_epilogue_probe.json  # gpu
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from lightning_sloth.kernels import moe as moe_kernels
from lightning_sloth.kernels import moe_fused as kernels

from lightning_sloth.moe import group_by_expert

TOKENS, TOP_K, EXPERTS, HIDDEN, INNER, RANK = 16384, 4, 32, 2880, 2880, 16
ALPHA, LIMIT = 1.702, 7.0


def _compiled() -> dict:
    """``{key: (registers, spills)}`` of the fused GEMM kernel's compiled variants."""
    out = {}
    for entry in kernels._indexed_grouped_mm_kernel.device_caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for key, compiled in cache.items():
            out[str(key)] = (getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None))
    return out


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
    grad = torch.randn(TOKENS, HIDDEN, device=dev, dtype=bf16)
    w = (torch.randn(EXPERTS, INNER, HIDDEN, device=dev) * HIDDEN**-0.5).to(bf16)  # [E, N, K]
    h = (2 * torch.randn(rows, 2 * INNER, device=dev)).to(bf16)
    kw = dict(
        a_idx=grouping.perm, div=TOP_K, scale=torch.rand(rows, device=dev), covered=True, w2_is_kn=True,
        x2=torch.randn(rows, RANK, device=dev, dtype=bf16) * 0.1,
        w2=torch.randn(EXPERTS, RANK, INNER, device=dev, dtype=bf16) * 0.1,
    )  # fmt: skip

    def gemm_only():
        return kernels.grouped_mm(grad, w, grouping.ends, False, **kw)

    def separate():
        return moe_kernels.clamped_swiglu_backward(gemm_only(), h, ALPHA, LIMIT)

    def epilogue(way, tiles=None):
        def run():
            before = kernels.ACT_EPILOGUE, kernels.TILES
            kernels.ACT_EPILOGUE, kernels.TILES = way, tiles
            try:
                return kernels.grouped_mm(
                    grad, w, grouping.ends, False, act_h=h, act_alpha=ALPHA, act_limit=LIMIT, **kw
                )
            finally:
                kernels.ACT_EPILOGUE, kernels.TILES = before

        return run

    want = separate()
    cases = [("gemm_only", gemm_only), ("separate", separate)]
    cases += [(f"epilogue_{way}", epilogue(way)) for way in (1, 2, 3, 4)]
    cases += [(f"epilogue_{way}_bn128", epilogue(way, (128, 128, 64, 8, 4))) for way in (1, 2)]
    results = {}
    for name, fn in cases:
        before = set(_compiled())
        try:
            got = fn()
            entry = {"regs_spills": [v for k, v in _compiled().items() if k not in before]}
            entry["median_ms"], entry["min_ms"] = _timed(fn)
            if name.startswith("epilogue"):
                entry["equal_to_separate"] = bool(torch.equal(got, want))
        except Exception as error:  # a tile that does not fit
            entry = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        results[name] = entry
        print(f"{name:22s} {json.dumps(entry)[:200]}", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "act_epilogue_probe.json")
