"""The gated RMSNorm of Gated DeltaNet layers (Qwen3.5, Qwen3-Next), forward and backward, fp32 math.

``y = (w * round(x * rstd)) * silu(z)`` per row, ``rstd = 1 / sqrt(mean(x**2) + eps)``, in the cast
order of transformers' ``Qwen3_5RMSNormGated``: ``x * rstd`` is rounded to x's dtype; the weight
product is rounded too where the weight and x share a 16-bit dtype (``ROUND_PRODUCT``: a bf16 module),
and taken in fp32 where either is fp32; the gate's SiLU is fp32; the result is rounded once to x's
dtype. Rows are short (the value head's width, 128 at the released sizes), so a program owns
``BLOCK_M`` whole rows, as in :mod:`.rms_norm`; the backward is a grid-stride loop whose programs
each write one partial row of ``dW``, summed after (the row blocking is :mod:`.rms_norm`'s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable, persistent_grid, rows_view, warps_for
from lightning_sloth.kernels.rms_norm import _blocks


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_gated_forward_kernel(
    X,
    Z,
    W,
    Y,
    RSTD,
    n_rows,
    n_cols,
    stride_x,
    stride_z,
    eps,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    h = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    p = w[None, :] * h
    if ROUND_PRODUCT:
        p = p.to(Y.dtype.element_ty).to(tl.float32)
    y = p * (z * tl.sigmoid(z))
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_gated_backward_kernel(
    DY,
    X,
    Z,
    W,
    RSTD,
    DX,
    DZ,
    DW_PARTIAL,
    n_rows,
    n_cols,
    stride_dy,
    stride_x,
    stride_z,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        h = x_hat.to(DX.dtype.element_ty).to(tl.float32)
        p = w[None, :] * h
        if ROUND_PRODUCT:
            p = p.to(DX.dtype.element_ty).to(tl.float32)
        sig = tl.sigmoid(z)
        dp = dy * (z * sig)  # through silu(z)'s factor
        dz = dy * p * sig * (1.0 + z * (1.0 - sig))  # silu'(z)
        dh = dp * w[None, :]
        proj = tl.sum(dh * x_hat, axis=1) / n_cols
        dx = (dh - x_hat * proj[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DZ + rows[:, None] * n_cols + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
        dw_acc += dp * h
    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


def rms_norm_gated_forward(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, round_product: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: y contiguous in x's shape and dtype, rstd ``x.shape[:-1]`` float32.

    Args:
        x, gate: ``[..., D]`` of one shape (float16/bfloat16/float32; gate any float dtype).
        weight: ``[D]``.
        eps: Added to the mean square.
        round_product: round ``w * round(x * rstd)`` to x's dtype (weight and x in one 16-bit dtype).
    """
    x_rows, z_rows = rows_view(x), rows_view(gate)
    n_rows, n_cols = x_rows.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    block_m, block_n = _blocks(n_cols)
    launchable(_rms_norm_gated_forward_kernel)[(triton.cdiv(n_rows, block_m),)](
        x_rows,
        z_rows,
        weight.contiguous(),
        y,
        rstd,
        n_rows,
        n_cols,
        x_rows.stride(0),
        z_rows.stride(0),
        eps,
        ROUND_PRODUCT=round_product,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps_for(block_m * block_n),
    )
    return y, rstd


def rms_norm_gated_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    round_product: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_gate, grad_weight)`` of :func:`rms_norm_gated_forward` (the roundings pass
    gradients through), each in its input's shape and dtype."""
    x_rows, z_rows, dy_rows = rows_view(x), rows_view(gate), rows_view(grad_y)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(gate.shape, dtype=gate.dtype, device=x.device)
    if n_rows == 0:
        return dx, dz, torch.zeros_like(weight)
    block_m, block_n = _blocks(n_cols)
    grid = persistent_grid(x.device, triton.cdiv(n_rows, block_m))
    dw_partial = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device)
    launchable(_rms_norm_gated_backward_kernel)[(grid,)](
        dy_rows,
        x_rows,
        z_rows,
        weight.contiguous(),
        rstd.contiguous(),
        dx,
        dz,
        dw_partial,
        n_rows,
        n_cols,
        dy_rows.stride(0),
        x_rows.stride(0),
        z_rows.stride(0),
        ROUND_PRODUCT=round_product,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps_for(block_m * block_n),
    )
    return dx, dz, dw_partial.sum(0).to(weight.dtype)
