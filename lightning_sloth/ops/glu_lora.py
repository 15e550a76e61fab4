"""Gated MLP activations with gate and up's LoRA parts added inside: ``sloth::swiglu_lora`` and
``sloth::geglu_lora`` (and their ``_backward`` / in-place ``_backward_`` ops)::

    out = act(gate + s_g (xa_g B_g^T)) * (up + s_u (xa_u B_u^T))

``gate`` and ``up`` are the base products alone (``x W_g^T``, ``x W_u^T``), ``xa = [x A_g^T, x A_u^T]``
the adapters' ``[rows, r_g + r_u]`` products. A LoRA projection otherwise adds its ``[rows, I]``
low-rank part into its output with a read-modify-write pass of its own (``addmm_``: at the 8B
shape's 14,336-wide gate and up, ~0.5 ms each per layer and pass on an H100); here each tile of
the activation's kernel computes the two parts with one small dot each while it reads gate and up
anyway. The backward recomputes them the same way and returns the gradients of the full gate and
up: those of the base products and of the low-rank parts alike (``d(x W^T) = d(xa B^T) =
d gate``), so the node that produced gate, up and xa computes every other gradient from them
(:class:`~lightning_sloth.ops.fp8_lora.SharedInputLoraFP8` with ``bases_only``). xa and the B's are
read as constants here (the op gives them no gradient).

On CUDA each direction is one Triton kernel (``lightning_sloth.kernels.glu``) computing in fp32 and
rounding once; elsewhere the plain-torch reference below, which is also the kernel's oracle. The
unfused path rounds gate and up to their dtype after adding the low-rank parts; this one does not
(one rounding fewer).
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_sloth.ops.glu import glu_backward_reference, glu_reference
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

__all__ = ["geglu_lora", "glu_lora_backward_reference", "glu_lora_reference", "swiglu_lora"]

_FLOPS_PER_VALUE = {"silu": (5, 9), "gelu_tanh": (10, 16)}  # (forward, backward), as ops.glu


def _full(gate, up, xa, b_gate, b_up, scale_gate, scale_up) -> tuple[Tensor, Tensor]:
    """gate and up with their low-rank parts, ``[rows, I]`` in float32 (at least)."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    r = b_gate.shape[1]
    xa = xa.to(compute)
    g = gate.reshape(-1, gate.shape[-1]).to(compute) + scale_gate * (xa[:, :r] @ b_gate.to(compute).t())
    u = up.reshape(-1, up.shape[-1]).to(compute) + scale_up * (xa[:, r:] @ b_up.to(compute).t())
    return g, u


def glu_lora_reference(
    gate, up, xa, b_gate, b_up, scale_gate: float, scale_up: float, activation: str
) -> Tensor:
    """Plain-torch forward in float32 (at least), rounded once to gate's dtype; ``[..., I]``, contiguous."""
    g, u = _full(gate, up, xa, b_gate, b_up, scale_gate, scale_up)
    return glu_reference(g, u, activation).to(gate.dtype).view(gate.shape)


def glu_lora_backward_reference(
    grad_out, gate, up, xa, b_gate, b_up, scale_gate: float, scale_up: float, activation: str
) -> tuple[Tensor, Tensor]:
    """Plain-torch gradients of the full gate and up, in float32 (at least), rounded to their dtypes."""
    g, u = _full(gate, up, xa, b_gate, b_up, scale_gate, scale_up)
    grad_gate, grad_up = glu_backward_reference(grad_out.reshape(g.shape), g, u, activation)
    return grad_gate.to(gate.dtype).view(gate.shape), grad_up.to(up.dtype).view(up.shape)


def _register(name: str, activation: str) -> Callable[..., Tensor]:
    """Register ``sloth::<name>``, ``sloth::<name>_backward`` and ``sloth::<name>_backward_`` (in place)."""

    def forward(
        gate: Tensor,
        up: Tensor,
        xa: Tensor,
        b_gate: Tensor,
        b_up: Tensor,
        scale_gate: float,
        scale_up: float,
        inplace_backward: bool = False,
    ) -> Tensor:
        if use_triton(gate):
            return _kernels.glu_lora_forward(gate, up, xa, b_gate, b_up, scale_gate, scale_up, activation)
        return glu_lora_reference(gate, up, xa, b_gate, b_up, scale_gate, scale_up, activation)

    def backward(
        grad_out: Tensor,
        gate: Tensor,
        up: Tensor,
        xa: Tensor,
        b_gate: Tensor,
        b_up: Tensor,
        scale_gate: float,
        scale_up: float,
    ) -> tuple[Tensor, Tensor]:
        args = (grad_out, gate, up, xa, b_gate, b_up, scale_gate, scale_up, activation)
        if use_triton(gate):
            return _kernels.glu_lora_backward(*args)
        return glu_lora_backward_reference(*args)

    def backward_inplace(
        grad_out: Tensor,
        gate: Tensor,
        up: Tensor,
        xa: Tensor,
        b_gate: Tensor,
        b_up: Tensor,
        scale_gate: float,
        scale_up: float,
    ) -> None:
        args = (grad_out, gate, up, xa, b_gate, b_up, scale_gate, scale_up, activation)
        if use_triton(gate):
            grad_gate, grad_up = _kernels.glu_lora_backward(*args, in_place=True)
        else:
            grad_gate, grad_up = glu_lora_backward_reference(*args)
        if grad_gate is not gate:  # the reference, or rows the kernel could not write in place
            gate.copy_(grad_gate)
            up.copy_(grad_up)

    forward_op = sloth_op(name)(forward)
    backward_op = sloth_op(f"{name}_backward")(backward)
    inplace_op = sloth_op(f"{name}_backward_", mutates_args=("gate", "up"))(backward_inplace)
    forward_op.register_fake(lambda gate, up, *rest: gate.new_empty(gate.shape))
    backward_op.register_fake(
        lambda grad_out, gate, up, *rest: (gate.new_empty(gate.shape), up.new_empty(up.shape))
    )
    inplace_op.register_fake(lambda *args: None)

    def setup_context(ctx, inputs, output):
        gate, up, xa, b_gate, b_up, scale_gate, scale_up = inputs[:7]
        ctx.save_for_backward(gate, up, xa, b_gate, b_up)
        ctx.scales = (scale_gate, scale_up)
        ctx.inplace_backward = len(inputs) > 7 and bool(inputs[7])

    def autograd_backward(ctx, grad_out):
        if any(ctx.needs_input_grad[2:5]):
            raise RuntimeError(
                f"sloth::{name} gives xa and the B's no gradient: pass them detached (the node that "
                "made gate, up and xa computes the adapters' gradients from gate's and up's)"
            )
        gate, up, xa, b_gate, b_up = ctx.saved_tensors
        args = (grad_out, gate, up, xa, b_gate, b_up, *ctx.scales)
        if ctx.inplace_backward:
            call(inplace_op, *args)
            return gate, up, None, None, None, None, None, None
        return (*call(backward_op, *args), None, None, None, None, None, None)

    register_autograd(forward_op, autograd_backward, setup_context)
    forward_flops, backward_flops = _FLOPS_PER_VALUE[activation]

    def count(per_value: int, gate, b_gate, b_up) -> int:
        return (per_value + 2 * (b_gate[1] + b_up[1])) * math.prod(gate)  # the two low-rank dots

    register_flops(
        forward_op,
        lambda gate, up, xa, b_gate, b_up, s_g, s_u, inplace_backward=False, out_shape=None: count(
            forward_flops, gate, b_gate, b_up
        ),
    )
    for op in (backward_op, inplace_op):
        register_flops(
            op,
            lambda grad_out, gate, up, xa, b_gate, b_up, s_g, s_u, out_shape=None: count(
                backward_flops, gate, b_gate, b_up
            ),
        )
    return forward_op


