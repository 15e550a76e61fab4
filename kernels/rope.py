"""Rotary position embedding applied to q and k in one launch, in Hugging Face's rotate-half convention.

For the rotated part ``x[..., :R]`` split in halves ``x1, x2`` and ``cos``/``sin`` likewise:
``out1 = x1 * cos1 - x2 * sin1`` and ``out2 = x2 * cos2 + x1 * sin2``, i.e. ``x * cos + rotate_half(x) * sin``.
The tail ``x[..., R:]`` (partial rotary) is copied unchanged. The backward is the transposed map,
``g1 * cos1 + g2 * sin2`` and ``g2 * cos2 - g1 * sin1`` (a rotation by ``-sin`` when the halves of
cos/sin repeat, as they do for every transformers rotary embedding).

One program per ``(batch, position)``: it loads that position's cos/sin row once and rotates every q
and k head with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable, warps_for

# Values per tensor a program holds at once: heads are processed in blocks of about this size.
_TARGET_BLOCK = 4096


@triton.jit
def _rotate_heads(
    X,
    OUT,
    x_base,
    out_base,
    n_heads,
    stride_xh,
    stride_oh,
    cos1,
    cos2,
    sin1,
    sin2,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = heads < n_heads
        mask = head_mask[:, None] & d_mask[None, :]
        x_ptr = X + x_base + heads[:, None] * stride_xh + d[None, :]
        out_ptr = OUT + out_base + heads[:, None] * stride_oh + d[None, :]
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            out1 = x1 * cos1 + x2 * sin2
            out2 = x2 * cos2 - x1 * sin1
        else:
            out1 = x1 * cos1 - x2 * sin1
            out2 = x2 * cos2 + x1 * sin2
        tl.store(out_ptr, out1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(out_ptr + HALF, out2.to(OUT.dtype.element_ty), mask=mask)
        if TAIL > 0:
            t = tl.arange(0, BLOCK_TAIL)
            tail_mask = head_mask[:, None] & (t < TAIL)[None, :]
            tail = tl.load(X + x_base + heads[:, None] * stride_xh + 2 * HALF + t[None, :], mask=tail_mask)
            tl.store(
                OUT + out_base + heads[:, None] * stride_oh + 2 * HALF + t[None, :], tail, mask=tail_mask
            )


# seq_len changes with every batch: not specialized (on divisibility by 16), so no batch brings a
# new compile.
@triton.jit(do_not_specialize=["seq_len"])
def _rope_kernel(
    Q,
    K,
    COS,
    SIN,
    Q_OUT,
    K_OUT,
    seq_len,
    n_q_heads,
    n_kv_heads,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_qob,
    stride_qoh,
    stride_qot,
    stride_kob,
    stride_koh,
    stride_kot,
    stride_cb,
    stride_ct,
    stride_sb,
    stride_st,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos_ptr = COS + b * stride_cb + t * stride_ct + d
    sin_ptr = SIN + b * stride_sb + t * stride_st + d
    cos1 = tl.load(cos_ptr, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        Q,
        Q_OUT,
        b * stride_qb + t * stride_qt,
        b * stride_qob + t * stride_qot,
        n_q_heads,
        stride_qh,
        stride_qoh,
        cos1,
        cos2,
        sin1,
        sin2,
        HALF,
        TAIL,
        BLOCK_HQ,
        BLOCK_HALF,
        BLOCK_TAIL,
        BACKWARD,
    )
    _rotate_heads(
        K,
        K_OUT,
        b * stride_kb + t * stride_kt,
        b * stride_kob + t * stride_kot,
        n_kv_heads,
        stride_kh,
        stride_koh,
        cos1,
        cos2,
        sin1,
        sin2,
        HALF,
        TAIL,
        BLOCK_HK,
        BLOCK_HALF,
        BLOCK_TAIL,
        BACKWARD,
    )


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (or, with ``backward=True``, their gradients) by cos/sin.

    Args:
        q: ``[B, Hq, T, D]`` float16/bfloat16/float32 with unit stride on the last dimension (other
            strides free, e.g. a ``transpose(1, 2)`` view).
        k: ``[B, Hkv, T, D]``, same dtype and layout rules as q.
        cos: ``[B or 1, T, R]`` with ``R <= D`` even and unit stride on the last dimension; any float dtype.
        sin: Same shape as cos.
        backward: Apply the transposed rotation (the gradient of the forward).

    Returns:
        ``q_out`` and ``k_out``, allocated with ``torch.empty_like`` of q and k (same strides when those
        are dense).
    """
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin)):
        raise ValueError("rope kernel: q, k, cos and sin need unit stride on their last dimension")
    batch, _, seq_len, _ = q.shape
    # int(): these sizes pick compile-time block sizes, so symbolic ones are specialized here.
    n_q_heads, n_kv_heads, head_dim, rotary_dim = (
        int(n) for n in (q.shape[1], k.shape[1], q.shape[3], cos.shape[-1])
    )
    cos = cos.expand(batch, seq_len, rotary_dim)
    sin = sin.expand(batch, seq_len, rotary_dim)
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    if batch * seq_len == 0:
        return q_out, k_out
    half = rotary_dim // 2
    tail = head_dim - rotary_dim
    block_half = triton.next_power_of_2(half)
    block_hq = min(triton.next_power_of_2(n_q_heads), max(1, _TARGET_BLOCK // block_half))
    block_hk = min(triton.next_power_of_2(n_kv_heads), max(1, _TARGET_BLOCK // block_half))
    launchable(_rope_kernel)[(batch * seq_len,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        seq_len,
        n_q_heads,
        n_kv_heads,
        *q.stride()[:3],
        *k.stride()[:3],
        *q_out.stride()[:3],
        *k_out.stride()[:3],
        *cos.stride()[:2],
        *sin.stride()[:2],
        HALF=half,
        TAIL=tail,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
        BACKWARD=backward,
        num_warps=warps_for(block_hq * block_half),
    )
    return q_out, k_out
