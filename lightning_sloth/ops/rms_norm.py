"""RMSNorm as the ops ``sloth::rms_norm`` and ``sloth::rms_norm_backward``, and the residual add
fused into it as ``sloth::add_rms_norm`` / ``sloth::add_rms_norm_backward``.

``y = x * rstd * (weight + offset)`` over the last dimension, ``rstd = 1 / sqrt(mean(x**2) + eps)`` in
fp32. The forward returns ``rstd`` as a second output so the backward reuses it instead of recomputing
it. The offset picks the Hugging Face module whose cast order is reproduced:

- ``offset=0`` (LlamaRMSNorm; Mistral, Qwen2/3 and Qwen3's per-head q/k norms are copies of it):
  ``x * rstd`` is rounded to x's dtype, then multiplied by the weight.
- ``offset=1`` (GemmaRMSNorm, Gemma3RMSNorm: ``1 + weight``): the weight product is taken in fp32 and
  rounded once.
"""

import math

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
    from lightning_sloth.kernels import rms_norm as _kernels

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_backward_reference",
    "rms_norm_reference",
]

# Elementwise arithmetic per input value, for FlopCounterMode: square, sum, scale, weight product;
# the backward's two products, row dot product, correction and dW accumulation.
_FORWARD_FLOPS_PER_VALUE = 4
_BACKWARD_FLOPS_PER_VALUE = 9


def _casts_before_weight(offset: float) -> bool:
    return offset == 0.0


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch forward, the same operations in the same order as the Hugging Face modules.

    Args:
        x: ``[..., D]`` float tensor.
        weight: ``[D]``.
        eps: Added to the mean square.
        offset: 0 (Llama order) or another value (Gemma order, ``offset + weight`` in fp32).

    Returns:
        ``y`` (contiguous, shape and dtype of x) and ``rstd`` (``x.shape[:-1]``, float32).
    """
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x32 * rstd
    if _casts_before_weight(offset):
        y = weight * x_hat.to(x.dtype)
    else:
        y = x_hat * (offset + weight.to(torch.float32))
    return y.to(x.dtype).contiguous(), rstd.squeeze(-1).contiguous()


def rms_norm_backward_reference(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch gradients of :func:`rms_norm_reference`, in fp32.

    Args:
        grad_y: ``[..., D]``, the gradient of y.
        x: ``[..., D]``, the forward input.
        weight: ``[D]``.
        rstd: ``x.shape[:-1]`` float32 from the forward.
        offset: The forward's offset.

    Returns:
        ``grad_x`` (contiguous, shape and dtype of x) and ``grad_weight`` (shape and dtype of weight).
    """
    x_hat = x.to(torch.float32) * rstd.unsqueeze(-1)
    grad_y32 = grad_y.to(torch.float32)
    grad_x_hat = grad_y32 * (offset + weight.to(torch.float32))
    proj = (grad_x_hat * x_hat).mean(-1, keepdim=True)
    grad_x = (grad_x_hat - x_hat * proj) * rstd.unsqueeze(-1)
    grad_weight = (grad_y32 * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype).contiguous(), grad_weight.to(weight.dtype)


@sloth_op("rms_norm")
def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernels.rms_norm_forward(x, weight, eps, offset, _casts_before_weight(offset))
    return rms_norm_reference(x, weight, eps, offset)


@_rms_norm.register_fake
def _(x, weight, eps, offset):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@sloth_op("rms_norm_backward")
def _rms_norm_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernels.rms_norm_backward(grad_y, x, weight, rstd, offset)
    return rms_norm_backward_reference(grad_y, x, weight, rstd, offset)


@_rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd, offset):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _, offset = inputs
    ctx.mark_non_differentiable(output[1])  # rstd: saved for the backward, not a result
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_weight = call(_rms_norm_backward, grad_y, x, weight, rstd, ctx.offset)
    return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None, None


