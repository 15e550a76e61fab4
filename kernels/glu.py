"""Gated linear unit kernels: ``act(gate) * up`` for SiLU (SwiGLU) and tanh-approximated GELU (GeGLU).

Everything is computed in fp32 and rounded once. The backward recomputes the activation from gate
and up instead of saving it. The tanh-GELU uses ``0.5 * (1 + tanh(z)) = sigmoid(2z)``:
``gelu_tanh(g) = g * sigmoid(2z)`` with ``z = sqrt(2/pi) * (g + 0.044715 g^3)``, which needs no tanh
and stays accurate in both tails.

Inputs are viewed as ``[rows, I]`` with any row stride, so gate/up may be the two halves of a fused
gate-up projection output.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable, rows_alias, rows_view

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_SILU = tl.constexpr(ACTIVATIONS["silu"])
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_BLOCK = 1024


@triton.jit
def _activation_and_derivative(g, ACTIVATION: tl.constexpr):
    if ACTIVATION == _SILU:
        s = tl.sigmoid(g)
        d_act = s * (1.0 + g * (1.0 - s))
    else:
        # Tensor operands first: the interpreter mishandles constexpr * tensor.
        g2 = g * g
        s = tl.sigmoid(g * (g2 * _GELU_CUBIC + 1.0) * (2.0 * _SQRT_2_OVER_PI))
        d_act = s + g * s * (1.0 - s) * ((g2 * (3.0 * _GELU_CUBIC) + 1.0) * (2.0 * _SQRT_2_OVER_PI))
    return g * s, d_act


@triton.jit
def _glu_forward_kernel(
    GATE,
    UP,
    OUT,
    n_cols,
    stride_gate,
    stride_up,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_derivative(g, ACTIVATION)
    tl.store(OUT + row * n_cols + cols, (act * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    GRAD_OUT,
    GATE,
    UP,
    GRAD_GATE,
    GRAD_UP,
    n_cols,
    stride_grad,
    stride_gate,
    stride_up,
    stride_grad_gate,
    stride_grad_up,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Each value is read before it is written and by the same program, so GRAD_GATE/GRAD_UP may be
    # GATE/UP themselves (the in-place backward).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(GRAD_OUT + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _activation_and_derivative(g, ACTIVATION)
    grad_gate = (dy * u * dact).to(GRAD_GATE.dtype.element_ty)
    grad_up = (dy * act).to(GRAD_UP.dtype.element_ty)
    tl.store(GRAD_GATE + row * stride_grad_gate + cols, grad_gate, mask=mask)
    tl.store(GRAD_UP + row * stride_grad_up + cols, grad_up, mask=mask)


def _grid(rows: torch.Tensor) -> tuple[int, int]:
    return rows.shape[0], triton.cdiv(rows.shape[1], _BLOCK)


def _grad_buffers(gate, up, gate_rows, up_rows, in_place: bool) -> tuple:
    """``(grad_gate, grad_up)`` and their row views: gate and up themselves where written in place
    (both viewable as rows without a copy), else new tensors."""
    if in_place and rows_alias(gate) is not None and rows_alias(up) is not None and gate.numel() > 0:
        return gate, up, gate_rows, up_rows
    grad_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    return grad_gate, grad_up, rows_view(grad_gate), rows_view(grad_up)


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up``.

    Args:
        gate: ``[..., I]`` float16/bfloat16/float32; rows may be strided, the last dimension is copied
            to unit stride if it is not.
        up: Same shape and dtype as gate.
        activation: ``"silu"`` or ``"gelu_tanh"``.

    Returns:
        Contiguous ``[..., I]`` in gate's dtype.
    """
    gate_rows, up_rows = rows_view(gate), rows_view(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate_rows.numel() == 0:
        return out
    launchable(_glu_forward_kernel)[_grid(gate_rows)](
        gate_rows,
        up_rows,
        out,
        gate_rows.shape[1],
        gate_rows.stride(0),
        up_rows.stride(0),
        ACTIVATION=ACTIVATIONS[activation],
        BLOCK=_BLOCK,
    )
    return out


def glu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`glu_forward`, recomputing the activation.

    Args:
        grad_out: ``[..., I]``, the gradient of the output (any float dtype, any row stride).
        gate: The forward's gate.
        up: The forward's up.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        in_place: Write ``grad_gate`` into gate's memory and ``grad_up`` into up's (no new buffers)
            where both can be viewed as rows without a copy; otherwise new tensors are returned.

    Returns:
        ``grad_gate`` and ``grad_up`` in the dtypes of gate and up: gate and up themselves, now
        holding the gradients, when written in place; otherwise new contiguous tensors.
    """
    grad_rows, gate_rows, up_rows = rows_view(grad_out), rows_view(gate), rows_view(up)
    grad_gate, grad_up, grad_gate_rows, grad_up_rows = _grad_buffers(gate, up, gate_rows, up_rows, in_place)
    if gate_rows.numel() == 0:
        return grad_gate, grad_up
    launchable(_glu_backward_kernel)[_grid(gate_rows)](
        grad_rows,
        gate_rows,
        up_rows,
        grad_gate_rows,
        grad_up_rows,
        gate_rows.shape[1],
        grad_rows.stride(0),
        gate_rows.stride(0),
        up_rows.stride(0),
        grad_gate_rows.stride(0),
        grad_up_rows.stride(0),
        ACTIVATION=ACTIVATIONS[activation],
        BLOCK=_BLOCK,
    )
    return grad_gate, grad_up


# ----------------------------------------------------------------- the activation with gate and up's LoRA
# ``act(gate + s_g (xa_g B_g^T)) * (up + s_u (xa_u B_u^T))``: gate and up are the base products only,
# the adapters' low-rank parts are added tile by tile inside the kernel (one small dot each) instead
# of being added into the two [rows, I] outputs by their own read-modify-write passes.


@triton.jit
def _lora_tile(
    XA, B, rows, cols, n_rows, n_cols, rank, stride_xa, stride_b, RANK_BLOCK: tl.constexpr, IEEE: tl.constexpr
):
    ks = tl.arange(0, RANK_BLOCK)
    xa = tl.load(
        XA + rows[:, None] * stride_xa + ks[None, :],
        mask=(rows[:, None] < n_rows) & (ks[None, :] < rank),
        other=0.0,
    )
    b = tl.load(
        B + cols[:, None] * stride_b + ks[None, :],
        mask=(cols[:, None] < n_cols) & (ks[None, :] < rank),
        other=0.0,
    )
    if IEEE:
        return tl.dot(xa, tl.trans(b), input_precision="ieee")
    return tl.dot(xa, tl.trans(b))


@triton.jit
def _glu_lora_values(
    GATE, UP, XA, B_GATE, B_UP, rows, cols, n_rows, n_cols, rank_gate, rank_up,
    stride_gate, stride_up, stride_xa, stride_b_gate, stride_b_up, scale_gate, scale_up,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK_GATE: tl.constexpr, RANK_UP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lora_g = _lora_tile(
        XA, B_GATE, rows, cols, n_rows, n_cols, rank_gate, stride_xa, stride_b_gate, RANK_GATE, IEEE
    )
    lora_u = _lora_tile(
        XA + rank_gate, B_UP, rows, cols, n_rows, n_cols, rank_up, stride_xa, stride_b_up, RANK_UP, IEEE
    )
    return g + lora_g * scale_gate, u + lora_u * scale_up, mask


@triton.jit
def _glu_lora_forward_kernel(
    GATE, UP, OUT, XA, B_GATE, B_UP, n_rows, n_cols, rank_gate, rank_up,
    stride_gate, stride_up, stride_xa, stride_b_gate, stride_b_up, scale_gate, scale_up,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK_GATE: tl.constexpr, RANK_UP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g, u, mask = _glu_lora_values(
        GATE, UP, XA, B_GATE, B_UP, rows, cols, n_rows, n_cols, rank_gate, rank_up,
        stride_gate, stride_up, stride_xa, stride_b_gate, stride_b_up, scale_gate, scale_up,
        BLOCK_M, BLOCK_N, RANK_GATE, RANK_UP, IEEE,
    )  # fmt: skip
    act, _ = _activation_and_derivative(g, ACTIVATION)
    tl.store(OUT + rows[:, None] * n_cols + cols[None, :], (act * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_lora_backward_kernel(
    GRAD_OUT, GATE, UP, GRAD_GATE, GRAD_UP, XA, B_GATE, B_UP, n_rows, n_cols, rank_gate, rank_up,
    stride_grad, stride_gate, stride_up, stride_grad_gate, stride_grad_up, stride_xa, stride_b_gate,
    stride_b_up, scale_gate, scale_up,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK_GATE: tl.constexpr, RANK_UP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Each tile is read before it is written and by the same program: GRAD_GATE/GRAD_UP may be
    # GATE/UP themselves (the in-place backward).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g, u, mask = _glu_lora_values(
        GATE, UP, XA, B_GATE, B_UP, rows, cols, n_rows, n_cols, rank_gate, rank_up,
        stride_gate, stride_up, stride_xa, stride_b_gate, stride_b_up, scale_gate, scale_up,
        BLOCK_M, BLOCK_N, RANK_GATE, RANK_UP, IEEE,
    )  # fmt: skip
    dy = tl.load(GRAD_OUT + rows[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, dact = _activation_and_derivative(g, ACTIVATION)
    tl.store(
        GRAD_GATE + rows[:, None] * stride_grad_gate + cols[None, :],
        (dy * u * dact).to(GRAD_GATE.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        GRAD_UP + rows[:, None] * stride_grad_up + cols[None, :],
        (dy * act).to(GRAD_UP.dtype.element_ty),
        mask=mask,
    )


class LoraTile(NamedTuple):
    """How the two LoRA kernels tile ``[rows, I]``: ``block_m x block_n`` values per program and
    ``num_warps`` warps; the rank-r parts are a tensor-core dot (``block_m`` at least 16)."""

    block_m: int = 16
    block_n: int = 256
    num_warps: int = 8


def tile_from_text(text: str) -> LoraTile:
    """``"BMxBNxWARPS"`` (e.g. ``"16x256x8"``) as a tile."""
    numbers = text.strip().lower().split("x")
    if len(numbers) != 3 or not all(p.isdigit() and int(p) > 0 for p in numbers):
        raise ValueError(f"a LoRA activation tile is BMxBNxWARPS (e.g. 16x256x8), got {text!r}")
    block_m, block_n, warps = map(int, numbers)
    if any(v & (v - 1) for v in (block_m, block_n, warps)):
        raise ValueError(f"a LoRA activation tile takes powers of two, got {text!r}")
    if block_m < 16:
        raise ValueError(f"a LoRA activation tile needs at least 16 rows (tl.dot's smallest), got {text!r}")
    return LoraTile(block_m, block_n, warps)


LORA_TILE = tile_from_text(os.environ.get("LIGHTNING_SLOTH_GLU_LORA_TILE", "16x256x8"))
"""The tile the kernels use unless a caller (``benchmarks/glu_lora_tiles_bench.py``) passes one:
``LIGHTNING_SLOTH_GLU_LORA_TILE`` from the environment (:func:`tile_from_text`), else 16 x 256 values
per program, 8 warps, the rank-r parts as a tensor-core dot: the fastest of the benchmark's tiles on
the H100 at the 8B width (forward 0.58 against 64 x 64's 0.68 ms, backward 0.98 against 1.09;
``benchmarks/results/glu_lora_tiles_h100.json``)."""


def _lora_launch(n_rows: int, n_cols: int, xa, b_gate, b_up, activation: str, tile: LoraTile) -> tuple:
    """``(grid, constants)`` of the two LoRA kernels."""
    if tile.block_m < 16:
        raise ValueError(f"a LoRA activation tile needs block_m >= 16 (tl.dot's smallest), got {tile}")
    grid = (triton.cdiv(n_rows, tile.block_m), triton.cdiv(n_cols, tile.block_n))
    rank_gate, rank_up = b_gate.shape[1], b_up.shape[1]
    constants = dict(
        ACTIVATION=ACTIVATIONS[activation],
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        # tl.dot's smallest inner dimension is 16
        RANK_GATE=max(16, triton.next_power_of_2(rank_gate)),
        RANK_UP=max(16, triton.next_power_of_2(rank_up)),
        IEEE=xa.dtype == torch.float32,
        num_warps=tile.num_warps,
    )
    return grid, constants


def glu_lora_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    xa: torch.Tensor,
    b_gate: torch.Tensor,
    b_up: torch.Tensor,
    scale_gate: float,
    scale_up: float,
    activation: str,
    tile: LoraTile | None = None,
) -> torch.Tensor:
    """``act(gate + s_g xa_g B_g^T) * (up + s_u xa_u B_u^T)``, computed in fp32 and rounded once.

    Args:
        gate, up: ``[..., I]`` base products (rows may be strided, unit column stride).
        xa: ``[rows, r_g + r_u]``: ``x A_g^T`` then ``x A_u^T`` (unit column stride).
        b_gate, b_up: ``[I, r_g]`` and ``[I, r_u]``, in xa's dtype.
        scale_gate, scale_up: the adapters' scales.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        tile: how the kernel tiles the rows (:data:`LORA_TILE` if None).

    Returns:
        Contiguous ``[..., I]`` in gate's dtype.
    """
    gate_rows, up_rows = rows_view(gate), rows_view(up)
    b_gate, b_up = rows_view(b_gate), rows_view(b_up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n_rows, n_cols = gate_rows.shape
    if gate_rows.numel() == 0:
        return out
    ranks = b_gate.shape[1], b_up.shape[1]
    grid, constants = _lora_launch(n_rows, n_cols, xa, b_gate, b_up, activation, tile or LORA_TILE)
    launchable(_glu_lora_forward_kernel)[grid](
        gate_rows, up_rows, out, xa, b_gate, b_up, n_rows, n_cols, *ranks,
        gate_rows.stride(0), up_rows.stride(0), xa.stride(0), b_gate.stride(0), b_up.stride(0),
        float(scale_gate), float(scale_up),
        **constants,
    )  # fmt: skip
    return out


def glu_lora_backward(
    grad_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    xa: torch.Tensor,
    b_gate: torch.Tensor,
    b_up: torch.Tensor,
    scale_gate: float,
    scale_up: float,
    activation: str,
    in_place: bool = False,
    tile: LoraTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`glu_lora_forward` with respect to the full gate and up (which are also the
    base products' gradients), recomputing the adapters' parts and the activation.

    ``in_place``: written into gate's and up's memory where both can be viewed as rows without a
    copy (then gate and up are returned, holding the gradients); otherwise new contiguous tensors.
    ``tile``: as :func:`glu_lora_forward`'s.
    """
    grad_rows, gate_rows, up_rows = rows_view(grad_out), rows_view(gate), rows_view(up)
    b_gate, b_up = rows_view(b_gate), rows_view(b_up)
    grad_gate, grad_up, grad_gate_rows, grad_up_rows = _grad_buffers(gate, up, gate_rows, up_rows, in_place)
    n_rows, n_cols = gate_rows.shape
    if gate_rows.numel() == 0:
        return grad_gate, grad_up
    ranks = b_gate.shape[1], b_up.shape[1]
    grid, constants = _lora_launch(n_rows, n_cols, xa, b_gate, b_up, activation, tile or LORA_TILE)
    launchable(_glu_lora_backward_kernel)[grid](
        grad_rows, gate_rows, up_rows, grad_gate_rows, grad_up_rows, xa, b_gate, b_up,
        n_rows, n_cols, *ranks,
        grad_rows.stride(0), gate_rows.stride(0), up_rows.stride(0), grad_gate_rows.stride(0),
        grad_up_rows.stride(0), xa.stride(0), b_gate.stride(0), b_up.stride(0),
        float(scale_gate), float(scale_up),
        **constants,
    )  # fmt: skip
    return grad_gate, grad_up