_swiglu_lora = _register("swiglu_lora", "silu")
_geglu_lora = _register("geglu_lora", "gelu_tanh")


def _check(name: str, gate, up, xa, b_gate, b_up) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or not gate.is_floating_point():
        raise ValueError(
            f"{name}: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} must share "
            "one floating dtype and shape"
        )
    rows, width = math.prod(gate.shape[:-1]), gate.shape[-1]
    r_g, r_u = b_gate.shape[-1], b_up.shape[-1]
    if b_gate.shape != (width, r_g) or b_up.shape != (width, r_u) or xa.shape != (rows, r_g + r_u):
        raise ValueError(
            f"{name}: for gate [..., {width}] over {rows} rows, B_gate must be [{width}, r_g], B_up "
            f"[{width}, r_u] and xa [{rows}, r_g + r_u]; got B_gate {tuple(b_gate.shape)}, B_up "
            f"{tuple(b_up.shape)}, xa {tuple(xa.shape)}"
        )
    if not (xa.dtype == b_gate.dtype == b_up.dtype):
        raise ValueError(
            f"{name}: xa and the B's must share a dtype, got {xa.dtype}, {b_gate.dtype}, {b_up.dtype}"
        )
    if len({t.device for t in (gate, up, xa, b_gate, b_up)}) != 1:
        raise ValueError(f"{name}: gate, up, xa and the B's must be on one device")
    if xa.shape[1] > 1 and xa.stride(1) != 1:
        raise ValueError(f"{name}: xa must have unit column stride")


def _apply(op, name, gate, up, xa, b_gate, b_up, scale_gate, scale_up, inplace_backward) -> Tensor:
    _check(name, gate, up, xa, b_gate, b_up)
    return call(
        op, gate, up, xa.detach(), b_gate.detach(), b_up.detach(), float(scale_gate), float(scale_up),
        bool(inplace_backward),
    )  # fmt: skip


def swiglu_lora(
    gate: Tensor,
    up: Tensor,
    xa: Tensor,
    b_gate: Tensor,
    b_up: Tensor,
    scale_gate: float,
    scale_up: float,
    *,
    inplace_backward: bool = False,
) -> Tensor:
    """``silu(gate + s_g xa_g B_g^T) * (up + s_u xa_u B_u^T)`` (see the module notes).

    Args:
        gate, up: ``[..., I]`` base products, one floating dtype.
        xa: ``[rows, r_g + r_u]``, ``x A_g^T`` then ``x A_u^T``; read as a constant (detached).
        b_gate, b_up: ``[I, r_g]`` and ``[I, r_u]``, in xa's dtype; read as constants (detached).
        scale_gate, scale_up: the adapters' scales.
        inplace_backward: the backward writes gate's and up's gradients into their memory (gate and
            up read by nothing else afterwards).

    Returns:
        Contiguous ``[..., I]`` in gate's dtype; its backward gives gate and up their gradients.

    Raises:
        ValueError: on shapes, dtypes or devices that do not fit together.
    """
    return _apply(
        _swiglu_lora, "swiglu_lora", gate, up, xa, b_gate, b_up, scale_gate, scale_up, inplace_backward
    )


def geglu_lora(
    gate: Tensor,
    up: Tensor,
    xa: Tensor,
    b_gate: Tensor,
    b_up: Tensor,
    scale_gate: float,
    scale_up: float,
    *,
    inplace_backward: bool = False,
) -> Tensor:
    """:func:`swiglu_lora` with ``gelu_tanh`` (Gemma's gated MLP activation)."""
    return _apply(
        _geglu_lora, "geglu_lora", gate, up, xa, b_gate, b_up, scale_gate, scale_up, inplace_backward
    )
