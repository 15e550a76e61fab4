"""Gated MLP activations as the ops ``sloth::swiglu`` and ``sloth::geglu`` (and their ``_backward`` ops).

``swiglu(gate, up) = silu(gate) * up`` (Llama, Mistral, Qwen) and ``geglu(gate, up) =
gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``). On CUDA the forward and backward are each one
fused Triton kernel computing in fp32; the backward recomputes the activation from gate and up, so
only the two inputs are saved.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_sloth.ops.registry import (
    TRITON_OPS,
    call,
    register_autograd,
    register_flops,
    sloth_op,
    use_triton,
)

if TRITON_OPS:
    from lightning_sloth.kernels import glu as _kernels

__all__ = ["geglu", "glu_backward_reference", "glu_reference", "swiglu"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715

# Elementwise arithmetic per value (exp, reciprocal and the polynomial each counted once).
_FLOPS_PER_VALUE = {"silu": (5, 9), "gelu_tanh": (10, 16)}  # (forward, backward)


def _activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh")


def _activation_derivative(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        s = torch.sigmoid(gate)
        return s * (1.0 + gate * (1.0 - s))
    # gelu_tanh(g) = g * sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3)
    s = torch.sigmoid(2.0 * _SQRT_2_OVER_PI * gate * (1.0 + _GELU_CUBIC * gate * gate))
    dz = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * gate * gate)
    return s + gate * s * (1.0 - s) * dz


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """Plain-torch forward, transformers' expression ``act_fn(gate) * up`` in the inputs' dtype.

    Args:
        gate: ``[..., I]`` float tensor.
        up: Same shape and dtype as gate.
        activation: ``"silu"`` or ``"gelu_tanh"``.

    Returns:
        Contiguous ``[..., I]`` in gate's dtype.
    """
    return (_activation(gate, activation) * up).contiguous()


def glu_backward_reference(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch gradients of :func:`glu_reference`, computed in fp32 (at least).

    Returns:
        ``grad_gate`` and ``grad_up``, contiguous, in the dtypes of gate and up.
    """
    compute = torch.promote_types(gate.dtype, torch.float32)
    g, u, dy = gate.to(compute), up.to(compute), grad_out.to(compute)
    grad_gate = dy * u * _activation_derivative(g, activation)
    grad_up = dy * _activation(g, activation)
    return grad_gate.to(gate.dtype).contiguous(), grad_up.to(up.dtype).contiguous()


def _register(name: str, activation: str) -> Callable[..., torch.Tensor]:
    """Register ``sloth::<name>``, ``sloth::<name>_backward`` and ``sloth::<name>_backward_`` (in place)."""

    def forward(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
        if use_triton(gate):
            return _kernels.glu_forward(gate, up, activation)
        return glu_reference(gate, up, activation)

    def backward(
        grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(gate):
            return _kernels.glu_backward(grad_out, gate, up, activation)
        return glu_backward_reference(grad_out, gate, up, activation)

    def backward_inplace(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
        if use_triton(gate):
            grad_gate, grad_up = _kernels.glu_backward(grad_out, gate, up, activation, in_place=True)
        else:
            grad_gate, grad_up = glu_backward_reference(grad_out, gate, up, activation)
        if grad_gate is not gate:  # the reference, or rows the kernel could not write in place
            gate.copy_(grad_gate)
            up.copy_(grad_up)

    forward_op = sloth_op(name)(forward)
    backward_op = sloth_op(f"{name}_backward")(backward)
    inplace_op = sloth_op(f"{name}_backward_", mutates_args=("gate", "up"))(backward_inplace)
    forward_op.register_fake(lambda gate, up, inplace_backward=False: gate.new_empty(gate.shape))
    backward_op.register_fake(lambda grad_out, gate, up: (gate.new_empty(gate.shape), up.new_empty(up.shape)))
    inplace_op.register_fake(lambda grad_out, gate, up: None)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.inplace_backward = len(inputs) > 2 and bool(inputs[2])

    def autograd_backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        if ctx.inplace_backward:
            call(inplace_op, grad_out, gate, up)
            return gate, up, None
        return (*call(backward_op, grad_out, gate, up), None)

    register_autograd(forward_op, autograd_backward, setup_context)
    forward_flops, backward_flops = _FLOPS_PER_VALUE[activation]
    register_flops(
        forward_op, lambda gate, up, inplace_backward=False, out_shape=None: forward_flops * math.prod(gate)
    )
    register_flops(backward_op, lambda grad_out, gate, up, out_shape=None: backward_flops * math.prod(gate))
    register_flops(inplace_op, lambda grad_out, gate, up, out_shape=None: backward_flops * math.prod(gate))
    return forward_op


_swiglu = _register("swiglu", "silu")
_geglu = _register("geglu", "gelu_tanh")


def _check(name: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dtype != up.dtype or not gate.is_floating_point():
        raise ValueError(f"{name}: gate and up must share a floating dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"{name}: gate is on {gate.device} but up is on {up.device}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, the activation of Llama-style gated MLPs.

    Args:
        gate: ``[..., I]`` float16/bfloat16/float32, any strides (e.g. half of a fused gate-up output).
        up: Same shape and dtype as gate.
        inplace_backward: The backward overwrites gate and up with their gradients (saves two
            ``[..., I]`` buffers). Only when gate and up are used by nothing else afterwards.

    Returns:
        Contiguous ``[..., I]`` in the inputs' dtype.

    Raises:
        ValueError: On mismatched shapes, dtypes or devices.
    """
    _check("swiglu", gate, up)
    return call(_swiglu, gate, up, inplace_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) * up``, Gemma's gated MLP activation (``gelu_pytorch_tanh``).

    Args:
        gate: ``[..., I]`` float16/bfloat16/float32, any strides.
        up: Same shape and dtype as gate.
        inplace_backward: The backward overwrites gate and up with their gradients (saves two
            ``[..., I]`` buffers). Only when gate and up are used by nothing else afterwards.

    Returns:
        Contiguous ``[..., I]`` in the inputs' dtype.

    Raises:
        ValueError: On mismatched shapes, dtypes or devices.
    """
    _check("geglu", gate, up)
    return call(_geglu, gate, up, inplace_backward)
