"""The flash varlen backend of the packed attention: ``varlen_attn`` over ``cu_seqlens``, GQA without
copying K/V heads, and attention sinks folded into the flash backward (see :mod:`lightning_sloth.attention`)."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without varlen_attn: the "varlen" backend is unavailable
    varlen_attn = None

# torch 2.13 added ``enable_gqa`` to varlen_attn; torch 2.11 needs K/V heads repeated.
_VARLEN_HAS_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters

_kv_repeat = False  # GQA without the K/V copy (set_varlen_kv_repeat(True) restores the copy)


def varlen_usable(query: Tensor) -> bool:
    """Whether the varlen backend can serve ``query`` (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256)."""
    head_dim = query.shape[-1]
    return (
        varlen_attn is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def set_varlen_kv_repeat(repeat: bool) -> None:
    """Process-wide: repeat K/V heads for GQA in the ``"varlen"`` backend (``True`` copies them to
    one per query head first, as torch 2.11's ``varlen_attn`` alone needs; ``False``, the default,
    lets the flash kernel read the shared heads in place). Both give the same attention (GPU
    parity tests); the copy stays as the ablation's switched-off path."""
    global _kv_repeat
    if not isinstance(repeat, bool):
        raise TypeError(f"set_varlen_kv_repeat takes a bool, got {repeat!r}")
    _kv_repeat = repeat


def get_varlen_kv_repeat() -> bool:
    """Whether the ``"varlen"`` backend repeats K/V heads (:func:`set_varlen_kv_repeat`)."""
    return _kv_repeat


def to_varlen_layout(x: Tensor, repeats: int) -> Tensor:
    """``[1, H, T, D]`` -> ``[T, H * repeats, D]`` (kv head ``h`` serves query heads ``h*repeats ..``).

    A view where the projections' ``[1, T, H, D]`` memory allows (``squeeze``, not ``x[0]``: the
    backward of an index builds a zero tensor of x's shape, H-major, and copies the gradient into
    it, so every later gradient on the way back to the projection would need a copy of its own).
    """
    x = x.squeeze(0).transpose(0, 1)
    if repeats > 1:
        seq_len, heads, head_dim = x.shape
        x = (
            x[:, :, None, :]
            .expand(seq_len, heads, repeats, head_dim)
            .reshape(seq_len, heads * repeats, head_dim)
        )
    return x.contiguous()


def varlen_packed(
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scaling, window, sinks=None
) -> Tensor:
    groups = query.shape[1] // key.shape[1]
    extra = {}
    # The direct flash path covers GQA on a torch whose varlen_attn has no enable_gqa.
    direct_gqa = False
    if groups > 1 and not _kv_repeat:
        if _VARLEN_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            direct_gqa = True
        groups = 1
    # transformers' sliding window W keeps keys with q - k < W, i.e. W - 1 to the left.
    window_left = -1 if window is None else window - 1
    q, k, v = to_varlen_layout(query, 1), to_varlen_layout(key, groups), to_varlen_layout(value, groups)
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(torch.int32)
    # Dynamo refuses an autograd.Function given one tensor twice: None stands for "cu_k is cu_q".
    cu_k_arg = None if cu_k is cu_q else cu_k
    if sinks is not None:
        out = _VarlenWithSinks.apply(q, k, v, sinks, cu_q, cu_k_arg, max_q, max_k, scaling, window_left)
    elif direct_gqa:
        out = _VarlenFlash.apply(q, k, v, cu_q, cu_k_arg, max_q, max_k, scaling, window_left)
    else:
        out = varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(window_left, 0), **extra
        )
    return out.unsqueeze(0)


def _flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):
    """Flash varlen forward on ``[T, H, D]``: ``(out, lse [Hq, T] float32, rng_state, unused)``."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        window_left < 0,
        False,
        scale=scale,
        window_size_left=window_left,
        window_size_right=0,
    )
    return out, lse, rng_state, unused


def _flash_varlen_backward(
    grad, q, k, v, out, lse, rng_state, unused, cu_q, cu_k, max_q, max_k, scale, window_left
):
    """Flash varlen backward: ``(dq, dk, dv)``; ``out`` only enters its row term ``rowsum(grad * out)``."""
    return torch.ops.aten._flash_attention_backward(
        grad,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        window_left < 0,
        rng_state,
        unused,
        scale=scale,
        window_size_left=window_left,
        window_size_right=0,
    )


class _VarlenFlash(torch.autograd.Function):
    """Flash varlen attention on ``[T, H, D]`` with ``Hkv`` dividing ``Hq``, K/V not repeated.

    The same two flash ops ``varlen_attn`` wraps; only its Python-side check for equal head counts
    is left out. The forward kernel maps query head ``h`` to K/V head ``h // (Hq / Hkv)`` and the
    backward returns ``dk``/``dv`` with ``Hkv`` heads (each summed over its group of query heads).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):
        cu_k = cu_q if cu_k is None else cu_k
        out, lse, rng_state, unused = _flash_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left
        )
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, window_left)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, rng_state, unused, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _flash_varlen_backward(
            grad.contiguous(), q, k, v, out, lse, rng_state, unused, cu_q, cu_k, *ctx.args
        )
        return dq, dk, dv, None, None, None, None, None, None


class _VarlenWithSinks(torch.autograd.Function):
    """Flash varlen attention with per-head sinks: ``[T, Hq, D]`` in and out, sinks ``[Hq]``.

    Forward: ``o = out * w`` with ``w = sigmoid(lse - sink)`` in float32. Backward, ``g = dL/do``:

    * ``dL/dsink = -sum_t (g . o) (1 - w)``;
    * ``dL/dlse = (g . o) (1 - w)`` reaches every score of the row as ``p_ij * dL/dlse``. The flash
      backward computes ``ds_ij = p_ij (g'_i . v_j - D_i)`` with ``D_i = g'_i . out'_i`` from the
      ``(g', out')`` it is handed. Handing it ``(g * w, o)`` gives ``D_i = w^2 (g . out)``, which is
      exactly ``w (g . out) - dL/dlse``: the ``lse`` gradient without a kernel of our own.

    torch's ``varlen_attn`` returns ``lse`` but its backward ignores the ``lse`` gradient, hence the
    direct calls to the flash ops it wraps. Nothing here reads device memory on the host.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, window_left):
        cu_k = cu_q if cu_k is None else cu_k
        out, lse, rng_state, unused = _flash_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left
        )
        if lse.dim() != 2:
            raise NotImplementedError(
                f"sloth attention sinks need the flash varlen log-sum-exp as [heads, tokens], got {tuple(lse.shape)}"
            )
        gate = torch.sigmoid(lse.transpose(0, 1) - sinks.float())
        gated = (out.float() * gate[..., None]).to(out.dtype)
        ctx.save_for_backward(q, k, v, gated, lse, gate, rng_state, unused, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, window_left)
        ctx.sinks_dtype = sinks.dtype
        return gated

    @staticmethod
    def backward(ctx, grad):
        q, k, v, gated, lse, gate, rng_state, unused, cu_q, cu_k = ctx.saved_tensors
        grad32 = grad.float()
        dsinks = -((grad32 * gated.float()).sum(-1) * (1.0 - gate)).sum(0)
        grad_out = (grad32 * gate[..., None]).to(grad.dtype).contiguous()
        dq, dk, dv = _flash_varlen_backward(
            grad_out, q, k, v, gated, lse, rng_state, unused, cu_q, cu_k, *ctx.args
        )
        return dq, dk, dv, dsinks.to(ctx.sinks_dtype), None, None, None, None, None, None
