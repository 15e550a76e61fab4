"""The LoRA up factor's two rank-r gradient products from one read of its output's gradient.

A LoRA up factor ``B_e`` (``[E, N, r]``) needs two products of its output's gradient ``grad``
(``[S, N]``, rows in expert order): ``g = grad @ B_e`` (the LoRA side of the input gradient) and its
own gradient ``dB_e = grad[rows of e]^T @ side[rows of e]``. Two grouped GEMMs read all of ``grad``
twice for r columns each; :func:`lora_grad_pair` reads it once. The fused MoE path
(:mod:`lightning_sloth.moe.indexed`) runs it where the first expert GEMM's rank-r side is made
outside the GEMM (wide outputs, GPT-OSS-20B's): on the H200 0.31 ms against 0.61
(``benchmarks/results/lora_grad_pair_h200.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable
from lightning_sloth.kernels.moe import _dot

__all__ = ["LORA_GRAD_PAIR_MAX_RANK", "lora_grad_pair"]


@triton.jit
def _lora_grad_pair_kernel(
    G, UP, SIDE, DUP, PART, ENDS, n_cols, rank, stride_gm, stride_ue, stride_un, stride_ur, stride_sm,
    stride_de, stride_dn, stride_dr, stride_pc, stride_pm,
    BN: tl.constexpr, BR: tl.constexpr, RP: tl.constexpr,
):  # fmt: skip
    # One program per (column block, expert): it walks the expert's rows once, accumulating
    # dUP[e, cols] = G[rows, cols]^T SIDE[rows] whole and writing G[rows, cols] UP[e, cols] as this
    # column block's part of the rank-r product (summed over the blocks afterwards, in order).
    chunk = tl.program_id(0)
    expert = tl.program_id(1).to(tl.int64)
    start = tl.load(ENDS + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(ENDS + expert).to(tl.int64)
    cols = chunk * BN + tl.arange(0, BN)
    col_mask = cols < n_cols
    rs = tl.arange(0, RP)
    r_mask = rs < rank
    up = tl.load(
        UP + expert * stride_ue + cols[:, None] * stride_un + rs[None, :] * stride_ur,
        mask=col_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    acc = tl.zeros((BN, RP), dtype=tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        row_mask = rows < end
        g = tl.load(
            G + rows[:, None] * stride_gm + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        side = tl.load(
            SIDE + rows[:, None] * stride_sm + rs[None, :],
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        acc = _dot(tl.trans(g), side, acc)
        part = _dot(g, up, tl.zeros((BR, RP), dtype=tl.float32))
        tl.store(
            PART + chunk * stride_pc + rows[:, None] * stride_pm + rs[None, :],
            part,
            mask=row_mask[:, None] & r_mask[None, :],
        )
    tl.store(
        DUP + expert * stride_de + cols[:, None] * stride_dn + rs[None, :] * stride_dr,
        acc.to(DUP.dtype.element_ty),
        mask=col_mask[:, None] & r_mask[None, :],
    )


LORA_GRAD_PAIR_MAX_RANK = 64
"""Largest rank :func:`lora_grad_pair` takes (its ``[BN, r]`` accumulator and up tile sit in registers)."""


def lora_grad_pair(
    grad: torch.Tensor, up: torch.Tensor, side: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad @ up_e [S, r], dUP [E, N, r])`` from one read of the ``[S, N]`` incoming gradient.

    The two rank-r products a LoRA up factor's backward needs from its output's gradient (rows in
    expert order): the input side ``g[s] = grad[s] @ up_e`` (``up`` ``[E, N, r]``) and the factor's
    gradient ``dUP[e] = grad[rows of e]^T @ side[rows of e]`` (``side`` ``[S, r]``, zero for an
    expert without rows), where two separate GEMMs read all of ``grad`` twice. Each program holds one
    column block of one expert; g is summed over the column blocks in float32 in a fixed order (no
    atomics) and rounded once. Both in grad's dtype. Every row is routed (``ends[-1] == S``), as in
    the fused ops. (The second fused op's backward, whose gradient is read through the permutation,
    keeps its two passes: a version of this kernel reading rows that way took the same time,
    ``benchmarks/results/lora_grad_pair_both_h200.json``, commit 20728a4.)
    """
    rows, n_cols = grad.shape
    experts, rank = ends.shape[0], up.shape[2]
    if (
        not 0 < rank <= LORA_GRAD_PAIR_MAX_RANK
        or side.shape != (rows, rank)
        or up.shape[:2] != (experts, n_cols)
    ):
        raise ValueError(
            f"lora_grad_pair: grad {tuple(grad.shape)}, up {tuple(up.shape)} [E, N, r], side {tuple(side.shape)} "
            f"[S, r] with 0 < r <= {LORA_GRAD_PAIR_MAX_RANK}"
        )
    big = grad.device.type == "cuda" and grad.dtype in (torch.bfloat16, torch.float16)
    block_n, block_r, warps, stages = (256, 64, 8, 3) if big else (32, 16, 4, 2)
    block_n = max(16, min(block_n, triton.next_power_of_2(n_cols)))
    chunks = triton.cdiv(n_cols, block_n)
    parts = torch.empty((chunks, rows, rank), dtype=torch.float32, device=grad.device)
    d_up = grad.new_empty((experts, n_cols, rank))
    if grad.stride(1) != 1:
        grad = grad.contiguous()
    if side.stride(1) != 1:
        side = side.contiguous()
    launchable(_lora_grad_pair_kernel)[(chunks, experts)](
        grad, up, side, d_up, parts, ends, n_cols, rank, grad.stride(0), up.stride(0), up.stride(1), up.stride(2),
        side.stride(0), d_up.stride(0), d_up.stride(1), d_up.stride(2), parts.stride(0), parts.stride(1),
        BN=block_n, BR=block_r, RP=max(16, triton.next_power_of_2(rank)), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return parts.sum(0).to(grad.dtype), d_up
