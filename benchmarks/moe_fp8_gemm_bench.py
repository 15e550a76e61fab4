"""FP8 expert GEMMs against bf16 on the MoE block shapes: ``torch._scaled_grouped_mm`` (row-wise
scales) beside ``torch._grouped_mm``, and what the row quantisation costs.

For each shape (16,384 tokens routed top-k: Qwen3-30B-A3B, GPT-OSS-20B) and each of the four base
GEMMs a LoRA step makes on frozen experts (the first and second GEMM's forward, and their input
gradients), bf16 operands in expert order with the block's balanced routing:

    bf16          torch._grouped_mm(x, W_e)                      (CUTLASS)
    fp8           torch._scaled_grouped_mm(q(x), q(W_e), ...)     use_fast_accum on
    fp8_exact     the same with use_fast_accum off
    quantize      the row quantisation of the bf16 input (``kernels.fp8.quantize_rows``)

The weights are quantised per output channel once (outside the timing); the input gradient reads
a transposed copy of the codes with W's scales folded into the gradient's columns (unit scales on
the weight's side), as ``sloth::linear_fp8``'s backward does. Medians of ``triton.testing.do_bench``
(ms) and TFLOP/s; the relative Frobenius error of each FP8 product against the float64 product of
the unquantised operands, beside bf16's own::

    python benchmarks/moe_fp8_gemm_bench.py --out $OUT/moe_fp8_gemm_h200.json   # gpu
"""

from __future__ import annotations

import argparse
import json
import os

import torch

SHAPES = {
    # name: (hidden, intermediate, experts, top_k)
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "gpt_oss_20b": (2880, 2880, 32, 4),
}


def _error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return float((actual.double() - exact).norm() / exact.norm())


def _balanced_ends(rows: int, experts: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(experts), rows, replacement=True, generator=gen).bincount(
        minlength=experts
    )
    return counts.cumsum(0).to(torch.int32).to(device)


def _exact(x: torch.Tensor, w_kn: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], w_kn.shape[2], dtype=torch.float64, device=x.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end].double() @ w_kn[e].double()
        start = end
    return out


def _measure_gemm(name, gemm, rows, k, n, experts, ends, gen) -> dict:
    from lightning_sloth.kernels.fp8 import quantize_rows as quantize_kernel
    from triton.testing import do_bench

    from lightning_sloth.ops.fp8_formats import FP8_DTYPES, quantize_rows

    e4m3 = FP8_DTYPES["e4m3"]
    w = torch.randn(experts, n, k, device="cuda", generator=gen) * 0.02  # [E, N, K]
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w_kn16 = w.bfloat16().transpose(-2, -1)
    # per output channel (e, n): rows of the [E*N, K] view
    qw, sw = quantize_rows(w.reshape(experts * n, k), "e4m3")
    qw = qw.view(experts, n, k)
    sw = sw.view(experts, n)
    qx, sx = quantize_kernel(x, e4m3, None)
    flops = 2 * rows * k * n
    exact = _exact(x, w.transpose(-2, -1), ends)

    def bf16():
        return torch._grouped_mm(x, w_kn16, offs=ends)

    def fp8(fast: bool):
        return torch._scaled_grouped_mm(
            qx,
            qw.transpose(-2, -1),
            sx.view(-1),
            sw,
            offs=ends,
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )

    def quantize():
        return quantize_kernel(x, e4m3, None)

    row = {"shape": name, "gemm": gemm, "rows": rows, "k": k, "n": n, "experts": experts}
    for label, fn in (("bf16", bf16), ("fp8", lambda: fp8(True)), ("fp8_exact", lambda: fp8(False))):
        try:
            out = fn()
            ms = do_bench(fn, warmup=25, rep=200)
            row[f"{label}_ms"] = round(ms, 4)
            row[f"{label}_tflops"] = round(flops / ms / 1e9, 1)
            row[f"{label}_error"] = _error(out, exact)
        except Exception as e:  # noqa: BLE001 - record what the build refuses
            row[f"{label}_error_text"] = f"{type(e).__name__}: {e}"[:300]
    row["quantize_ms"] = round(do_bench(quantize, warmup=25, rep=200), 4)
    return row


def measure(name: str, tokens: int) -> list[dict]:
    hidden, inter, experts, top_k = SHAPES[name]
    rows = tokens * top_k
    ends = _balanced_ends(rows, experts, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    gemms = {
        # gemm: (K, N) of x [S, K] @ W_e [K, N]; the weight is stored [E, N, K] (nn.Linear order)
        "gate_up_forward": (hidden, 2 * inter),
        "down_forward": (inter, hidden),
        "gate_up_input_grad": (2 * inter, hidden),
        "down_input_grad": (hidden, inter),
    }
    results = []
    for gemm, (k, n) in gemms.items():
        results.append(_measure_gemm(name, gemm, rows, k, n, experts, ends, gen))
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.shapes.split(","):
        results.extend(measure(name, args.tokens))
    print(
        f"{'shape':15} {'gemm':20} {'bf16 ms':>8} {'fp8 ms':>8} {'exact ms':>8} {'quant ms':>8} {'speed-up':>8}"
    )
    for r in results:
        speed = r["bf16_ms"] / r["fp8_ms"] if "fp8_ms" in r and "bf16_ms" in r else float("nan")
        print(
            f"{r['shape']:15} {r['gemm']:20} {r.get('bf16_ms', float('nan')):8.3f} {r.get('fp8_ms', float('nan')):8.3f} "
            f"{r.get('fp8_exact_ms', float('nan')):8.3f} {r['quantize_ms']:8.3f} {speed:8.2f}"
        )
        for key in ("fp8_error_text", "fp8_exact_error_text", "bf16_error_text"):
            if key in r:
                print("   ", key, r[key])
    doc = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "results": results,
    }
    out = args.out or os.path.join(os.environ.get("OUT", "benchmarks/results"), "moe_fp8_gemm.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
