"""The per-row FP8 quantisation (``kernels/fp8.py::quantize_rows``) at the 8B shape's widths on one
GPU: time and bandwidth with rows read once (kept in registers) or walked twice, against a copy.

The FP8 step quantises ``[16384, 4096]`` inputs and gradients and the ``[16384, 14336]`` gradients of
gate and up (with W's scales folded in) on every layer; rows wider than ``ONE_PASS_MAX_COLS`` are
walked twice (the amax, then the codes). Each setting's codes and scales are checked bit for bit
against the default's. Times are medians of ``triton.testing.do_bench`` (L2 flushed before each call)::

    python benchmarks/fp8_quantize_bench.py --out fp8_quantize_h100.json  # gpu
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from lightning_sloth.kernels import fp8 as fp8_kernels
from triton.testing import do_bench

from lightning_sloth.bench.measure import environment

WIDTHS = (4096, 14336)
ONE_PASS = (4096, 16384)


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(rows: int, widths=WIDTHS, one_pass=ONE_PASS, device: str = "cuda") -> list[dict]:
    """A row per width, with or without column scales, and setting. ``device="cpu"`` (under
    ``TRITON_INTERPRET=1``) walks the same code with wall-clock stand-ins, for the CPU test."""
    timer = do_bench if device == "cuda" else _wall_ms
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    default = fp8_kernels.ONE_PASS_MAX_COLS
    out = []
    try:
        for width in widths:
            x = torch.randn(rows, width, generator=gen, device=device).to(dtype)
            col = torch.rand(width, generator=gen, device=device) + 0.5
            for col_scale in (None, col):
                fp8_kernels.ONE_PASS_MAX_COLS = default
                want = fp8_kernels.quantize_rows(x, torch.float8_e4m3fn, col_scale)
                traffic = rows * width * (x.element_size() + 1) + rows * 4
                for setting in one_pass:
                    fp8_kernels.ONE_PASS_MAX_COLS = setting
                    got = fp8_kernels.quantize_rows(x, torch.float8_e4m3fn, col_scale)
                    ms = timer(lambda: fp8_kernels.quantize_rows(x, torch.float8_e4m3fn, col_scale))  # noqa: B023
                    row = {
                        "rows": rows, "width": width, "col_scale": col_scale is not None,
                        "one_pass_max_cols": setting, "one_pass": width <= setting, "ms": ms,
                        "tb_per_s": traffic / ms / 1e9,
                        "same_bits": bool(torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                                          and torch.equal(got[1], want[1])),
                    }  # fmt: skip
                    out.append(row)
                    print(
                        f"width {width:6d} col_scale {row['col_scale']!s:5} one pass up to {setting:6d}: "
                        f"{ms:.3f} ms, {row['tb_per_s']:.2f} TB/s, same bits {row['same_bits']}"
                    )
    finally:
        fp8_kernels.ONE_PASS_MAX_COLS = default
    return out


def best_one_pass(rows: list[dict]) -> int:
    """The bound whose time, summed over the widths with W's scales folded in (the gradients the step
    quantises most), is least; on a tie the first one timed (the default, 4,096, in a full run)."""
    totals: dict[int, float] = {}
    for row in rows:
        if row["col_scale"] and row["same_bits"]:
            totals[row["one_pass_max_cols"]] = totals.get(row["one_pass_max_cols"], 0.0) + row["ms"]
    if not totals:
        raise ValueError("no setting gave the default's bits")
    order = list(totals)
    return min(order, key=lambda k: (totals[k], order.index(k)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_quantize.json")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--best", metavar="JSON", help="print the fastest bound of a results file and exit")
    args = parser.parse_args()
    if args.best:
        with open(args.best) as f:
            print(best_one_pass(json.load(f)["rows"]))
        return
    src = torch.empty(args.rows * max(WIDTHS), dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    rows = run(args.rows)
    result = {
        "environment": environment(),
        "copy_tb_per_s": 2 * src.numel() * 2 / copy_ms / 1e9,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
