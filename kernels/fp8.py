"""Row-wise FP8 quantisation in one kernel: per row, the largest magnitude, the float32 scale and the
FP8 codes, from one read of a 16-bit (or float32) input.

Computes exactly what ``lightning_sloth.ops.fp8_formats.quantize_rows`` computes in plain torch::

    v        = float32(x[i, j]) * col_scale[j]     (col_scale optional: W's scales folded into dy;
                                                   row_groups[i] picks row i's [K] row of a 2-D one)
    scale[i] = max_j |v| / FMAX                     (1 for a zero row)
    q[i, j]  = fp8_rne(clamp(v / scale[i], -FMAX, FMAX))

Divisions are IEEE round-to-nearest (``div_rn``) and the conversion rounds to nearest even, so the
codes and scales equal the plain-torch ones bit for bit. A program owns one row: a row of up to 4,096
columns is read once and kept in registers; a longer one is walked twice in ``BLOCK``-wide chunks
(the amax, then the codes; the second read of a row of a few KiB comes from L2): three bytes of
traffic per bf16 element, against the dozens of the unfused torch ops.

The Triton interpreter's float8 conversion does not round like the hardware (it drops carries into
the exponent), so the codes are checked on the GPU; the interpreter checks the scales.

``transpose_bytes``: the transposed copy of an FP8 weight's codes that the input gradient's
``_scaled_mm`` needs (its second operand column-major), in tiles read and written along their rows.
torch's strided copy of one-byte elements moved the 8B shape's codes at about 0.3 TB/s (221 copies,
47.4 ms of a 1,222 ms step on the H100).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _one_pass_from_environment() -> int:
    text = os.environ.get("LIGHTNING_SLOTH_FP8_ONE_PASS_COLS", "4096").strip()
    if not text.isdigit() or int(text) < 16:
        raise ValueError(
            f"LIGHTNING_SLOTH_FP8_ONE_PASS_COLS must be a whole number of columns >= 16, got {text!r}"
        )
    return int(text)


ONE_PASS_MAX_COLS = _one_pass_from_environment()
"""The widest row read once and kept in registers (``LIGHTNING_SLOTH_FP8_ONE_PASS_COLS`` from the
environment, else 4,096); wider rows are walked twice in 4,096-wide chunks.
Reading rows of up to 16,384 once (up to 32 warps) left the 5,760-wide GPT-OSS-20B expert gradient's
quantisation where it was on the H200 (0.640 against 0.653 ms, ``moe_fp8_gemm_16k_h200.json``), so
the bound stays where it was measured to gain."""


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_kernel(
    X,
    COL_SCALE,
    Q,
    SCALE,
    n_rows,
    n_cols,
    stride_x,
    stride_q,
    ROW_GROUPS,
    FMAX: tl.constexpr,
    HAS_COL_SCALE: tl.constexpr,
    HAS_ROW_GROUPS: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    if HAS_ROW_GROUPS:
        COL_SCALE += tl.load(ROW_GROUPS + row).to(tl.int64) * n_cols
    if ONE_PASS:  # the row fits one block: read it once, keep it in registers
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(COL_SCALE + cols, mask=mask, other=0.0)
        row_max = tl.max(tl.abs(v), axis=0)
        scale = tl.where(row_max > 0, tl.math.div_rn(row_max, FMAX), 1.0)
        tl.store(SCALE + row, scale)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FMAX), FMAX)
        code = v.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(Q + row * stride_q + cols, code, mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(COL_SCALE + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
    row_max = tl.max(amax, axis=0)
    scale = tl.where(row_max > 0, tl.math.div_rn(row_max, FMAX), 1.0)
    tl.store(SCALE + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(COL_SCALE + cols, mask=mask, other=0.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FMAX), FMAX)
        code = v.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(Q + row * stride_q + cols, code, mask=mask)


def quantize_rows(
    x: torch.Tensor,
    dtype: torch.dtype,
    col_scale: torch.Tensor | None = None,
    row_groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] in dtype, scales [M, 1] float32)`` of ``x [M, K]`` (unit stride along K).

    Args:
        x: float16/bfloat16/float32 ``[M, K]``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        col_scale: optional float32 ``[K]`` multiplied into each row before the amax, or ``[G, K]``
            (contiguous) with ``row_groups``: row i is multiplied by ``col_scale[row_groups[i]]``.
        row_groups: int64 ``[M]`` group of each row (an expert's scales for its rows), with a 2-D
            ``col_scale`` only.
    """
    if dtype not in _FP8:
        raise ValueError(f"quantize_rows writes float8_e4m3fn or float8_e5m2, not {dtype}")
    if (row_groups is not None) != (col_scale is not None and col_scale.dim() == 2):
        raise ValueError("quantize_rows: row_groups goes with a 2-D [G, K] col_scale, and only with one")
    if col_scale is not None:
        col_scale = col_scale.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_rows, n_cols = x.shape
    q = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device)
    scale = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return q, scale
    block = triton.next_power_of_2(max(n_cols, 16))
    if block > ONE_PASS_MAX_COLS:
        block = 4096  # walked twice in chunks
    launchable(_quantize_rows_kernel)[(n_rows,)](
        x,
        col_scale if col_scale is not None else scale,
        q,
        scale,
        n_rows,
        n_cols,
        x.stride(0),
        q.stride(0),
        row_groups if row_groups is not None else scale,
        FMAX=torch.finfo(dtype).max,
        HAS_COL_SCALE=col_scale is not None,
        HAS_ROW_GROUPS=row_groups is not None,
        ONE_PASS=n_cols <= block,
        BLOCK=block,
        num_warps=min(32, max(8, block // 512)) if block >= 2048 else 4,
    )
    return q, scale


@triton.jit
def _transpose_bytes_kernel(X, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tile = tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask)
    tl.store(Y + cols[:, None] * n_rows + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor of one-byte elements (FP8 codes, ``uint8``), in
    ``128 x 128`` tiles; the result has ``x``'s dtype."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(
            f"transpose_bytes takes a 2-D tensor of one-byte elements, got {tuple(x.shape)} {x.dtype}"
        )
    bits = x.contiguous().view(torch.uint8)
    n_rows, n_cols = bits.shape
    out = torch.empty(n_cols, n_rows, dtype=torch.uint8, device=x.device)
    if bits.numel():
        grid = (triton.cdiv(n_rows, 128), triton.cdiv(n_cols, 128))
        launchable(_transpose_bytes_kernel)[grid](
            bits, out, n_rows, n_cols, BLOCK_R=128, BLOCK_C=128, num_warps=8
        )
    return out.view(x.dtype)
