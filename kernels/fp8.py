"""Row-wise FP8 quantisation in one kernel: per row, the largest magnitude, the float32 scale and the
FP8 codes, from one read of a 16-bit (or float32) input.

Computes exactly what ``lightning_sloth.ops.fp8_formats.quantize_rows`` computes in plain torch::

    v        = float32(x[i, j]) * col_scale[j]     (col_scale optional: W's scales folded into dy)
    scale[i] = max_j |v| / FMAX                     (1 for a zero row)
    q[i, j]  = fp8_rne(clamp(v / scale[i], -FMAX, FMAX))

Divisions are IEEE round-to-nearest (``div_rn``) and the conversion rounds to nearest even, so the
codes and scales equal the plain-torch ones bit for bit. A program owns one row and walks it twice
in ``BLOCK``-wide chunks (the amax, then the codes; the second read of a row of a few KiB comes from
L2): five bytes of traffic per bf16 element, against the dozens of the unfused torch ops.

The Triton interpreter's float8 conversion does not round like the hardware (it drops carries into
the exponent), so the codes are checked on the GPU; the interpreter checks the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    FMAX: tl.constexpr,
    HAS_COL_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
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
    x: torch.Tensor, dtype: torch.dtype, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] in dtype, scales [M, 1] float32)`` of ``x [M, K]`` (unit stride along K).

    Args:
        x: float16/bfloat16/float32 ``[M, K]``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        col_scale: optional float32 ``[K]`` multiplied into each row before the amax.
    """
    if dtype not in _FP8:
        raise ValueError(f"quantize_rows writes float8_e4m3fn or float8_e5m2, not {dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_rows, n_cols = x.shape
    q = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device)
    scale = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return q, scale
    block = min(4096, triton.next_power_of_2(max(n_cols, 16)))
    launchable(_quantize_rows_kernel)[(n_rows,)](
        x,
        col_scale if col_scale is not None else scale,
        q,
        scale,
        n_rows,
        n_cols,
        x.stride(0),
        q.stride(0),
        FMAX=torch.finfo(dtype).max,
        HAS_COL_SCALE=col_scale is not None,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return q, scale
