"""LoRA linear layer as one op with a hand-written backward: ``y = x W^T + scale (x A^T) B^T``.

The base weight ``W [out, in]`` is frozen; the adapters ``A [r, in]`` and ``B [out, r]`` train. All
the work is matrix products, which cuBLAS already does at full speed, so there is no Triton kernel:
the gain over PEFT's module path is in what is *not* launched. PEFT runs three linears plus a scaling
multiply and a residual add over ``[N, out]`` in the forward, and in the backward a scaling multiply
over ``[N, out]`` and a gradient add over ``[N, in]``. Here the scale is folded into the small
``[N, r]`` operands and the additions into ``addmm``'s epilogue::

    forward   xa = x A^T                               [N, r]    (saved; r is small)
              y  = x W^T;  y += scale * xa B^T         [N, out]  (one [N, out] buffer)
    backward  g  = scale * (dy B)                      [N, r]
              dA = g^T x                               [r, in]
              dB = dy^T (scale * xa)                   [out, r]
              dx = dy W;  dx += g A                    [N, in]   (one [N, in] buffer)

Saved for the backward: ``x`` and ``xa`` (PEFT saves the same two), plus the weights.

With ``overwrite_input=True`` the backward (``sloth::lora_linear_backward_``) writes ``dx`` into x's
memory once ``dA`` is taken, instead of a new ``[N, in]`` buffer. That is only correct when nothing
else reads x afterwards: the gated MLP's ``down_proj``, whose input is the activation's fresh output,
is the case the patched MLP forwards use it for.
"""

import math

import torch
from torch import Tensor

from lightning_sloth.ops.registry import call, register_autograd, register_flops, sloth_op

__all__ = ["lora_linear"]


@sloth_op("lora_linear")
def lora_linear_op(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float, overwrite_input: bool = False
) -> tuple[Tensor, Tensor]:
    """Returns ``(y [..., out], xa [N, r])``; ``xa`` is kept for the backward."""
    rows = x.reshape(-1, x.shape[-1])
    xa = rows @ lora_a.t()
    y = (rows @ weight.t()).addmm_(xa, lora_b.t(), alpha=scale)  # in place: no second [N, out] buffer
    return y.view(*x.shape[:-1], weight.shape[0]), xa


@lora_linear_op.register_fake
def _lora_linear_fake(x, weight, lora_a, lora_b, scale, overwrite_input=False):
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return y, x.new_empty((math.prod(x.shape[:-1]), lora_a.shape[0]))


@sloth_op("lora_linear_backward")
def _lora_linear_backward_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_x: bool,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dx, dA, dB)``; gradients not asked for are empty tensors."""
    dy = grad_y.reshape(-1, grad_y.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    g, alpha, da, db = adapter_grads(dy, rows, xa, lora_a, lora_b, scale, grad_x or grad_a, grad_a, grad_b)
    dx = (dy @ weight).addmm_(g, lora_a, alpha=alpha).view(x.shape) if grad_x else x.new_empty(0)
    return dx, da, db


def adapter_grads(dy, rows, xa, lora_a, lora_b, scale, need_g, grad_a, grad_b):
    """``(g, alpha, dA, dB)`` of both backward ops; ``dx`` adds ``alpha * g @ A`` (``g`` is None
    unless ``need_g``). A power-of-two scale is the products' alpha: no ``[N, r]`` multiplies, the
    values of scaling the operands first; any other scale scales the operands."""
    if exact_alpha(scale):
        g = dy @ lora_b if need_g else None
        da = scaled_mm(g.t(), rows, scale, lora_a) if grad_a else rows.new_empty(0)
        db = scaled_mm(dy.t(), xa, scale, lora_b) if grad_b else rows.new_empty(0)
        return g, scale, da, db
    g = (dy @ lora_b) * scale if need_g else None
    da = g.t() @ rows if grad_a else rows.new_empty(0)  # one empty each: outputs may not alias
    db = dy.t() @ (xa * scale) if grad_b else rows.new_empty(0)
    return g, 1.0, da, db


def exact_alpha(scale: float) -> bool:
    """Whether multiplying by ``scale`` is exact in floating point (a power of two, 1 included), so
    that applying it as a product's alpha gives the values of scaling an operand first."""
    mantissa, _ = math.frexp(scale)
    return mantissa == 0.5


