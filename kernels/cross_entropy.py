"""Cross-entropy over a chunk of logits rows, with the logits' gradient written over the logits.

One program per row makes two passes over the vocabulary in fp32:

1. an online logsumexp (running max and rescaled sum) and the target's logit, giving the row's loss
   ``logsumexp(z) - z[target]`` (0 on ignored rows);
2. only when gradients are wanted, ``softmax(z) - onehot(target)`` (the gradient of the row's loss)
   stored in place of the logits, in their dtype; 0 on ignored rows.

With a soft cap (Gemma 2), ``z = softcap * tanh(logits / softcap)`` and the chain rule multiplies the
gradient by ``1 - tanh**2``. The gradient is left unnormalised: dividing by the number of targets
here would push float16 gradients (``p / 16384`` for a 16k-token mean) below float16's range before
any loss scaling could act; the caller applies the normalisation in float32 afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable

# Vocabulary columns per loop step: large enough to keep loads wide, small enough for registers.
_MAX_BLOCK = 8192


@triton.jit
def _tanh(u):
    # Triton has no portable tanh (libdevice is absent from the interpreter). Near zero the exp form
    # cancels, so a short odd series takes over there (its first dropped term is < 3e-11 at |u| = 0.1).
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    t_exp = (1.0 - e) / (1.0 + e)
    a2 = a * a
    t_series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.1, t_series, t_exp)
    return tl.where(u < 0, -t, t)


@triton.jit
def _cross_entropy_rows_kernel(
    LOGITS,
    TARGETS,
    LOSS,
    n_cols,
    stride_row,
    ignore_index,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    # Inductor passes Python float arguments as fp64; keep the loop-carried values in fp32.
    cap = tl.cast(softcap, tl.float32)

    running_max = float("-inf")
    running_sum = 0.0
    target_logit = 0.0
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(row_logits + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = cap * _tanh(z / cap)
        z = tl.where(mask, z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
        target_logit += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))

    if COMPUTE_GRAD:
        for start in tl.range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(row_logits + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(z / cap)
                z = cap * t
            grad = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
            if HAS_SOFTCAP:
                grad = grad * (1.0 - t * t)
            grad = tl.where(valid, grad, 0.0)
            tl.store(row_logits + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def cross_entropy_rows_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    compute_grad: bool,
) -> torch.Tensor:
    """Per-row cross-entropy of ``logits``; optionally overwrite ``logits`` with the loss gradient.

    Args:
        logits: ``[rows, V]`` float16/bfloat16/float32, unit column stride. Overwritten with
            ``d(sum of row losses) / d logits`` (in its own dtype) when ``compute_grad``.
        targets: ``[rows]`` int64 class indices; ``ignore_index`` marks rows without a target.
            Indices outside ``[0, V)`` are not checked and give a meaningless loss.
        ignore_index: Target value of ignored rows (loss 0, gradient 0).
        softcap: If given (> 0), logits are capped as ``softcap * tanh(logits / softcap)``.
        compute_grad: Whether to write the gradient over ``logits``.

    Returns:
        ``[rows]`` float32 loss per row (0 on ignored rows).
    """
    n_rows, n_cols = logits.shape
    if n_cols > 1 and logits.stride(1) != 1:
        raise ValueError("cross_entropy_rows_ needs logits with unit column stride (it writes in place)")
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss
    block = min(_MAX_BLOCK, triton.next_power_of_2(n_cols))
    launchable(_cross_entropy_rows_kernel)[(n_rows,)](
        logits,
        targets.contiguous(),
        loss,
        n_cols,
        logits.stride(0),
        ignore_index,
        float(softcap) if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None,
        COMPUTE_GRAD=compute_grad,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )
    return loss
