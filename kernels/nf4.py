"""Blockwise 4-bit dequantisation (NF4 / FP4, the bitsandbytes storage layout) to a float dtype.

Storage: element ``i`` of the row-major weight is the 4-bit code ``q_i``, two per byte, the even
element in the high nibble; ``absmax[i // blocksize]`` (float32) scales its block::

    w_i = round_to_dtype(code[q_i] * absmax[i // blocksize])      (one fp32 product, one rounding)

which is exactly what bitsandbytes computes, so both give the same bits. Each program reads
``BLOCK`` bytes and writes ``2 * BLOCK`` values; a block of ``blocksize`` elements (even) never
splits a byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable

_BLOCK = 1024  # bytes per program


@triton.jit
def _dequantize_4bit_kernel(
    PACKED,
    ABSMAX,
    CODE,
    OUT,
    n_elements,
    HALF_BLOCKSIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    byte = start + tl.arange(0, BLOCK)
    in_bounds = byte * 2 < n_elements
    packed = tl.load(PACKED + byte, mask=in_bounds, other=0).to(tl.int32)
    scale = tl.load(ABSMAX + byte // HALF_BLOCKSIZE, mask=in_bounds, other=0.0)
    high = tl.load(CODE + (packed >> 4)) * scale
    low = tl.load(CODE + (packed & 15)) * scale
    values = tl.interleave(high, low).to(OUT.dtype.element_ty)
    index = start * 2 + tl.arange(0, 2 * BLOCK)
    tl.store(OUT + index, values, mask=index < n_elements)


def dequantize_4bit(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, out: torch.Tensor
) -> torch.Tensor:
    """Write the dequantised weight into ``out`` and return it.

    Args:
        packed: ``uint8`` codes, two per byte (any shape, contiguous), ``ceil(out.numel() / 2)`` bytes.
        absmax: float32 ``[ceil(out.numel() / blocksize)]`` block scales.
        code: float32 ``[16]`` code book (NF4 or FP4 values).
        blocksize: elements per absmax block (even).
        out: contiguous float16/bfloat16/float32 output of the weight's shape.
    """
    n = out.numel()
    grid = (triton.cdiv(triton.cdiv(n, 2), _BLOCK),)
    launchable(_dequantize_4bit_kernel)[grid](
        packed, absmax, code, out, n, HALF_BLOCKSIZE=blocksize // 2, BLOCK=_BLOCK, num_warps=4
    )
    return out