def scaled_mm(a: Tensor, b: Tensor, scale: float, like: Tensor) -> Tensor:
    """``scale * (a @ b)`` as one product (``like``: any tensor of the result's shape; with
    ``beta=0`` its values are ignored)."""
    if scale == 1.0:
        return a @ b
    return torch.addmm(like, a, b, beta=0, alpha=scale)


@sloth_op("lora_linear_backward_", mutates_args=("x",))
def _lora_linear_backward_inplace_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor]:
    """Writes ``dx`` into x (after ``dA`` has read it); returns ``(dA, dB)``, empty where not asked for."""
    dy = grad_y.reshape(-1, grad_y.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    g, alpha, da, db = adapter_grads(dy, rows, xa, lora_a, lora_b, scale, True, grad_a, grad_b)
    if x.is_contiguous():  # rows is then a view of x
        torch.mm(dy, weight, out=rows).addmm_(g, lora_a, alpha=alpha)
    else:  # x cannot be viewed as contiguous rows: compute apart, then copy in
        x.copy_((dy @ weight).addmm_(g, lora_a, alpha=alpha).view(x.shape))
    return da, db


@_lora_linear_backward_inplace_op.register_fake
def _lora_linear_backward_inplace_fake(grad_y, x, xa, weight, lora_a, lora_b, scale, grad_a, grad_b):
    return (
        torch.empty_like(lora_a) if grad_a else x.new_empty(0),
        torch.empty_like(lora_b) if grad_b else x.new_empty(0),
    )


@_lora_linear_backward_op.register_fake
def _lora_linear_backward_fake(grad_y, x, xa, weight, lora_a, lora_b, scale, grad_x, grad_a, grad_b):
    return (
        x.new_empty(x.shape) if grad_x else x.new_empty(0),
        torch.empty_like(lora_a) if grad_a else x.new_empty(0),
        torch.empty_like(lora_b) if grad_b else x.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, weight, lora_a, lora_b, scale = inputs[:5]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], weight, lora_a, lora_b)
    ctx.scale = scale
    ctx.overwrite_input = len(inputs) > 5 and bool(inputs[5])


def _backward(ctx, grad_y, _grad_xa):
    dx, da, db = _input_grads(ctx, grad_y, ctx.needs_input_grad[:4])
    return dx, None, da, db, None, None


