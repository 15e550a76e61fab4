"""Multi-head latent attention (DeepSeek-V3) laid out for the flash varlen kernel: q, k and v built
``[T, H, D]`` straight from the projections, each written once, and the projections' gradients
written once in the backward.

transformers' ``DeepseekV3Attention`` builds ``[B, H, T, D]`` tensors with a ``cat`` for the query, a
``copy_`` of the broadcast rotary key into every head, and (for flash) a pad of the values to the
query/key head size; the packed attention then copies each to ``[T, H, D]`` again, slices the output
back to the value width, and the backward retraces every one of those steps. Here, per packed row of
``T`` tokens, ``H`` heads, ``n`` = ``qk_nope_head_dim``, ``r`` = ``qk_rope_head_dim`` and ``v`` =
``v_head_dim``::

    q_b_proj out [T, H*(n+r)] --view--> [T, H, n | r] --mla_query-->     q [T, H, n | rope(r)]
    kv_b_proj out [T, H*(n+v)] -> [T, H, n | v]  \\
    roped k_rot [T, r] (one head, every head's)  --mla_key_value--> k [T, H, n | r]
                                                                   v [T, H, v | 0 ... 0]
    flash out [T, H, W] --mla_output--> [T, H*v] for o_proj

The rotary is transformers' ``apply_rotary_pos_emb_interleave``: the pairs ``(x0, x1), (x2, x3), ...``
of the ``r`` columns rotate by one angle each, and the result is laid out de-interleaved,
``[x_even * cos - x_odd * sin | x_odd * cos + x_even * sin]``. Its products are taken in the promoted
dtype of the input and ``cos``/``sin`` (float32 under autocast, where transformers' are too) and
rounded once to the input's dtype, which is where transformers' float32 query/key meets the bf16
attention: in one dtype the values are transformers' bit for bit.

These are ``torch.autograd.Function``\\ s of plain torch ops, not ``torch.library`` ops: under
``torch.compile`` Inductor sees through them and fuses each into one pass, which an opaque op would
forbid; in eager mode each output is written once (one ``cat`` over views, or a few copies into one
buffer), plus the rotary's products on the ``r`` columns. ``cos``/``sin`` receive no gradient (transformers computes them from buffers).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["interleaved_rope", "mla_key_value", "mla_output", "mla_query"]


def _halves(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` ``[T, r]`` (``cat(freqs, freqs)``) -> the per-pair angle's ``[T, 1, r/2]``."""
    half = cos.shape[-1] // 2
    return cos[:, None, :half], sin[:, None, :half]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The two halves of the interleaved rotary of ``x`` ``[T, H, r]``, in the promoted dtype."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return even * cos - odd * sin, odd * cos + even * sin


