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

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn

from lightning_sloth.ops._registry import call, register_autograd, register_flops, sloth_op

__all__ = ["adapter_casts", "fused_lora_forward", "lora_linear"]


@sloth_op("lora_linear")
def _lora_linear_op(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float, overwrite_input: bool = False
) -> tuple[Tensor, Tensor]:
    """Returns ``(y [..., out], xa [N, r])``; ``xa`` is kept for the backward."""
    rows = x.reshape(-1, x.shape[-1])
    xa = rows @ lora_a.t()
    y = (rows @ weight.t()).addmm_(xa, lora_b.t(), alpha=scale)  # in place: no second [N, out] buffer
    return y.view(*x.shape[:-1], weight.shape[0]), xa


@_lora_linear_op.register_fake
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
    g, alpha, da, db = _adapter_grads(dy, rows, xa, lora_a, lora_b, scale, grad_x or grad_a, grad_a, grad_b)
    dx = (dy @ weight).addmm_(g, lora_a, alpha=alpha).view(x.shape) if grad_x else x.new_empty(0)
    return dx, da, db


def _adapter_grads(dy, rows, xa, lora_a, lora_b, scale, need_g, grad_a, grad_b):
    """``(g, alpha, dA, dB)`` of both backward ops; ``dx`` adds ``alpha * g @ A`` (``g`` is None
    unless ``need_g``). A power-of-two scale is the products' alpha: no ``[N, r]`` multiplies, the
    values of scaling the operands first; any other scale scales the operands."""
    if _exact_alpha(scale):
        g = dy @ lora_b if need_g else None
        da = _scaled_mm(g.t(), rows, scale, lora_a) if grad_a else rows.new_empty(0)
        db = _scaled_mm(dy.t(), xa, scale, lora_b) if grad_b else rows.new_empty(0)
        return g, scale, da, db
    g = (dy @ lora_b) * scale if need_g else None
    da = g.t() @ rows if grad_a else rows.new_empty(0)  # one empty each: outputs may not alias
    db = dy.t() @ (xa * scale) if grad_b else rows.new_empty(0)
    return g, 1.0, da, db


def _exact_alpha(scale: float) -> bool:
    """Whether multiplying by ``scale`` is exact in floating point (a power of two, 1 included), so
    that applying it as a product's alpha gives the values of scaling an operand first."""
    mantissa, _ = math.frexp(scale)
    return mantissa == 0.5


def _scaled_mm(a: Tensor, b: Tensor, scale: float, like: Tensor) -> Tensor:
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
    g, alpha, da, db = _adapter_grads(dy, rows, xa, lora_a, lora_b, scale, True, grad_a, grad_b)
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


register_autograd(_lora_linear_op, _backward, _setup_context)


class _UnreadSum(torch.autograd.Function):
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


register_flops(_lora_linear_op, _forward_flops)
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
    y, _ = call(_lora_linear_op, x, weight, lora_a, lora_b, float(scale), overwrite_input)
    return y


def _plain_weight(tensor: Tensor) -> bool:
    # Quantized or distributed weights (Params4bit, DTensor, ...) take PEFT's own path.
    return type(tensor) in (Tensor, nn.Parameter) and tensor.is_floating_point()


def _plain_parts(module: nn.Module) -> tuple[str, nn.Linear, nn.Module, nn.Module] | None:
    """``(adapter, base, lora_A, lora_B)`` of a ``lora.Linear`` in the plain case, else None (the
    checks :func:`fused_lora_forward` documents).

    PEFT's state is read from the layer's own dicts: its properties and ``nn.Module.__getattr__``
    cost more host time per call than a small layer's products.
    """
    if not isinstance(module, LoraLinear):
        return None
    d = module.__dict__
    adapter = d.get("_active_adapter", LoraLinear._active_adapter)
    if not isinstance(adapter, str):
        if len(adapter) != 1:
            return None
        adapter = adapter[0]
    if d.get("_disable_adapters", False) or d.get("merged_adapters") or d.get("fan_in_fan_out", False):
        return None
    if d.get("use_dora", {}).get(adapter, False) or adapter in d.get("lora_variant", {}):
        return None
    modules = d["_modules"]
    lora_a = modules["lora_A"]._modules.get(adapter)
    lora_b = modules["lora_B"]._modules.get(adapter)
    if lora_a is None or lora_b is None:
        return None
    if not isinstance(modules["lora_dropout"]._modules.get(adapter), nn.Identity):
        return None
    base = modules["base_layer"]
    while "base_layer" in base._modules:  # a tuner layer around another (PEFT's get_base_layer)
        base = base._modules["base_layer"]
    if not isinstance(base, nn.Linear) or any(
        m._parameters.get("bias") is not None for m in (base, lora_a, lora_b)
    ):
        return None
    return adapter, base, lora_a, lora_b


