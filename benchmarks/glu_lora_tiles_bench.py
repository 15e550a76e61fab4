"""The tiling of the activation with gate and up's LoRA parts (``kernels/glu.py``: the kernels behind
``sloth::swiglu_lora``, used over FP8 bases) on one GPU: forward and in-place backward time and
bandwidth of each tile, beside the plain activation's kernels (the same traffic without the adapters'
parts) and a device-to-device copy.

Each tile is ``block_m x block_n`` values per program and ``num_warps`` warps, the rank-r parts a
tensor-core dot. Every tile's outputs are checked against the float32 reference. (Tiles with the
rank-r parts as fp32 FMAs ran 1.5-4x slower on the H100, ``results/glu_lora_tiles_h100.json``, and
are gone from the kernels.)
Times are medians of ``triton.testing.do_bench`` (the L2 cache flushed before each call)::

    python benchmarks/glu_lora_tiles_bench.py --out glu_lora_tiles_h100.json  # gpu
    python benchmarks/glu_lora_tiles_bench.py --best glu_lora_tiles_h100.json  # the fastest, spelled for the env

``LIGHTNING_SLOTH_GLU_LORA_TILE=$(... --best FILE)`` then runs a whole step with that tile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from lightning_sloth.kernels.glu import (
    LORA_TILE,
    LoraTile,
    glu_backward,
    glu_forward,
    glu_lora_backward,
    glu_lora_forward,
)
from triton.testing import do_bench

from lightning_sloth.bench.measure import environment
from lightning_sloth.ops.glu_lora import glu_lora_backward_reference, glu_lora_reference

SHAPES = {"llama_3_1_8b": (16384, 14336), "llama_3_2_1b": (16384, 8192)}
TILES = [
    LORA_TILE,
    LoraTile(64, 64, 4),
    LoraTile(32, 128, 4),
    LoraTile(16, 256, 4),
    LoraTile(32, 256, 8),
    LoraTile(16, 512, 8),
    LoraTile(16, 128, 4),
    LoraTile(32, 512, 8),
    LoraTile(16, 1024, 8),
]


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run_shape(name: str, rows: int, cols: int, rank: int, tiles=TILES, device: str = "cuda") -> dict:
    """One shape's row of the results. ``device="cpu"`` (under ``TRITON_INTERPRET=1``, float32) walks
    the same code with wall-clock stand-ins for the timings, for the CPU test."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    timer = do_bench if device == "cuda" else _wall_ms

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    gate, up, grad = randn(rows, cols), randn(rows, cols), randn(rows, cols)
    xa, b_gate, b_up = randn(rows, 2 * rank), randn(cols, rank, scale=0.1), randn(cols, rank, scale=0.1)
    args = (xa, b_gate, b_up, 2.0, 2.0, "silu")
    element = gate.element_size()
    fwd_bytes, bwd_bytes = 3 * rows * cols * element, 5 * rows * cols * element

    sample = slice(0, 2048)  # the reference on a slice of rows: float32 of the whole would take GiBs
    ref_out = glu_lora_reference(gate[sample].float(), up[sample].float(), xa[sample].float(),
                                 b_gate.float(), b_up.float(), *args[3:])  # fmt: skip
    ref_grads = glu_lora_backward_reference(
        grad[sample].float(), gate[sample].float(), up[sample].float(), xa[sample].float(),
        b_gate.float(), b_up.float(), *args[3:],
    )  # fmt: skip

    src = torch.empty(rows * cols * 2, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    copy_tbps = 2 * src.numel() * element / copy_ms / 1e9
    plain_fwd = timer(lambda: glu_forward(gate, up, "silu"))
    plain_bwd = timer(lambda: glu_backward(grad, gate, up, "silu"))
    row = {
        "shape": name, "rows": rows, "cols": cols, "rank": rank, "copy_tb_per_s": copy_tbps,
        "plain": {"fwd_ms": plain_fwd, "bwd_ms": plain_bwd,
                  "fwd_tb_per_s": fwd_bytes / plain_fwd / 1e9, "bwd_tb_per_s": bwd_bytes / plain_bwd / 1e9},
        "tiles": [],
    }  # fmt: skip
    scratch = (gate.clone(), up.clone())  # what the timed in-place backward overwrites
    print(
        f"{name}: copy {copy_tbps:.2f} TB/s; plain activation fwd {plain_fwd:.3f} ms, bwd {plain_bwd:.3f} ms"
    )
    for tile in tiles:
        entry = {"tile": tile._asdict()}
        try:
            out = glu_lora_forward(gate, up, *args, tile=tile)
            grads = glu_lora_backward(grad, gate, up, *args, tile=tile)
            entry["rel_err"] = {
                "out": _rel(out[sample], ref_out),
                "grad_gate": _rel(grads[0][sample], ref_grads[0]),
                "grad_up": _rel(grads[1][sample], ref_grads[1]),
            }
            entry["fwd_ms"] = timer(lambda tile=tile: glu_lora_forward(gate, up, *args, tile=tile))
            entry["bwd_ms"] = timer(
                lambda tile=tile: glu_lora_backward(grad, *scratch, *args, in_place=True, tile=tile)
            )
            entry["fwd_tb_per_s"] = fwd_bytes / entry["fwd_ms"] / 1e9
            entry["bwd_tb_per_s"] = bwd_bytes / entry["bwd_ms"] / 1e9
            print(
                f"  {tuple(tile)}: fwd {entry['fwd_ms']:.3f} ms ({entry['fwd_tb_per_s']:.2f} TB/s), "
                f"bwd {entry['bwd_ms']:.3f} ms ({entry['bwd_tb_per_s']:.2f} TB/s), err {entry['rel_err']}"
            )
        except Exception as exc:  # a tile that does not compile or fit is recorded, not fatal
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"  {tuple(tile)}: {entry['error']}")
        row["tiles"].append(entry)
    return row


def best_tile(result: dict, shape: str = "llama_3_1_8b", max_rel_err: float = 2e-2) -> str:
    """The fastest tile of ``shape`` whose values are within ``max_rel_err`` of the reference, as
    ``LIGHTNING_SLOTH_GLU_LORA_TILE`` spells it. A step runs the forward twice (the layer's forward
    and its recompute) and the backward once, so that is the time compared."""
    row = next(r for r in result["rows"] if r["shape"] == shape)
    good = [
        t
        for t in row["tiles"]
        if "error" not in t and not t["tile"].get("fma") and max(t["rel_err"].values()) <= max_rel_err
    ]  # (files from before the FMA tiles were removed still list them)
    if not good:
        raise ValueError(f"no tile of {shape} ran within {max_rel_err} of the reference")
    tile = min(good, key=lambda t: 2 * t["fwd_ms"] + t["bwd_ms"])["tile"]
    return f"{tile['block_m']}x{tile['block_n']}x{tile['num_warps']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="glu_lora_tiles.json")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--best", metavar="JSON", help="print the fastest tile of a results file and exit")
    args = parser.parse_args()
    if args.best:
        with open(args.best) as f:
            print(best_tile(json.load(f)))
        return
    rows = [run_shape(name, *SHAPES[name], args.rank) for name in args.shapes.split(",")]
    with open(args.out, "w") as f:
        json.dump(
            {"environment": environment(), "default_tile": LORA_TILE._asdict(), "rows": rows}, f, indent=1
        )


if __name__ == "__main__":
    main()
