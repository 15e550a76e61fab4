"""FP8 base products against bf16 on the Llama-3.1-8B projection shapes: speed and error of each
input-gradient format.

For each projection ``(in, out)`` and token count, bf16 activations:

    bf16        y = x W^T (cuBLAS),        dx = dy W
    fp8         y = sloth::linear_fp8(x),  dx in e4m3 / e5m2 / bf16 (the FP8 weight dequantised)
    nf4         sloth::lora_linear_4bit's base product (dequantise into a buffer + cuBLAS), rank 0
    nf4_fp8     sloth::linear_4bit_fp8 (decode to bf16, quantise per row, _scaled_mm)

Times are ``triton.testing.do_bench`` medians (ms) of the forward and of forward + backward; errors
are relative Frobenius errors of y and dx against the float64 product with the unquantised weight
(the bf16 row is the floor every format sits on)::

    python benchmarks/fp8_gemm_bench.py --out $OUT/fp8_gemm_h100.json     # about 1 minute on an H100

``--accum`` times the bare ``torch._scaled_mm`` products instead (row-wise scales, operands
quantised once outside the timing): the forward ``x W^T`` and the input gradient ``dy W`` with
``use_fast_accum`` off and on, each against the float64 product of the same FP8 operands (the
accumulation's own error) and against bf16 cuBLAS on the same shapes::

    python benchmarks/fp8_gemm_bench.py --accum --out $OUT/fp8_accum_h100.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]  # q/o, k/v, gate/up, down
TOKENS = [2048, 16384]


def _error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return float((actual.detach().double() - exact).norm() / exact.norm())


def measure(k: int, n: int, tokens: int) -> dict:
    from triton.testing import do_bench

    from lightning_sloth.ops.fp8 import linear_4bit_fp8, linear_fp8
    from lightning_sloth.ops.fp8_formats import quantize_rows
    from lightning_sloth.ops.nf4 import lora_linear_4bit
    from lightning_sloth.quant import quantize_4bit

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(tokens, n, device="cuda", generator=gen).bfloat16()
    exact_y = x.detach().double() @ w.double().t()
    exact_dx = dy.double() @ w.double()
    codes, scale = quantize_rows(w, "e4m3")
    w16 = w.bfloat16()
    nf4 = quantize_4bit(w, "nf4")
    storage = (nf4.packed, nf4.block_absmax(), nf4.code, nf4.blocksize)
    empty_a, empty_b = x.new_empty(0, k), x.new_empty(n, 0)

    systems = {
        "bf16": lambda t: t @ w16.t(),
        "fp8_e4m3": lambda t: linear_fp8(t, codes, scale, "e4m3"),
        "fp8_e5m2": lambda t: linear_fp8(t, codes, scale, "e5m2"),
        "fp8_bf16grad": lambda t: linear_fp8(t, codes, scale, "bf16"),
        "nf4": lambda t: lora_linear_4bit(t, *storage, empty_a, empty_b, 0.0),
        "nf4_fp8_e4m3": lambda t: linear_4bit_fp8(t, *storage, n, "e4m3"),
    }
    rows = {}
    for name, fn in systems.items():
        row = {}
        try:
            y = fn(x)
            (dx,) = torch.autograd.grad(y, x, dy)
            row["y_error"], row["dx_error"] = _error(y, exact_y), _error(dx, exact_dx)
            row["forward_ms"] = do_bench(lambda fn=fn: fn(x.detach()))
            row["forward_backward_ms"] = do_bench(lambda fn=fn: torch.autograd.grad(fn(x), x, dy))
        except Exception as error:  # record what a format cannot do here (e.g. a _scaled_mm dtype rule)
            row["error"] = f"{type(error).__name__}: {error}"
        rows[name] = row
    return rows


def measure_accum(k: int, n: int, tokens: int) -> dict:
    from triton.testing import do_bench

    from lightning_sloth.ops.fp8_formats import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(tokens, n, device="cuda", generator=gen).bfloat16()
    qw, sw = quantize_rows(w, "e4m3")  # [n, k], [n, 1]
    qx, sx = quantize_rows(x, "e4m3")  # [tokens, k], [tokens, 1]
    qg, sg = quantize_rows(dy.float() * sw.view(1, -1), "e4m3")  # W's scales folded into dy
    w_col = qw.t().contiguous().t()  # [n, k] column-major: dy W's second operand
    ones = torch.ones(1, k, device="cuda")
    products = {
        "forward": (
            lambda fast: torch._scaled_mm(
                qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16, use_fast_accum=fast
            ),
            (qx.double() * sx.double()) @ (qw.double() * sw.double()).t(),
            lambda: x @ w.bfloat16().t(),
            2 * tokens * k * n,
        ),
        "input_grad": (
            lambda fast: torch._scaled_mm(
                qg, w_col, scale_a=sg, scale_b=ones, out_dtype=torch.bfloat16, use_fast_accum=fast
            ),
            (qg.double() * sg.double()) @ qw.double(),
            lambda: dy @ w.bfloat16(),
            2 * tokens * k * n,
        ),
    }
    rows = {}
    for name, (fn, exact, bf16, flops) in products.items():
        row = {"bf16_ms": do_bench(bf16)}
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        for fast in (False, True):
            key = "fast" if fast else "exact"
            try:
                row[f"{key}_error"] = _error(fn(fast), exact)
                row[f"{key}_ms"] = do_bench(lambda fn=fn, fast=fast: fn(fast))
                row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
            except Exception as error:
                row[f"{key}_error_message"] = f"{type(error).__name__}: {error}"
        rows[name] = row
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT") or "benchmarks/results", "fp8_gemm.json")
    )
    parser.add_argument("--accum", action="store_true", help="bare _scaled_mm, use_fast_accum off / on")
    args = parser.parse_args(argv)
    results = []
    for k, n in SHAPES:
        for tokens in TOKENS:
            if args.accum:
                rows = measure_accum(k, n, tokens)
                results.append({"in": k, "out": n, "tokens": tokens, "products": rows})
                for name, row in rows.items():
                    print(
                        f"{k:>6} -> {n:<6} {tokens:>6} {name:<10} bf16 {row['bf16_tflops']:6.0f}  "
                        f"fp8 {row.get('exact_tflops', 0):6.0f} (err {row.get('exact_error', -1):.2e})  "
                        f"fast {row.get('fast_tflops', 0):6.0f} (err {row.get('fast_error', -1):.2e}) TFLOP/s",
                        flush=True,
                    )
                continue
            rows = measure(k, n, tokens)
            results.append({"in": k, "out": n, "tokens": tokens, "systems": rows})
            base = rows["bf16"].get("forward_backward_ms")
            summary = {
                name: f"{row['forward_backward_ms']:.3f} ms ({base / row['forward_backward_ms']:.2f}x)"
                if "forward_backward_ms" in row
                else row.get("error")
                for name, row in rows.items()
            }
            print(k, n, tokens, summary, flush=True)
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": results,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