def fused_lora_forward(
    module: nn.Module, x: Tensor, *, overwrite_input: bool = False, unread_sum_with: Tensor | None = None
) -> Tensor | None:
    """Forward of a PEFT ``peft.tuners.lora.Linear`` through :func:`lora_linear`, or None to fall back.

    Handles the plain case only: one active adapter, unmerged and enabled, on an ``nn.Linear`` base
    without bias, with a frozen unquantized weight, no dropout (``lora_dropout`` is ``Identity``), no
    DoRA or other LoRA variant and no LoRA bias. Anything else returns None, and the caller runs the
    module's own forward. Every call checks the layer's state afresh.

    The product runs in the base layer's compute dtype: the autocast dtype under autocast (as
    ``nn.Linear`` would), else the base weight's dtype (which x must have). Adapters stored in another
    dtype (e.g. float32) are cast to it; their gradients flow back through the cast.

    Args:
        module: A ``peft.tuners.lora.Linear``.
        x: ``[..., in]`` input.
        overwrite_input: Passed to :func:`lora_linear` (x read by nothing else afterwards).
        unread_sum_with: a residual ``[..., out]`` in the compute dtype: returns ``residual +
            module(x)`` for a backward only, its values never computed (:class:`_UnreadSum`: the
            base product is skipped). For a checkpoint's recompute, whose output nothing reads.

    Returns:
        ``[..., out]`` output, or None if the module is not in the plain case.
    """
    parts = _plain_parts(module)
    if parts is None:
        return None
    resolved = _compute_parts(module, parts, x)
    if resolved is None:
        return None
    dtype, weight, a, b, scale = resolved
    residual = unread_sum_with
    if residual is not None and (
        residual.shape != (*x.shape[:-1], weight.shape[0]) or not residual.is_floating_point()
    ):
        return None
    # What lora_linear checks holds here (one dtype after the casts, frozen base); casts only when needed.
    casts = getattr(_CASTS, "copies", None)
    tensors = [t if t.dtype == dtype else _cast(t, dtype, casts) for t in (x, weight, a, b)]
    if residual is not None:
        return _UnreadSum.apply(residual, *tensors, float(scale), overwrite_input)
    y, _ = call(_lora_linear_op, *tensors, float(scale), overwrite_input)
    return y


def _compute_parts(module: nn.Module, parts: tuple, x: Tensor):
    """``(dtype, W, A, B, scale)`` of a plain-case layer for input x (the compute dtype: autocast's,
    else the weight's, which x must have), or None where the fused op does not apply."""
    adapter, base, lora_a, lora_b = parts
    weight = base._parameters.get("weight")
    if weight is None or not _plain_weight(weight) or weight.requires_grad:
        return None
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif x.dtype == weight.dtype:
        dtype = weight.dtype
    else:
        return None
    a, b = lora_a._parameters["weight"], lora_b._parameters["weight"]
    if x.device != weight.device or a.device != weight.device or b.device != weight.device:
        raise ValueError(
            f"x, the base weight, lora_A and lora_B of this LoRA layer must be on one device, got "
            f"{x.device}, {weight.device}, {a.device}, {b.device}"
        )
    scale = module.__dict__["scaling"][adapter] if "scaling" in module.__dict__ else module.scaling[adapter]
    return dtype, weight, a, b, scale


# ------------------------------------------------------------------ LoRA layers sharing an input
WIDE_ROWS_PER_INPUT = 4
""":class:`_SharedInputLora` folds the adapters' ``B`` products into the base products (one
``[x | x A^T] [W | s B]^T`` per layer instead of ``x W^T`` then ``+= s (x A^T) B^T``) when x has at
least this many rows per input feature: the extended weights cost a copy of ``W`` (``[out, in]``)
per pass, the second product a read and a write of the output (``[rows, out]``)."""