def interleaved_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' ``apply_rotary_pos_emb_interleave`` on one tensor, as autograd ops.

    Args:
        x: ``[T, H, r]``.
        cos: ``[T, r]``, the rotary embedding's ``cos`` of the row.
        sin: Same shape as ``cos``.

    Returns:
        ``[T, H, r]`` in the promoted dtype of ``x`` and ``cos`` (as transformers returns it).
    """
    return torch.cat(_rotate(x, *_halves(cos, sin)), dim=-1)


class _Query(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, cos: Tensor, sin: Tensor, nope_dim: int) -> Tensor:
        cos, sin = _halves(cos, sin)
        first, second = _rotate(q[..., nope_dim:], cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.nope_dim = nope_dim
        return torch.cat((q[..., :nope_dim], first.to(q.dtype), second.to(q.dtype)), dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        nope_dim = ctx.nope_dim
        half = cos.shape[-1]
        first, second = grad[..., nope_dim : nope_dim + half], grad[..., nope_dim + half :]
        # The transpose of the rotation, re-interleaved: even <- first*cos + second*sin, odd <-
        # second*cos - first*sin (the sums autograd forms through transformers' slices, term for term).
        grad_q = torch.empty_like(grad, memory_format=torch.contiguous_format)
        grad_q[..., :nope_dim].copy_(grad[..., :nope_dim])
        rope = grad_q[..., nope_dim:]
        rope[..., 0::2].copy_(first * cos + second * sin)
        rope[..., 1::2].copy_(second * cos - first * sin)
        return grad_q, None, None, None


def mla_query(q: Tensor, cos: Tensor, sin: Tensor, nope_dim: int) -> Tensor:
    """The attention query from the query projection's output, its last ``r`` columns rotated.

    Args:
        q: ``[T, H, n + r]`` (the ``q_b_proj``/``q_proj`` output viewed per head).
        cos: ``[T, r]``, the rotary embedding's ``cos`` of the row.
        sin: Same shape as ``cos``.
        nope_dim: ``n``, the columns that pass unrotated.

    Returns:
        ``[T, H, n + r]`` contiguous in ``q``'s dtype: ``cat(q_pass, interleaved_rope(q_rot))``. The
        backward writes ``q``'s gradient in one tensor of the same layout.
    """
    return _Query.apply(q, cos, sin, nope_dim)


class _KeyValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: Tensor, k_rot: Tensor, nope_dim: int, value_width: int) -> tuple[Tensor, Tensor]:
        tokens, heads, width = kv.shape
        value_dim = width - nope_dim
        shared = k_rot.to(kv.dtype)[:, None, :].expand(tokens, heads, k_rot.shape[-1])
        key = torch.cat((kv[..., :nope_dim], shared), dim=-1)
        value = kv[..., nope_dim:]
        if value_width > value_dim:  # zero columns: a broadcast scalar, read in place by cat
            zeros = kv.new_zeros(()).expand(tokens, heads, value_width - value_dim)
            value = torch.cat((value, zeros), dim=-1)
        else:
            value = value.contiguous()
        ctx.nope_dim, ctx.value_dim, ctx.rot_dtype = nope_dim, value_dim, k_rot.dtype
        return key, value

    @staticmethod
    def backward(ctx, grad_key: Tensor, grad_value: Tensor):
        nope_dim, value_dim = ctx.nope_dim, ctx.value_dim
        grad_kv = torch.cat((grad_key[..., :nope_dim], grad_value[..., :value_dim]), dim=-1)
        grad_rot = None
        if ctx.needs_input_grad[1]:
            rot = grad_key[..., nope_dim:]
            grad_rot = rot.sum(1, dtype=torch.promote_types(rot.dtype, torch.float32)).to(ctx.rot_dtype)
        return grad_kv, grad_rot, None, None


def mla_key_value(kv: Tensor, k_rot: Tensor, nope_dim: int, value_width: int) -> tuple[Tensor, Tensor]:
    """Keys and values from the ``kv_b_proj`` output and the shared rotary key.

    Args:
        kv: ``[T, H, n + v]`` (the ``kv_b_proj`` output viewed per head: ``k_nope | value``).
        k_rot: ``[T, r]``, the rotated key part every head shares.
        nope_dim: ``n``.
        value_width: the value head size to write, ``>= v``: ``n + r`` for the flash kernel (zero
            columns after the ``v`` values), ``v`` for attention that takes unequal head sizes.

    Returns:
        ``key`` ``[T, H, n + r]`` and ``value`` ``[T, H, value_width]``, contiguous, in ``kv``'s dtype.
        The backward writes ``kv``'s gradient once (the key's first ``n`` and the value's first
        ``v`` columns of each head) and ``k_rot``'s as the sum over heads (accumulated in float32 at
        least, rounded once to ``k_rot``'s dtype).
    """
    return _KeyValue.apply(kv, k_rot, nope_dim, value_width)


class _Output(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, value_dim: int) -> Tensor:
        tokens, heads, width = out.shape
        ctx.shape = (tokens, heads, value_dim, width - value_dim)
        return out[..., :value_dim].reshape(tokens, heads * value_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        tokens, heads, value_dim, pad = ctx.shape
        zeros = grad.new_zeros(()).expand(tokens, heads, pad)
        return torch.cat((grad.reshape(tokens, heads, value_dim), zeros), dim=-1), None


def mla_output(out: Tensor, value_dim: int) -> Tensor:
    """The first ``value_dim`` columns of each head of the attention output, flat for ``o_proj``.

    Args:
        out: ``[T, H, W]`` with ``W >= value_dim`` (the flash output over zero-padded values, whose
            last ``W - value_dim`` columns are zero).
        value_dim: ``v``.

    Returns:
        ``[T, H * v]`` contiguous (one copy; a view when ``W == v``). The backward writes the
        ``[T, H, W]`` gradient the flash backward reads, zero past ``v``, in one pass.
    """
    if out.shape[-1] == value_dim:
        return out.reshape(out.shape[0], -1)
    return _Output.apply(out, value_dim)
