"""RMSNorm forward and backward kernels over the last dimension, fp32 accumulation.

``y = x * rstd * (w + offset)`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` per row. Two cast orders,
matching the Hugging Face modules:

- ``cast_before_weight=True`` (LlamaRMSNorm and its copies): ``x * rstd`` is rounded to x's dtype, then
  multiplied by the weight.
- ``cast_before_weight=False`` (GemmaRMSNorm, ``1 + w``): the weight product is taken in fp32 and
  rounded once.

A program owns ``BLOCK_M`` whole rows, so short rows (e.g. per-head q/k norms, 128 wide) still give each
program a few thousand values. The backward is a grid-stride loop: each program accumulates its
rows' share of ``dW`` in fp32 registers and writes one partial row; the partial rows are summed after.

``add_rms_norm`` (a decoder layer's residual add followed by its next norm) runs the same kernels:
the forward adds the residual as it loads and also stores the sum; the backward adds the sum's own
gradient to the one through the norm before it stores. One pass each way instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable, persistent_grid, rows_view, warps_for

# Values per program the row blocking aims at: whole rows of up to this width go one per program.
_TARGET_BLOCK = 4096


# n_rows changes with every batch: not specialized, so no batch brings a new compile.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_forward_kernel(
    X,
    R,
    S,
    W,
    Y,
    RSTD,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    stride_y,
    eps,
    offset,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # s = x + residual, rounded to the storage dtype as the unfused add would; the norm reads s.
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_y + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_hat = x * rstd[:, None]
    if CAST_BEFORE_WEIGHT:
        x_hat = x_hat.to(Y.dtype.element_ty).to(tl.float32)
    y = x_hat * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_backward_kernel(
    DY,
    DS,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    n_rows,
    n_cols,
    stride_dy,
    stride_ds,
    stride_x,
    stride_dx,
    offset,
    HAS_GRAD_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for block in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        dx_hat = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (dx_hat - x_hat * mean(dx_hat * x_hat)).
        proj = tl.sum(dx_hat * x_hat, axis=1) / n_cols
        dx = (dx_hat - x_hat * proj[:, None]) * rstd[:, None]
        if HAS_GRAD_SUM:
            # add_rms_norm: the sum also leaves the op, so its own gradient joins the norm's.
            dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat

    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


def _blocks(n_cols: int) -> tuple[int, int]:
    # int(): block sizes are compile-time constants, so a symbolic width is specialized here.
    block_n = triton.next_power_of_2(int(n_cols))
    return max(1, _TARGET_BLOCK // block_n), block_n


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize ``x`` over its last dimension.

    Args:
        x: ``[..., D]`` float16/bfloat16/float32, last dimension of unit stride or copied to one.
        weight: ``[D]``, any float dtype.
        eps: Added to the mean square.
        offset: Added to the weight (0 for Llama-style, 1 for Gemma's ``1 + w``).
        cast_before_weight: Round ``x * rstd`` to x's dtype before the weight product (Llama order).

    Returns:
        ``y`` (contiguous, shape and dtype of x) and ``rstd`` (``x.shape[:-1]``, float32).
    """
    x_rows = rows_view(x)
    n_rows, n_cols = x_rows.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    block_m, block_n = _blocks(n_cols)
    _launch_forward(x_rows, None, None, weight, y, rstd, eps, offset, cast_before_weight)
    return y, rstd


def add_rms_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x's dtype), then :func:`rms_norm_forward` of ``s``, in one pass.

    Args:
        x, residual: ``[..., D]`` of one shape and dtype (float16/bfloat16/float32).
        weight, eps, offset, cast_before_weight: as for :func:`rms_norm_forward`.

    Returns:
        ``y`` (the norm of ``s``), ``s`` (both contiguous, shape and dtype of x) and ``rstd``
        (``x.shape[:-1]``, float32).
    """
    x_rows, r_rows = rows_view(x), rows_view(residual)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x_rows.shape[0] == 0:
        return y, s, rstd
    _launch_forward(x_rows, r_rows, s, weight, y, rstd, eps, offset, cast_before_weight)
    return y, s, rstd


def _launch_forward(x_rows, r_rows, s, weight, y, rstd, eps, offset, cast_before_weight) -> None:
    n_rows, n_cols = x_rows.shape
    block_m, block_n = _blocks(n_cols)
    has_residual = r_rows is not None
    launchable(_rms_norm_forward_kernel)[(triton.cdiv(n_rows, block_m),)](
        x_rows,
        r_rows if has_residual else x_rows,
        s if has_residual else y,
        weight.contiguous(),
        y,
        rstd,
        n_rows,
        n_cols,
        x_rows.stride(0),
        r_rows.stride(0) if has_residual else 0,
        n_cols,
        eps,
        offset,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        HAS_RESIDUAL=has_residual,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps_for(block_m * block_n),
    )


def rms_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    grad_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rms_norm_forward` (either cast order: the rounding passes gradients through).

    Args:
        grad_y: ``[..., D]``, the gradient of ``y`` (any float dtype).
        x: ``[..., D]``, the forward input (the sum ``s`` for :func:`add_rms_norm_forward`).
        weight: ``[D]``.
        rstd: ``x.shape[:-1]`` float32, as returned by the forward.
        offset: The forward's weight offset.
        grad_sum: ``[..., D]`` or None: for :func:`add_rms_norm_forward`, the gradient reaching ``s``
            directly, added to the one through the norm.

    Returns:
        ``grad_x`` (contiguous, shape and dtype of x; for ``add_rms_norm`` the gradient of ``s``,
        hence of both summands) and ``grad_weight`` (shape and dtype of weight).
    """
    x_rows = rows_view(x)
    dy_rows = rows_view(grad_y)
    ds_rows = rows_view(grad_sum) if grad_sum is not None else None
    n_rows, n_cols = x_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    block_m, block_n = _blocks(n_cols)
    grid = persistent_grid(x.device, triton.cdiv(n_rows, block_m))
    dw_partial = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device)
    launchable(_rms_norm_backward_kernel)[(grid,)](
        dy_rows,
        dy_rows if ds_rows is None else ds_rows,
        x_rows,
        weight.contiguous(),
        rstd.contiguous(),
        dx,
        dw_partial,
        n_rows,
        n_cols,
        dy_rows.stride(0),
        0 if ds_rows is None else ds_rows.stride(0),
        x_rows.stride(0),
        n_cols,
        offset,
        HAS_GRAD_SUM=ds_rows is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps_for(block_m * block_n),
    )
    return dx, dw_partial.sum(0).to(weight.dtype)
