"""The wide-head part of the varlen backend: heads wider than the flash kernel takes (``head_dim`` over
256: Gemma 4's 512-dim global layers) through the memory-efficient kernel's varlen mode.

``torch.ops.aten._efficient_attention_forward`` takes the same ``cu_seqlens`` as flash (``[1, T, H,
D]`` with one problem per document, causal from each document's first token) and any head size up
to 65,536, so a packed row costs ``Σ len²`` scores, as flash's does, instead of the ``T²`` of the
dense block-diagonal mask the ``"sdpa"`` backend would build (on the Gemma 4 31B shape's three global
layers at 16,384 tokens: about 0.86 s of a 2.6 s step). Its kernel wants as many K/V heads as query
heads: GQA repeats them (a ``[T, Hq, D]`` copy each; autograd sums the group's gradients back).

No sliding window and no sinks here (the calling layer keeps those on ``"sdpa"``); nothing reads
device memory on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sloth.attention.varlen import to_varlen_layout

_CAUSAL_FROM_TOP_LEFT = 1  # the kernel's custom_mask_type: causal within each document


def efficient_usable(query: Tensor) -> bool:
    """Whether the wide-head kernel can serve ``query`` (CUDA, fp16/bf16, head_dim a multiple of 8
    over 256: narrower heads take flash)."""
    head_dim = query.shape[-1]
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim > 256
        and hasattr(torch.ops.aten, "_efficient_attention_forward")
    )


def efficient_packed(query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scaling) -> Tensor:
    """Document-causal attention of a packed row, ``[1, H, T, D]`` in (K/V with ``Hkv`` heads dividing
    ``Hq``), ``[1, T, Hq, Dv]`` out, as :func:`~lightning_sloth.attention.varlen.varlen_packed`."""
    groups = query.shape[1] // key.shape[1]
    same_kv = value is key
    # [1, H, T, D] -> [1, T, H * repeats, D]: flash's layout with the batch dimension the kernel wants.
    q, k = to_varlen_layout(query, 1)[None], to_varlen_layout(key, groups)[None]
    v = k if same_kv else to_varlen_layout(value, groups)[None]
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(torch.int32)
    # Dynamo refuses an autograd.Function given one tensor twice: None stands for "the same as before".
    return _EfficientVarlen.apply(
        q, k, None if v is k else v, cu_q, None if cu_k is cu_q else cu_k, max_q, max_k, scaling
    )


class _EfficientVarlen(torch.autograd.Function):
    """The memory-efficient kernel's varlen forward and backward on ``[1, T, H, D]``; ``v=None``
    means ``v is k`` (Gemma 4's ``attention_k_eq_v`` layers), ``cu_k=None`` means ``cu_k is cu_q``."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        v_arg = k if v is None else v
        cu_k_arg = cu_q if cu_k is None else cu_k
        needs_lse = any(ctx.needs_input_grad[:3])
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q, k, v_arg, None, cu_q, cu_k_arg, max_q, max_k, 0.0, _CAUSAL_FROM_TOP_LEFT, needs_lse,
            scale=scale,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v_arg, out, lse, seed, offset, cu_q, cu_k_arg)
        ctx.args = (max_q, max_k, scale)
        ctx.shared_v = v is None
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale = ctx.args
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            grad.contiguous(), q, k, v, None, out, cu_q, cu_k, max_q, max_k, lse, 0.0, seed, offset,
            _CAUSAL_FROM_TOP_LEFT, False, scale=scale,
        )  # fmt: skip
        if ctx.shared_v:
            return dq, dk + dv, None, None, None, None, None, None
        return dq, dk, dv, None, None, None, None, None
