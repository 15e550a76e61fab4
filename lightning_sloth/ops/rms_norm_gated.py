"""The gated RMSNorm after a Gated DeltaNet layer's delta rule (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as
the ops ``sloth::rms_norm_gated`` and ``sloth::rms_norm_gated_backward``.

``y = (w * round(x * rstd)) * silu(z)`` over the last dimension, in the order and roundings of
transformers' ``Qwen3_5RMSNormGated`` (and Qwen3-Next's copy): ``x * rstd`` in fp32 rounded to x's
dtype, the weight product in the promoted dtype of the weight and x (rounded where that is 16-bit),
the gate's SiLU in fp32, one rounding to x's dtype at the end. One pass each way instead of the
module's dozen elementwise kernels, and the backward saves x, z and ``rstd`` (not the fp32
intermediates autograd would keep).
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
    from lightning_sloth.kernels import rms_norm_gated as _kernels

__all__ = ["rms_norm_gated", "rms_norm_gated_backward_reference", "rms_norm_gated_reference"]

# Elementwise arithmetic per value: square, sum, scale, weight product, sigmoid, two products; the
# backward's sigmoid, SiLU derivative, products, row dot product, correction and dW accumulation.
_FORWARD_FLOPS_PER_VALUE = 7
_BACKWARD_FLOPS_PER_VALUE = 16


def _rounds_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``weight * x_hat`` is rounded: its promoted dtype is 16-bit (then x's own)."""
    return torch.promote_types(weight.dtype, x.dtype) != torch.float32


def rms_norm_gated_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the module's operations in its order: ``(y, rstd)``, y contiguous in x's dtype,
    rstd ``x.shape[:-1]`` float32."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    hidden = weight * (x32 * rstd).to(x.dtype)
    y = hidden * torch.nn.functional.silu(gate.to(torch.float32))
    return y.to(x.dtype).contiguous(), rstd.squeeze(-1).contiguous()


def rms_norm_gated_backward_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch gradients of :func:`rms_norm_gated_reference` in fp32 (the roundings pass
    gradients through): ``(grad_x, grad_gate, grad_weight)`` in their inputs' dtypes."""
    dy = grad_y.to(torch.float32)
    x_hat = x.to(torch.float32) * rstd.unsqueeze(-1)
    h = x_hat.to(x.dtype).to(torch.float32)
    w = weight.to(torch.float32)
    product = w * h
    if _rounds_product(x, weight):
        product = product.to(x.dtype).to(torch.float32)
    z = gate.to(torch.float32)
    sig = torch.sigmoid(z)
    d_product = dy * z * sig
    grad_gate = dy * product * sig * (1 + z * (1 - sig))
    d_h = d_product * w
    proj = (d_h * x_hat).mean(-1, keepdim=True)
    grad_x = (d_h - x_hat * proj) * rstd.unsqueeze(-1)
    grad_weight = (d_product * h).reshape(-1, x.shape[-1]).sum(0)
    return (
        grad_x.to(x.dtype).contiguous(),
        grad_gate.to(gate.dtype).contiguous(),
        grad_weight.to(weight.dtype),
    )


@sloth_op("rms_norm_gated")
def _rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernels.rms_norm_gated_forward(x, gate, weight, eps, _rounds_product(x, weight))
    return rms_norm_gated_reference(x, gate, weight, eps)


@_rms_norm_gated.register_fake
def _(x, gate, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@sloth_op("rms_norm_gated_backward")
def _rms_norm_gated_backward(
    grad_y: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernels.rms_norm_gated_backward(grad_y, x, gate, weight, rstd, _rounds_product(x, weight))
    return rms_norm_gated_backward_reference(grad_y, x, gate, weight, rstd)


@_rms_norm_gated_backward.register_fake
def _(grad_y, x, gate, weight, rstd):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, gate, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])  # rstd: saved for the backward, not a result
    ctx.save_for_backward(x, gate, weight, output[1])


def _backward(ctx, grad_y, _grad_rstd):
    x, gate, weight, rstd = ctx.saved_tensors
    grad_x, grad_gate, grad_weight = call(_rms_norm_gated_backward, grad_y, x, gate, weight, rstd)
    needs = ctx.needs_input_grad
    return grad_x, grad_gate if needs[1] else None, grad_weight if needs[2] else None, None


register_autograd(_rms_norm_gated, _backward, _setup_context)
register_flops(_rms_norm_gated, lambda x, *_, out_shape=None: _FORWARD_FLOPS_PER_VALUE * math.prod(x))
register_flops(
    _rms_norm_gated_backward,
    lambda grad_y, *_, out_shape=None: _BACKWARD_FLOPS_PER_VALUE * math.prod(grad_y),
)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(weight * rms_norm(x)) * silu(gate)`` over the last dimension, differentiable in all three.

    Args:
        x: ``[..., D]`` float16/bfloat16/float32, any leading shape and strides.
        gate: x's shape, any float dtype, on x's device.
        weight: ``[D]`` float, on x's device.
        eps: Added to the mean square.

    Returns:
        ``[..., D]`` contiguous, in x's dtype.

    Raises:
        ValueError: On a gate or weight of the wrong shape or device, or non-float inputs.
    """
    if gate.shape != x.shape:
        raise ValueError(
            f"rms_norm_gated: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm_gated: weight must have shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if not (x.is_floating_point() and gate.is_floating_point() and weight.is_floating_point()):
        raise ValueError(
            f"rms_norm_gated: x, gate and weight must be floating point, got {x.dtype}, {gate.dtype}, {weight.dtype}"
        )
    if not (x.device == gate.device == weight.device):
        raise ValueError(
            f"rms_norm_gated: x, gate and weight must be on one device, got {x.device}, {gate.device}, {weight.device}"
        )
    return call(_rms_norm_gated, x, gate, weight, float(eps))[0]
