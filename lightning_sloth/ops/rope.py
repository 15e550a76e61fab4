"""Rotary position embedding as the ops ``sloth::rope`` and ``sloth::rope_backward``.

Exactly transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (rotate-half convention,
``unsqueeze_dim=1``) on q and k together, plus partial rotary: with ``cos.shape[-1] = R < head_dim``
the first R features rotate and the rest pass through, as the partial-rotary attention modules do.

The op takes ``cos``/``sin`` as the model's rotary embedding module returns them (its
``position_embeddings``), so every scaling variant (default, linear, dynamic, llama3, yarn, longrope)
is supported: they only change how that module computes cos/sin. cos/sin receive no gradient.
"""

import torch

from lightning_sloth.ops.registry import (
    TRITON_OPS,
    call,
    register_autograd,
    register_flops,
    sloth_op,
    use_triton,
)

if TRITON_OPS:
    from lightning_sloth.kernels import rope as _kernels

__all__ = ["apply_rope", "rope_backward_reference", "rope_reference"]

# Multiplies and adds per rotated value (x * cos + rotate_half(x) * sin), forward and backward alike.
_FLOPS_PER_ROTATED_VALUE = 3


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated_like(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot = x[..., :rotary_dim]
    out = torch.empty_like(x)
    if backward:
        # The transpose of rotate_half is -rotate_half.
        out[..., :rotary_dim] = x_rot * cos - _rotate_half(x_rot * sin)
    else:
        out[..., :rotary_dim] = x_rot * cos + _rotate_half(x_rot) * sin
    out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch forward: transformers' expression, in the inputs' dtype.

    Args:
        q: ``[B, Hq, T, D]``.
        k: ``[B, Hkv, T, D]``.
        cos: ``[B or 1, T, R]``, ``R <= D`` even.
        sin: Same shape as cos.

    Returns:
        Rotated q and k, allocated with ``torch.empty_like`` of q and k.
    """
    return _rotated_like(q, cos, sin, backward=False), _rotated_like(k, cos, sin, backward=False)


def rope_backward_reference(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch gradients of :func:`rope_reference` with respect to q and k (shapes as there)."""
    return _rotated_like(grad_q, cos, sin, backward=True), _rotated_like(grad_k, cos, sin, backward=True)


@sloth_op("rope")
def _rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return _kernels.rope(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)


@_rope.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@sloth_op("rope_backward")
def _rope_backward(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(grad_q):
        return _kernels.rope(grad_q, grad_k, cos, sin, backward=True)
    return rope_backward_reference(grad_q, grad_k, cos, sin)


@_rope_backward.register_fake
def _(grad_q, grad_k, cos, sin):
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernel reads features contiguously; every other stride is free (q/k outputs keep them).
    return x if x.stride(-1) == 1 else x.contiguous()


def _setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = call(_rope_backward, _unit_last_stride(grad_q), _unit_last_stride(grad_k), cos, sin)
    return grad_q, grad_k, None, None


def _flops(q, k, cos, *_, out_shape=None) -> int:
    batch, n_q_heads, seq_len, _ = q
    return _FLOPS_PER_ROTATED_VALUE * batch * seq_len * cos[-1] * (n_q_heads + k[1])


register_autograd(_rope, _backward, _setup_context)
register_flops(_rope, _flops)
register_flops(_rope_backward, _flops)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on q and k, as transformers' ``apply_rotary_pos_emb``.

    Args:
        q: ``[B, Hq, T, D]`` float16/bfloat16/float32 (the layout of transformers' attention modules;
            a ``transpose(1, 2)`` view is fine). D is typically 64, 80, 128 or 256.
        k: ``[B, Hkv, T, D]`` with the same B, T, D and dtype; ``Hkv`` may differ from ``Hq`` (GQA).
        cos: ``[B or 1, T, R]`` (or ``[T, R]``) from the model's rotary embedding, ``R <= D`` even;
            ``R < D`` rotates the first R features and passes the rest through.
        sin: Same shape as cos.

    Returns:
        Rotated ``(q, k)`` in their dtypes, with the strides of q and k where those are dense.

    Raises:
        ValueError: On mismatched shapes, dtypes or devices, an odd or too large rotary dimension, or
            cos/sin that require a gradient (the op does not compute one for them).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"apply_rope: q and k must be [B, heads, T, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    batch, _, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, length or head_dim"
        )
    if q.dtype != k.dtype or not q.is_floating_point():
        raise ValueError(f"apply_rope: q and k must share a floating dtype, got {q.dtype} and {k.dtype}")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(
            f"apply_rope: cos and sin must both be [B, T, R], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise ValueError(
            f"apply_rope: cos/sin {tuple(cos.shape)} do not match batch {batch} and length {seq_len}"
        )
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim or rotary_dim == 0:
        raise ValueError(
            f"apply_rope: rotary dimension {rotary_dim} must be even, positive and at most head_dim {head_dim}"
        )
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError(
            f"apply_rope: q, k, cos, sin must be on one device, got {q.device}, {k.device}, {cos.device}, {sin.device}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope: cos/sin require grad, but the op gives them none; pass them detached")
    return call(_rope, *(_unit_last_stride(t) for t in (q, k, cos, sin)))