WIDE_OUTPUTS_PER_INPUT = 2
"""... and the group's outputs together have at least this many features per input feature: the
wide rows cost a copy of x (``[rows, in]``), which the saved passes over the outputs must outweigh
(gate/up of a Llama-3.2-1B shape: 8 per input; its q/k/v: 1.5, which stay as they are)."""


def _wide_products(rows: Tensor, weights: Sequence[Tensor], scales: Sequence[float]) -> bool:
    """Whether :class:`_SharedInputLora` computes ``[x | x A^T] [W | s B]^T``: many rows and
    outputs per input feature (:data:`WIDE_ROWS_PER_INPUT`, :data:`WIDE_OUTPUTS_PER_INPUT`), and
    every scale a power of two, so that ``s B`` is exact and the products' values are those of
    ``alpha = s`` in the epilogue."""
    inputs = rows.shape[1]
    return (
        rows.shape[0] >= WIDE_ROWS_PER_INPUT * inputs
        and sum(w.shape[0] for w in weights) >= WIDE_OUTPUTS_PER_INPUT * inputs
        and all(_exact_alpha(s) for s in scales)
    )


def _extended_weight(weight: Tensor, lora_b: Tensor, scale: float, start: int, total: int) -> Tensor:
    """``[W | 0 .. s B .. 0]`` (``[out, in + total]``): ``s B`` in columns ``in + start ..`` of the
    adapters' ``total`` columns, the other layers' columns zero."""
    out_features, inputs = weight.shape
    extended = weight.new_empty(out_features, inputs + total)
    extended[:, :inputs].copy_(weight)
    tail = extended[:, inputs:]
    if lora_b.shape[1] < total:
        tail.zero_()
    torch.mul(lora_b, scale, out=tail[:, start : start + lora_b.shape[1]])
    return extended


class _SharedInputLora(torch.autograd.Function):
    """LoRA layers that read one input x (q/k/v, gate/up) as one node:
    ``y_i = x W_i^T + s_i (x A_i^T) B_i^T``.

    The forward reads x once for all ``x A_i^T`` (one product with the stacked A's); the backward
    reads it once for all ``dA_i`` and accumulates ``dx = sum_i dy_i W_i + sum_i s_i (dy_i B_i) A_i``
    in the products' epilogues (``addmm_``) instead of adding separate ``[N, in]`` gradients. The
    per-layer products are those of :func:`lora_linear`; ``dx`` is summed in the products'
    float32 accumulators rather than rounded per layer first.

    Where the group is large (:func:`_wide_products`: gate/up of a 1B shape on a 16k-token row),
    the forward folds each ``B`` product into its base product: ``y_i = [x | x A^T] [W_i | s_i B_i]^T``
    (one product with ``in + sum r`` inputs, ``B_i`` in its own columns, zeros in the others')
    instead of ``x W_i^T`` followed by ``+= s_i (x A^T) B_i^T``, which reads and writes the whole
    ``[N, out]`` output a second time. The sum is rounded once instead of twice. The wide rows
    replace x among the saved tensors (x is a view of them): only ``x A^T``'s few columns are kept
    twice.
    """

    @staticmethod
    def forward(ctx, x, scales, *tensors):
        n = len(scales)
        weights, adapters_a, adapters_b = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        rows = x.reshape(-1, x.shape[-1])
        xa = rows @ torch.cat(adapters_a).t()  # [N, sum r]
        # [x | x A^T] once, then y_i = [x | x A^T] [W_i | s_i B_i]^T: one product per layer.
        wide = torch.cat([rows, xa], dim=1) if _wide_products(rows, weights, scales) else None
        outputs, start = [], 0
        for w, a, b, scale in zip(weights, adapters_a, adapters_b, scales):
            r = a.shape[0]
            if wide is not None:
                y = wide @ _extended_weight(w, b, scale, start, xa.shape[1]).t()
            else:
                y = (rows @ w.t()).addmm_(xa[:, start : start + r], b.t(), alpha=scale)
            start += r
            outputs.append(y.view(*x.shape[:-1], w.shape[0]))
        # Folded, x is kept as a view of the wide rows (not a second copy); x A^T is kept apart,
        # contiguous, for the backward's dB products, which read its narrow columns.
        ctx.save_for_backward(rows if wide is None else wide, xa, *tensors)
        ctx.x_shape = x.shape
        ctx.scales = scales
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        rows, xa, *tensors = ctx.saved_tensors
        rows = rows[:, : ctx.x_shape[-1]]  # folded: x's columns of [x | x A^T], read in place
        scales = ctx.scales
        n = len(scales)
        weights, adapters_a, adapters_b = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        needs = ctx.needs_input_grad
        need_x = needs[0]
        d_a: list[Tensor | None] = [None] * n
        d_b: list[Tensor | None] = [None] * n
        dx = None
        # One power-of-two scale for all (PEFT's usual case): applied as the products' alpha.
        uniform = all(_exact_alpha(scale) and scale == scales[0] for scale in scales)
        gs, a_rows, offsets, start = [], [], [], 0
        for i, (w, a, b, scale) in enumerate(zip(weights, adapters_a, adapters_b, scales)):
            r = a.shape[0]
            part = xa[:, start : start + r]
            start += r
            if grads[i] is None:
                continue
            dy = grads[i].reshape(-1, grads[i].shape[-1])
            if needs[2 + 2 * n + i]:
                d_b[i] = (
                    _scaled_mm(dy.t(), part, scale, b) if _exact_alpha(scale) else dy.t() @ (part * scale)
                )
            if need_x or needs[2 + n + i]:
                g = dy @ b
                gs.append(g if uniform else g * scale)
                a_rows.append(a)
                offsets.append(i)
            if need_x:
                dx = dy @ w if dx is None else dx.addmm_(dy, w)
        if gs:
            alpha = scales[0] if uniform else 1.0
            g_all = torch.cat(gs, dim=1) if len(gs) > 1 else gs[0]
            a_all = torch.cat(a_rows) if len(a_rows) > 1 else a_rows[0]
            if any(needs[2 + n + i] for i in offsets):
                d_a_all = _scaled_mm(g_all.t(), rows, alpha, a_all)
                for i, part in zip(offsets, d_a_all.split([adapters_a[i].shape[0] for i in offsets])):
                    if needs[2 + n + i]:
                        d_a[i] = part
            if need_x:
                dx.addmm_(g_all, a_all, alpha=alpha)
        return (dx.view(ctx.x_shape) if dx is not None else None, None, *([None] * n), *d_a, *d_b)