register_autograd(_rms_norm, _backward, _setup_context)
register_flops(_rms_norm, lambda x, *_, out_shape=None: _FORWARD_FLOPS_PER_VALUE * math.prod(x))
register_flops(
    _rms_norm_backward, lambda grad_y, *_, out_shape=None: _BACKWARD_FLOPS_PER_VALUE * math.prod(grad_y)
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, differentiable in x and weight.

    Args:
        x: ``[..., D]`` float16/bfloat16/float32, any leading shape (e.g. ``[B, T, H]`` hidden states
            or ``[B, T, heads, head_dim]`` for per-head q/k norms) and any strides.
        weight: ``[D]`` float tensor on x's device.
        eps: Added to the mean square before the reciprocal square root.
        offset: 0 for Llama-style modules (``weight * x_hat``, rounded to x's dtype first); 1 for
            Gemma's ``(1 + weight) * x_hat`` (one rounding, from fp32).

    Returns:
        ``[..., D]`` contiguous, in x's dtype.

    Raises:
        ValueError: On a weight of the wrong shape, device or non-float dtypes.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"rms_norm: x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")
    return call(_rms_norm, x, weight, float(eps), float(offset))[0]


# ------------------------------------------------------------------------------ add_rms_norm
def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch ``s = x + residual`` (in x's dtype, as the decoder layer adds), then
    :func:`rms_norm_reference` of ``s``: returns ``(y, s, rstd)``."""
    summed = (x + residual).contiguous()
    y, rstd = rms_norm_reference(summed, weight, eps, offset)
    return y, summed, rstd


@sloth_op("add_rms_norm")
def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernels.add_rms_norm_forward(x, residual, weight, eps, offset, _casts_before_weight(offset))
    return add_rms_norm_reference(x, residual, weight, eps, offset)


@_add_rms_norm.register_fake
def _(x, residual, weight, eps, offset):
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@sloth_op("add_rms_norm_backward")
def _add_rms_norm_backward(
    grad_y: torch.Tensor,
    grad_sum: torch.Tensor,
    summed: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(summed):
        return _kernels.rms_norm_backward(grad_y, summed, weight, rstd, offset, grad_sum=grad_sum)
    grad_s, grad_weight = rms_norm_backward_reference(grad_y, summed, weight, rstd, offset)
    return (grad_s.to(torch.float32) + grad_sum.to(torch.float32)).to(summed.dtype), grad_weight


@_add_rms_norm_backward.register_fake
def _(grad_y, grad_sum, summed, weight, rstd, offset):
    return summed.new_empty(summed.shape), weight.new_empty(weight.shape)


def _add_setup_context(ctx, inputs, output):
    _, _, weight, _, offset = inputs
    _, summed, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(summed, weight, rstd)
    ctx.offset = offset


def _add_backward(ctx, grad_y, grad_sum, _grad_rstd):
    summed, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(summed)
    if grad_sum is None:
        grad_sum = torch.zeros_like(summed)
    grad_s, grad_weight = call(_add_rms_norm_backward, grad_y, grad_sum, summed, weight, rstd, ctx.offset)
    # Both summands get the sum's gradient (one tensor, as autograd's own add backward hands it on).
    return grad_s, grad_s, grad_weight if ctx.needs_input_grad[2] else None, None, None


register_autograd(_add_rms_norm, _add_backward, _add_setup_context)
register_flops(_add_rms_norm, lambda x, *_, out_shape=None: (_FORWARD_FLOPS_PER_VALUE + 1) * math.prod(x))
register_flops(
    _add_rms_norm_backward,
    lambda grad_y, *_, out_shape=None: (_BACKWARD_FLOPS_PER_VALUE + 1) * math.prod(grad_y),
)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` and ``rms_norm(s)`` in one pass: a decoder layer's residual add and the
    norm that follows it.

    Args:
        x: ``[..., D]`` float16/bfloat16/float32 (e.g. the attention block's output).
        residual: ``[..., D]``, same shape, dtype and device as x.
        weight, eps, offset: as for :func:`rms_norm`.

    Returns:
        ``(rms_norm(s), s)``, both ``[..., D]`` contiguous in x's dtype; ``s`` is rounded to x's dtype
        before the norm reads it, exactly as ``residual + x`` followed by the norm module.

    Raises:
        ValueError: On mismatched shapes, dtypes or devices, or a weight of the wrong shape.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"add_rms_norm: residual must match x, got x {tuple(x.shape)} {x.dtype} {x.device} and "
            f"residual {tuple(residual.shape)} {residual.dtype} {residual.device}"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"add_rms_norm: weight must have shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise ValueError(
            f"add_rms_norm: x and weight must be floating point, got {x.dtype} and {weight.dtype}"
        )
    if x.device != weight.device:
        raise ValueError(f"add_rms_norm: x is on {x.device} but weight is on {weight.device}")
    y, summed, _ = call(_add_rms_norm, x, residual, weight, float(eps), float(offset))
    return y, summed