def _input_grads(ctx, grad_y, needs) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dA, dB)`` (None where not needed) from ``ctx.saved_tensors`` = ``(x, xa, W, A, B)``,
    ``ctx.scale`` and ``ctx.overwrite_input``; ``needs``: the needs of ``(x, W, A, B)``."""
    x, xa, weight, lora_a, lora_b = ctx.saved_tensors
    need_x, need_w, need_a, need_b = needs
    if need_w:
        raise RuntimeError("sloth::lora_linear treats the base weight as frozen; it has no gradient for it")
    if ctx.overwrite_input and need_x:
        da, db = call(
            _lora_linear_backward_inplace_op, grad_y, x, xa, weight, lora_a, lora_b, ctx.scale, need_a, need_b
        )
        dx = x
    else:
        dx, da, db = call(
            _lora_linear_backward_op, grad_y, x, xa, weight, lora_a, lora_b, ctx.scale, need_x, need_a, need_b
        )
    return dx if need_x else None, da if need_a else None, db if need_b else None


register_autograd(lora_linear_op, _backward, _setup_context)


class UnreadSum(torch.autograd.Function):
    """``residual + lora_linear(x, W, A, B, scale)`` when nothing reads the sum's values: only its
    gradients are wanted (a checkpointed layer's recompute, whose output only carries the backward).

    The forward keeps what the backward reads (x and ``xa = x A^T``) and skips the base product and
    the add: it returns uninitialised memory. The backward is :func:`lora_linear`'s (same ops, same
    values), with the sum's gradient passed to ``residual`` as well.
    """

    @staticmethod
    def forward(ctx, residual, x, weight, lora_a, lora_b, scale, overwrite_input):
        xa = x.reshape(-1, x.shape[-1]) @ lora_a.t()
        ctx.save_for_backward(x, xa, weight, lora_a, lora_b)
        ctx.scale, ctx.overwrite_input = scale, overwrite_input
        # The sum's dtype, as ``residual + y`` promotes (a float32 residual stream under autocast).
        return residual.new_empty(residual.shape, dtype=torch.promote_types(residual.dtype, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        # y's gradient in y's dtype, as autograd casts the promoted add's gradient for it.
        grad_y = grad if grad.dtype == ctx.saved_tensors[0].dtype else grad.to(ctx.saved_tensors[0].dtype)
        dx, da, db = _input_grads(ctx, grad_y, ctx.needs_input_grad[1:5])
        return grad if ctx.needs_input_grad[0] else None, dx, None, da, db, None, None


def _forward_flops(
    x_shape, weight_shape, a_shape, b_shape, scale, overwrite_input=False, out_shape=None
) -> int:
    n_rows = math.prod(x_shape[:-1])
    out_features, in_features = weight_shape
    rank = a_shape[0]
    return 2 * n_rows * (in_features * out_features + in_features * rank + rank * out_features)


def _backward_flops(
    grad_y_shape,
    x_shape,
    xa_shape,
    weight_shape,
    a_shape,
    b_shape,
    scale,
    grad_x,
    grad_a,
    grad_b,
    out_shape=None,
) -> int:
    n_rows = xa_shape[0]
    out_features, in_features = weight_shape
    rank = a_shape[0]
    flops = 0
    if grad_x or grad_a:
        flops += 2 * n_rows * out_features * rank  # dy @ B
    if grad_x:
        flops += 2 * n_rows * (out_features * in_features + rank * in_features)
    if grad_a:
        flops += 2 * n_rows * rank * in_features
    if grad_b:
        flops += 2 * n_rows * out_features * rank
    return flops


register_flops(lora_linear_op, _forward_flops)
register_flops(_lora_linear_backward_op, _backward_flops)
register_flops(
    _lora_linear_backward_inplace_op,
    lambda grad_y, x, xa, weight, a, b, scale, grad_a, grad_b, out_shape=None: _backward_flops(
        grad_y, x, xa, weight, a, b, scale, True, grad_a, grad_b
    ),
)


def lora_linear(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float, *, overwrite_input: bool = False
) -> Tensor:
    """LoRA linear layer ``x @ weight.T + scale * (x @ lora_a.T) @ lora_b.T`` (no bias, no dropout).

    Args:
        x: ``[..., in]`` float16/bfloat16/float32 input (e.g. ``[B, T, in]``).
        weight: ``[out, in]`` frozen base weight (must not require grad); same dtype as x.
        lora_a: ``[r, in]`` adapter A; same dtype as x.
        lora_b: ``[out, r]`` adapter B; same dtype as x.
        scale: LoRA scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA).
        overwrite_input: The backward writes x's gradient into x's memory (saves one ``[..., in]``
            buffer). Only when nothing else reads x after this layer.

    Returns:
        ``[..., out]`` output in x's dtype. Gradients flow to x, lora_a and lora_b.
    """
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have shape [..., in], got a 0-d tensor")
    if weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError("weight, lora_a and lora_b must be 2-D")
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    if x.shape[-1] != in_features or lora_a.shape[1] != in_features or lora_b.shape != (out_features, rank):
        raise ValueError(
            f"shapes do not fit a LoRA layer: x {tuple(x.shape)}, weight {tuple(weight.shape)} [out, in], "
            f"lora_a {tuple(lora_a.shape)} [r, in], lora_b {tuple(lora_b.shape)} [out, r]"
        )
    dtypes = {t.dtype for t in (x, weight, lora_a, lora_b)}
    if len(dtypes) > 1:
        raise TypeError(
            f"x, weight, lora_a and lora_b must share a dtype, got {x.dtype}, {weight.dtype}, "
            f"{lora_a.dtype}, {lora_b.dtype}"
        )
    devices = {t.device for t in (x, weight, lora_a, lora_b)}
    if len(devices) > 1:
        raise ValueError(f"x, weight, lora_a and lora_b must be on one device, got {devices}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("lora_linear keeps the base weight frozen: weight must not require grad")
    y, _ = call(lora_linear_op, x, weight, lora_a, lora_b, float(scale), overwrite_input)
    return y