_GROUPS = threading.local()  # .members: id(LoRA layer) -> its _Group while a block runs


class _Group:
    """LoRA layers that read one input in a block: the first to run computes all their outputs
    (:class:`_SharedInputLora`) and keeps the others' for their own calls with the same x."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.pending: dict[int, Tensor] = {}
        self.source: tuple[Tensor, int] | None = None

    def output(self, module: nn.Module, x: Tensor) -> Tensor | None:
        if self.source is not None and self.source[0] is x and self.source[1] == x._version:
            out = self.pending.pop(id(module), None)
            if not self.pending:
                self.source = None
            if out is not None:
                return out
        self.pending, self.source = {}, None
        resolved = []
        for m in self.modules:
            parts = _plain_parts(m)
            found = None if parts is None else _compute_parts(m, parts, x)
            if found is None:
                return None
            resolved.append(found)
        dtype = resolved[0][0]
        if any(r[0] != dtype for r in resolved) or module not in self.modules:
            return None
        casts = getattr(_CASTS, "copies", None)
        x_c = x if x.dtype == dtype else x.to(dtype)
        weights = [w if w.dtype == dtype else _cast(w, dtype, casts) for _, w, _, _, _ in resolved]
        adapters_a = [a if a.dtype == dtype else _cast(a, dtype, casts) for _, _, a, _, _ in resolved]
        adapters_b = [b if b.dtype == dtype else _cast(b, dtype, casts) for _, _, _, b, _ in resolved]
        scales = tuple(float(r[4]) for r in resolved)
        outputs = _SharedInputLora.apply(x_c, scales, *weights, *adapters_a, *adapters_b)
        self.pending = {id(m): y for m, y in zip(self.modules, outputs) if m is not module}
        self.source = (x, x._version)
        return outputs[self.modules.index(module)]


def shared_input_groups(layer: nn.Module) -> list[list[nn.Module]]:
    """The LoRA layers of a decoder layer that read one input: ``q_proj, k_proj, v_proj`` of each
    attention and ``gate_proj, up_proj`` of each gated MLP, where all are PEFT LoRA layers."""
    groups = []
    for module in layer.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(m, LoraLinear) for m in members):
                groups.append(members)
    return groups


@contextlib.contextmanager
def grouped_projections(groups: Sequence[Sequence[nn.Module]]) -> Iterator[None]:
    """Within the block, the fused LoRA layers of each group (:func:`shared_input_groups`) compute
    as one :class:`_SharedInputLora` node when called with one input (see
    :func:`group_output`)."""
    previous = getattr(_GROUPS, "members", None)
    members = dict(previous or {})
    for group in groups:
        shared = _Group(group)
        members.update({id(m): shared for m in group})
    _GROUPS.members = members
    try:
        yield
    finally:
        _GROUPS.members = previous


def group_output(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module(x)`` through its group (inside :func:`grouped_projections`), or None."""
    members = getattr(_GROUPS, "members", None)
    group = members.get(id(module)) if members else None
    return None if group is None else group.output(module, x)


