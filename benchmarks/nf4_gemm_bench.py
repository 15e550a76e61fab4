"""4-bit base products: decode inside the GEMM (fused) vs dequantise into a buffer + cuBLAS (buffer).

For each Llama-3.1-8B projection shape and token count, bf16, NF4 weight (block 64):

    forward          fused: matmul_4bit(x)                 buffer: dequantise W; x @ W^T
    forward+backward fused: matmul_4bit(x), matmul_4bit_t(dy)
                     buffer: dequantise W; x @ W^T; dequantise W again; dy @ W   (as sloth::lora_linear_4bit)

Timings are ``triton.testing.do_bench`` medians (L2 flushed between runs). ``crossover`` gives,
per shape and direction, the largest token count at which the fused path is faster; the LoRA op's
``FUSED_MAX_ROWS`` is read from it::

    python benchmarks/nf4_gemm_bench.py --out benchmarks/results/nf4_gemm_h100.json
"""

from __future__ import annotations

import argparse
import json

import torch

# (in_features, out_features) of the 8B projections: q/o, k/v, gate/up, down.
SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
TOKENS = [16, 64, 256, 512, 1024, 2048, 16384]


def _paths(k: int, n: int, tokens: int):
    from lightning_sloth.kernels.nf4 import dequantize_4bit
    from lightning_sloth.kernels.nf4_gemm import matmul_4bit, matmul_4bit_t

    from lightning_sloth.quant import quantize_4bit

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = quantize_4bit(torch.randn(n, k, device="cuda", generator=gen) * 0.02, "nf4")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    buffer = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    storage = (q.packed, q.absmax, q.code, q.blocksize)

    def fused_fwd():
        return matmul_4bit(x, *storage, n)

    def buffer_fwd():
        return x @ dequantize_4bit(*storage, buffer).t()

    def fused_fwd_bwd():
        matmul_4bit(x, *storage, n)
        return matmul_4bit_t(dy, *storage, k)

    def buffer_fwd_bwd():
        x @ dequantize_4bit(*storage, buffer).t()
        return dy @ dequantize_4bit(*storage, buffer)

    err = (fused_fwd().float() - buffer_fwd().float()).norm() / buffer_fwd().float().norm()
    return {
        "forward": (fused_fwd, buffer_fwd),
        "forward_backward": (fused_fwd_bwd, buffer_fwd_bwd),
    }, float(err)


def run(shapes, tokens_list) -> dict:
    from triton.testing import do_bench

    rows = []
    for k, n in shapes:
        for tokens in tokens_list:
            paths, err = _paths(k, n, tokens)
            row = {"in_features": k, "out_features": n, "tokens": tokens, "fused_vs_buffer_rel_diff": err}
            for direction, (fused, buffer) in paths.items():
                row[f"{direction}_fused_ms"] = do_bench(fused, warmup=10, rep=40)
                row[f"{direction}_buffer_ms"] = do_bench(buffer, warmup=10, rep=40)
                row[f"{direction}_fused_speedup"] = (
                    row[f"{direction}_buffer_ms"] / row[f"{direction}_fused_ms"]
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    crossover = {}
    for k, n in shapes:
        for direction in ("forward", "forward_backward"):
            wins = [
                r["tokens"]
                for r in rows
                if (r["in_features"], r["out_features"]) == (k, n) and r[f"{direction}_fused_speedup"] > 1
            ]
            crossover[f"{k}->{n}/{direction}"] = max(wins, default=0)
    return {"rows": rows, "largest_tokens_where_fused_wins": crossover}


def main(argv: list[str] | None = None) -> dict:
    from lightning_sloth.bench.measure import environment
    from lightning_sloth.ops.nf4 import FUSED_MAX_ROWS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = parser.parse_args(argv)
    report = {
        "benchmark": "4-bit (NF4) base product: fused decode-in-GEMM vs dequantise + cuBLAS, bf16",
        "environment": environment(),
        "fused_max_rows_in_code": FUSED_MAX_ROWS,
        **run(SHAPES, [int(t) for t in args.tokens.split(",")]),
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