# ----------------------------------------------------------------------- adapter casts, grouped
_CASTS = threading.local()  # .copies: id(adapter weight) -> its copy in the compute dtype


def _cast(tensor: Tensor, dtype: torch.dtype, copies: dict[int, Tensor] | None) -> Tensor:
    copy = copies.get(id(tensor)) if copies else None
    return copy if copy is not None and copy.dtype == dtype else tensor.to(dtype)


class _CastAdapters(torch.autograd.Function):
    """Copies of several weights in one dtype from one ``_foreach_copy_`` (one launch, not one per
    weight); the backward casts their gradients back the same way. The copies are views of one
    buffer. Casts are exact roundings either way, so the values equal per-weight ``.to`` casts."""

    @staticmethod
    def forward(ctx, dtype, *weights):
        ctx.set_materialize_grads(False)  # copies no layer used get no zero gradients
        ctx.dtype = weights[0].dtype
        return tuple(_foreach_cast(list(weights), dtype))

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        out: list[Tensor | None] = [None] * len(grads)
        if present:
            cast = _foreach_cast([grads[i] for i in present], ctx.dtype)
            for i, g in zip(present, cast):
                out[i] = g
        return (None, *out)


def _foreach_cast(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    sizes = [t.numel() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device)
    views = [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors)]
    torch._foreach_copy_(views, tensors)  # other strides than the views': its per-tensor path
    return views


def _layer_adapters(modules: Sequence[nn.Module]) -> list[Tensor]:
    """The A and B weights of the plain-case LoRA layers among ``modules`` (see :func:`_plain_parts`)."""
    weights = []
    for module in modules:
        parts = _plain_parts(module)
        if parts is not None:
            weights += [parts[2]._parameters["weight"], parts[3]._parameters["weight"]]
    return weights


@contextlib.contextmanager
def adapter_casts(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, the fused LoRA layers among ``modules`` take their A and B weights in the
    compute dtype from one grouped cast made on entry, instead of two casts each per call.

    Under autocast with adapters stored in another dtype (float32 adapters, bf16 autocast), a
    decoder layer's seven LoRA layers cast fourteen small weights per forward, and the backward
    casts fourteen gradients back: 28 launches and autograd nodes per layer and pass, where a
    host-bound step pays for each. Here that is one ``_foreach_copy_`` each way (values unchanged).
    Nothing is cached across blocks: each entry casts the weights as they are then.

    Args:
        modules: The LoRA layers a block runs (e.g. one decoder layer's ``lora.Linear`` s).
    """
    weights = _layer_adapters(modules)
    device = weights[0].device if weights else None
    if device is None or not torch.is_autocast_enabled(device.type):
        yield
        return
    dtype = torch.get_autocast_dtype(device.type)
    weights = [
        w for w in weights if w.dtype != dtype and w.device == device and type(w) in (Tensor, nn.Parameter)
    ]
    if len(weights) < 2 or len({w.dtype for w in weights}) > 1:
        yield
        return
    with torch.autocast(device.type, enabled=False):
        copies = _CastAdapters.apply(dtype, *weights)
    previous = getattr(_CASTS, "copies", None)
    _CASTS.copies = {id(w): c for w, c in zip(weights, copies)}
    try:
        yield
    finally:
        _CASTS.copies = previous
