"""LoRA over a frozen FP8 base as one op: ``sloth::lora_linear_fp8`` (the base stored in e4m3,
:class:`~lightning_sloth.quant.fp8.LinearFP8`); the same products over a base stored in 4 bits
(QLoRA with ``base_dtype="fp8"``) are :mod:`lightning_sloth.ops.fp8_qlora`'s, built on this module's
pieces.

``y = x W^T + s (x A^T) B^T`` with the adapter's ``B`` product added into the FP8 GEMM's output, and
``dx = dy W + (s dy B) A`` with the adapter's part added into the FP8 input-gradient GEMM's output:
no separate ``[M, out]`` or ``[M, in]`` sums. The base products are :mod:`lightning_sloth.ops.fp8`'s
(``_scaled_mm`` where it applies, else the plain-torch emulation); ``x A^T`` is kept for ``dB``.

Around them, as the 16-bit and 4-bit LoRA paths have: :class:`UnreadSumFP8` (a checkpoint's
recompute skips the down projection's quantisation and product, whose values nothing reads) and
:class:`SharedInputLoraFP8` (layers that read one input, q/k/v and gate/up, as one node that
quantises it once).

``overwrite_input=True`` (the MLP's down projection, whose input nothing reads afterwards): the
backward (``sloth::lora_linear_fp8_backward_``) writes x's gradient into x's memory, the FP8
input-gradient GEMM's output landing there directly (``_scaled_mm(..., out=)``), as the 16-bit and
4-bit ops do: one ``[tokens, in]`` buffer fewer at the backward's peak.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_sloth.ops.fp8 import (
    E4M3,
    check_fp8_operands,
    fp8_grad_product,
    fp8_product,
    quantize_activation,
    scaled_mm,
    scaled_mm_applies,
)
from lightning_sloth.ops.fp8_formats import check_grad_format, dequantize_rows, quantize_rows
from lightning_sloth.ops.lora_layers import adapter_in, plain_parts
from lightning_sloth.ops.registry import call, register_autograd, register_flops, sloth_op

__all__ = ["UnreadSumFP8", "lora_linear_fp8", "plain_fp8", "shared_input_fp8", "shared_input_fp8_bases"]


class UnreadSumFP8(torch.autograd.Function):
    """``residual + y`` of a LoRA layer over an FP8 (or 4-bit storage, FP8 compute) base when
    nothing reads the sum's values, only its gradients (a checkpointed layer's recompute): the
    forward keeps what the backward reads (x and ``xa = x A^T``) and skips the base product, its
    quantisation (and a 4-bit weight's decode), returning uninitialised memory; the backward is the
    op's (the same products, the same values), with the sum's gradient passed to ``residual`` too.
    As ``ops.lora.UnreadSum`` and ``ops.nf4.UnreadSum4bit`` for 16-bit and 4-bit bases.

    ``forward(ctx, residual, x, lora_a, lora_b, scale, grad_format, backward_ops, constants, *storage)``:
    ``backward_ops`` the op's ``(backward, in-place backward or None)`` (None: x is not overwritten;
    :func:`_lora_backward_op` and :func:`_lora_backward_inplace_op`, or the 4-bit ones), ``storage``
    the base's tensors and ``constants`` its other arguments, in the backward ops' order.
    """

    @staticmethod
    def forward(ctx, residual, x, lora_a, lora_b, scale, grad_format, backward_ops, constants, *storage):
        rows = x.reshape(-1, x.shape[-1])
        xa = rows @ lora_a.t()
        ctx.save_for_backward(rows, xa, lora_a, lora_b, *storage)
        ctx.scale, ctx.grad_format, ctx.ops, ctx.constants, ctx.x_shape = (
            scale, grad_format, backward_ops, constants, x.shape,
        )  # fmt: skip
        # The sum's dtype, as ``residual + y`` promotes (a float32 residual stream under autocast).
        return residual.new_empty(residual.shape, dtype=torch.promote_types(residual.dtype, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        rows, xa, lora_a, lora_b, *storage = ctx.saved_tensors
        need = ctx.needs_input_grad
        if any(need[8:]):
            raise RuntimeError("lightning_sloth: the FP8 / 4-bit base weight is frozen; it has no gradient")
        grad_y = (grad if grad.dtype == rows.dtype else grad.to(rows.dtype)).reshape(-1, lora_b.shape[0])
        args = (
            grad_y.contiguous(),
            rows,
            xa,
            *storage,
            *ctx.constants,
            lora_a,
            lora_b,
            ctx.scale,
            ctx.grad_format,
        )
        dx, da, db = input_grads(ctx.ops, args, need[1], need[2], need[3])
        # x's gradient in x's shape (overwritten: where x was, rows being x's memory or its copy)
        dx = dx.view(ctx.x_shape) if dx is not None else None
        return grad if need[0] else None, dx, da, db, None, None, None, None, *([None] * len(storage))


def check_unread(residual: Tensor, x: Tensor, out_features: int) -> None:
    if residual.shape != (*x.shape[:-1], out_features) or not residual.is_floating_point():
        raise ValueError(
            f"unread_sum_with must be a floating [..., out] residual of shape {(*x.shape[:-1], out_features)}, "
            f"got {residual.dtype} {tuple(residual.shape)}"
        )


def lora_outputs(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float, base) -> tuple[Tensor, Tensor]:
    """``(y, xa)``: ``y = base() + scale (x A^T) B^T`` with the B product added into ``base()``'s
    output (``base``: the FP8 product ``x W^T``, called only where x has rows)."""
    xa = x @ lora_a.t()
    y = base() if x.shape[0] else x.new_zeros(0, lora_b.shape[0])
    if lora_a.shape[0]:
        y.addmm_(xa, lora_b.t(), alpha=scale)
    return y, xa


def lora_grads(grad_y, x, xa, lora_a, lora_b, scale: float, needed: tuple[bool, bool, bool], base_dx):
    """``(dx, dA, dB)``, empty where not ``needed``: ``dx = base_dx() + (scale dy B) A`` with the
    adapter's part added into the FP8 input-gradient product's output (``base_dx``: ``dy W``, called
    only where x's gradient is asked for and there are rows, after ``dA`` has read x: it may write
    into x, :func:`lora_grads_into`)."""
    grad_x, grad_a, grad_b = needed
    g = (grad_y @ lora_b) * scale if (grad_x or grad_a) else None
    da = g.t() @ x if grad_a else x.new_empty(0)
    db = grad_y.t() @ (xa * scale) if grad_b else x.new_empty(0)
    dx = x.new_empty(0)
    if grad_x:
        dx = base_dx() if grad_y.shape[0] else x.new_zeros(0, x.shape[1])
        if lora_a.shape[0]:
            dx.addmm_(g, lora_a)
    return dx, da, db


def lora_grads_into(grad_y, x, xa, lora_a, lora_b, scale: float, grad_a: bool, grad_b: bool, base_dx_into):
    """``(dA, dB)`` (empty where not asked for) with x's gradient written into x's memory:
    :func:`lora_grads`' products, ``base_dx_into(out)`` writing ``dy W`` into ``out`` (x itself where
    x is contiguous, else None, and the product is copied in)."""
    out = x if x.is_contiguous() else None
    dx, da, db = lora_grads(
        grad_y, x, xa, lora_a, lora_b, scale, (True, grad_a, grad_b), lambda: base_dx_into(out)
    )
    if dx is not x:
        x.copy_(dx)
    return da, db


def input_grads(ops: tuple, args: tuple, need_x: bool, need_a: bool, need_b: bool):
    """``(dx, dA, dB)``, None where not needed, from a backward op's ``args`` (``grad_y, x, ...``
    without the three needs): ``ops`` = ``(backward op, in-place backward op or None)``; the in-place
    one (x's gradient written into x, returned as dx) where given and x's gradient is asked for."""
    op, inplace_op = ops
    if inplace_op is not None and need_x:
        da, db = call(inplace_op, *args, need_a, need_b)
        dx = args[1]
    else:
        dx, da, db = call(op, *args, need_x, need_a, need_b)
    return (dx if need_x else None), (da if need_a else None), (db if need_b else None)


def grads_fake(x, lora_a, lora_b, grad_x: bool, grad_a: bool, grad_b: bool):
    return (
        torch.empty_like(x) if grad_x else x.new_empty(0),
        torch.empty_like(lora_a) if grad_a else x.new_empty(0),
        torch.empty_like(lora_b) if grad_b else x.new_empty(0),
    )


# ------------------------------------------------------------------ LoRA over an FP8 base, one op
@sloth_op("lora_linear_fp8")
def _lora_op(
    x: Tensor,
    weight_bits: Tensor,
    weight_scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    overwrite_input: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(y, xa)`` for ``x [M, K]``: ``y = x W^T + scale (x A^T) B^T`` with the B product added
    into the FP8 GEMM's output; ``xa = x A^T`` is kept for the backward. ``overwrite_input``: the
    backward writes x's gradient into x."""
    return lora_outputs(
        x, lora_a, lora_b, scale, lambda: fp8_product(x, weight_bits.view(E4M3), weight_scale)
    )


@_lora_op.register_fake
def _lora_fake(x, weight_bits, weight_scale, lora_a, lora_b, scale, grad_format, overwrite_input=False):
    return x.new_empty((x.shape[0], weight_bits.shape[0])), x.new_empty((x.shape[0], lora_a.shape[0]))


@sloth_op("lora_linear_fp8_backward")
def _lora_backward_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    weight_bits: Tensor,
    weight_scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    grad_x: bool,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dA, dB)`` (empty where not asked for): ``dx = dy W + (scale dy B) A``, the adapter's
    part added into the FP8 input-gradient GEMM's output (no separate sum of two ``[M, K]``)."""
    return lora_grads(
        grad_y, x, xa, lora_a, lora_b, scale, (grad_x, grad_a, grad_b),
        lambda: fp8_grad_product(grad_y, weight_bits.view(E4M3), weight_scale, grad_format),
    )  # fmt: skip


@_lora_backward_op.register_fake
def _lora_backward_fake(
    grad_y, x, xa, weight_bits, weight_scale, lora_a, lora_b, scale, grad_format, grad_x, grad_a, grad_b
):
    return grads_fake(x, lora_a, lora_b, grad_x, grad_a, grad_b)


@sloth_op("lora_linear_fp8_backward_", mutates_args=("x",))
def _lora_backward_inplace_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    weight_bits: Tensor,
    weight_scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`_lora_backward_op` writing ``dx`` into x (after ``dA`` has read it): the same products
    in the same order, the FP8 GEMM's output landing in x. Returns ``(dA, dB)``."""
    return lora_grads_into(
        grad_y, x, xa, lora_a, lora_b, scale, grad_a, grad_b,
        lambda out: fp8_grad_product(grad_y, weight_bits.view(E4M3), weight_scale, grad_format, out),
    )  # fmt: skip


@_lora_backward_inplace_op.register_fake
def _lora_backward_inplace_fake(
    grad_y, x, xa, weight_bits, weight_scale, lora_a, lora_b, scale, grad_format, grad_a, grad_b
):
    return grads_fake(x, lora_a, lora_b, False, grad_a, grad_b)[1:]


def _lora_setup(ctx, inputs, output):
    x, weight_bits, weight_scale, lora_a, lora_b, scale, grad_format = inputs[:7]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], weight_bits, weight_scale, lora_a, lora_b)
    ctx.scale, ctx.grad_format = scale, grad_format
    ctx.overwrite_input = len(inputs) > 7 and bool(inputs[7])


def _lora_backward(ctx, grad_y, _grad_xa):
    need = ctx.needs_input_grad
    if need[1] or need[2]:
        raise RuntimeError("sloth::lora_linear_fp8: the FP8 base weight is frozen; it has no gradient")
    x, xa, weight_bits, weight_scale, lora_a, lora_b = ctx.saved_tensors
    args = (grad_y.contiguous(), x, xa, weight_bits, weight_scale, lora_a, lora_b, ctx.scale, ctx.grad_format)
    ops = (_lora_backward_op, _lora_backward_inplace_op if ctx.overwrite_input else None)
    dx, da, db = input_grads(ops, args, need[0], need[3], need[4])
    return dx, None, None, da, db, None, None, None


register_autograd(_lora_op, _lora_backward, _lora_setup)


def lora_forward_flops(x, w, s, a, b, scale, fmt, overwrite_input=False, out_shape=None) -> int:
    m, k = x
    n, r = b
    return 2 * m * k * (n + r) + 2 * m * r * n


def lora_backward_flops(dy, x, xa, w, s, a, b, scale, fmt, gx, ga, gb, out_shape=None) -> int:
    m, n = dy
    k, r = x[1], a[0]
    flops = 2 * m * n * r if (gx or ga) else 0  # g = dy B
    flops += (2 * m * n * k + 2 * m * r * k) if gx else 0  # dy W + g A
    flops += 2 * r * m * k if ga else 0
    return flops + (2 * n * m * r if gb else 0)


register_flops(_lora_op, lora_forward_flops)
register_flops(_lora_backward_op, lora_backward_flops)
register_flops(
    _lora_backward_inplace_op,
    lambda dy, x, xa, w, s, a, b, scale, fmt, ga, gb, out_shape=None: lora_backward_flops(
        dy, x, xa, w, s, a, b, scale, fmt, True, ga, gb
    ),
)


def lora_linear_fp8(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str = "e4m3",
    unread_sum_with: Tensor | None = None,
    overwrite_input: bool = False,
) -> Tensor:
    """``x W^T + scale (x A^T) B^T`` for the frozen FP8 ``W`` and trained LoRA factors, as one op.

    The same products as :func:`linear_fp8` plus PEFT's LoRA, with the adapter's parts added into
    the FP8 GEMMs' outputs (forward and input gradient) instead of summed in separate passes.

    Args:
        x: ``[..., in]`` float16/bfloat16/float32.
        weight, weight_scale: W's ``[out, in]`` ``float8_e4m3fn`` codes and ``[out, 1]`` float32 scales.
        lora_a, lora_b: ``[r, in]`` and ``[out, r]`` in x's dtype.
        scale: the adapter's scaling.
        grad_format: ``"e4m3"``, ``"e5m2"`` or ``"bf16"`` (:func:`linear_fp8`).
        unread_sum_with: a residual ``[..., out]``: returns ``residual + y`` for a backward only, its
            values never computed (:class:`UnreadSumFP8`: no quantisation, no base product).
        overwrite_input: the backward writes x's gradient into x's memory (an x nothing reads
            afterwards: saves one ``[..., in]`` buffer).

    Returns:
        ``[..., out]`` in x's dtype; gradients flow to x, A and B.
    """
    check_fp8_operands(x, weight, weight_scale, "lora_linear_fp8")
    out_features, in_features = weight.shape
    if (
        x.shape[-1] != in_features
        or tuple(lora_a.shape[1:]) != (in_features,)
        or lora_b.shape
        != (
            out_features,
            lora_a.shape[0],
        )
    ):
        raise ValueError(
            f"lora_linear_fp8: x {tuple(x.shape)}, A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do "
            f"not fit the weight {tuple(weight.shape)} [out, in]"
        )
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise TypeError(
            f"lora_linear_fp8: A ({lora_a.dtype}) and B ({lora_b.dtype}) must be in x's dtype ({x.dtype})"
        )
    if unread_sum_with is not None:
        check_unread(unread_sum_with, x, out_features)
        bits = (weight.view(torch.uint8), weight_scale)
        fmt = check_grad_format(grad_format)
        ops = (_lora_backward_op, _lora_backward_inplace_op if overwrite_input else None)
        return UnreadSumFP8.apply(unread_sum_with, x, lora_a, lora_b, float(scale), fmt, ops, (), *bits)
    rows = x.reshape(-1, in_features)
    y, _ = call(
        _lora_op, rows, weight.view(torch.uint8), weight_scale, lora_a, lora_b, float(scale),
        check_grad_format(grad_format), bool(overwrite_input),
    )  # fmt: skip
    return y.view(*x.shape[:-1], out_features)


# ------------------------------------------------------------------ layers that read one input, FP8 bases
def plain_fp8(base: nn.Module) -> bool:
    """Whether ``base`` is an FP8 base layer (``quant.fp8.LinearFP8``: its class marks its own forward
    as ``fp8_module_forward``) running that forward, without hooks or bias, so an op may compute its
    product instead of the module."""
    cls_forward = getattr(type(base), "fp8_module_forward", None)
    return (
        cls_forward is not None
        and type(base).forward is cls_forward
        and "forward" not in vars(base)
        and not (base._forward_hooks or base._forward_pre_hooks)
    )


class SharedInputLoraFP8(torch.autograd.Function):
    """LoRA layers over FP8 bases that read one input x (q/k/v, gate/up) as one node: x quantised
    once for all their FP8 products (instead of once per layer), read once for all ``dA_i`` (one
    product with the stacked A's), and ``dx = sum_i dy_i W_i + (sum_i s_i dy_i B_i) A`` with the
    adapters' part in one product. The outputs are the separate layers' bit for bit (each base
    product is :func:`_lora_op`'s, each ``x A_i^T`` its own product); the gradients are theirs up to
    the order of the sums.

    ``forward(ctx, x, scales, grad_format, bases_only, *tensors)``: ``tensors`` the layers' codes
    (uint8), their scales, then the A's and the B's. ``bases_only``: the outputs are the base
    products alone, followed by ``xa = [x A_1^T, ...]`` (no gradient), for a consumer that adds the
    low-rank parts itself (``ops.glu_lora``); the gradients the node receives are still those of the
    full outputs, and the backward is the same.
    """

    @staticmethod
    def forward(ctx, x, scales, grad_format, bases_only, *tensors):
        n = len(scales)
        bits, w_scales, adapters_a, adapters_b = (tensors[i * n : (i + 1) * n] for i in range(4))
        rows = x.reshape(-1, x.shape[-1])
        # Each x A_i^T on its own (not one product with the stacked A's): the outputs then equal the
        # separate layers' bit for bit, as FP8's rounding of what follows needs (a last-bit change in
        # an output can move the next layer's e4m3 codes by a whole step).
        xa = torch.cat([rows @ a.t() for a in adapters_a], dim=1)
        weights = [b.view(E4M3) for b in bits]
        # x quantised once: for the FP8 GEMMs where they run, else for the emulation (which then
        # computes exactly what fp8_linear_reference does per layer).
        fp8_gemm = rows.shape[0] and all(scaled_mm_applies(rows, w.shape[0]) for w in weights)
        if fp8_gemm:
            qx, sx = quantize_activation(rows, "e4m3")
        elif rows.shape[0]:
            x_dq = dequantize_rows(*quantize_rows(rows, "e4m3"))
        outputs, start = [], 0
        for w, w_scale, a, b, scale in zip(weights, w_scales, adapters_a, adapters_b, scales):
            if rows.shape[0] == 0:
                y = rows.new_zeros(0, w.shape[0])
            elif fp8_gemm:
                y = scaled_mm(qx, w.t(), sx, w_scale.t(), rows.dtype)
            else:
                y = (x_dq @ dequantize_rows(w, w_scale).t()).to(rows.dtype)
            r = a.shape[0]
            if r and not bases_only:
                y.addmm_(xa[:, start : start + r], b.t(), alpha=scale)
            start += r
            outputs.append(y.view(*x.shape[:-1], w.shape[0]))
        ctx.save_for_backward(rows, xa, *tensors)
        ctx.x_shape, ctx.scales, ctx.grad_format = x.shape, scales, grad_format
        ctx.set_materialize_grads(False)
        if bases_only:
            ctx.mark_non_differentiable(xa)
            return (*outputs, xa)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        rows, xa, *tensors = ctx.saved_tensors
        n = len(ctx.scales)
        bits, w_scales, adapters_a, adapters_b = (tensors[i * n : (i + 1) * n] for i in range(4))
        needs = ctx.needs_input_grad
        if any(needs[4 : 4 + 2 * n]):
            raise RuntimeError("sloth: the FP8 base weights are frozen; they have no gradient")
        grads = grads[:n]  # with bases_only, xa's (None) last
        need_x = needs[0]
        d_a: list[Tensor | None] = [None] * n
        d_b: list[Tensor | None] = [None] * n
        dx = None
        gs, a_rows, offsets, start = [], [], [], 0
        for i, (w_bits, w_scale, a, b, scale) in enumerate(
            zip(bits, w_scales, adapters_a, adapters_b, ctx.scales)
        ):
            r = a.shape[0]
            part = xa[:, start : start + r]
            start += r
            if grads[i] is None:
                continue
            dy = grads[i].reshape(-1, grads[i].shape[-1]).to(rows.dtype).contiguous()
            if needs[4 + 3 * n + i]:
                d_b[i] = dy.t() @ (part * scale)
            if need_x or needs[4 + 2 * n + i]:
                gs.append((dy @ b) * scale)
                a_rows.append(a)
                offsets.append(i)
            if need_x:
                if dy.shape[0]:
                    base = fp8_grad_product(dy, w_bits.view(E4M3), w_scale, ctx.grad_format)
                else:
                    base = rows.new_zeros(0, rows.shape[1])
                dx = base if dx is None else dx.add_(base)
        if gs:
            g_all = torch.cat(gs, dim=1) if len(gs) > 1 else gs[0]
            a_all = torch.cat(a_rows) if len(a_rows) > 1 else a_rows[0]
            if any(needs[4 + 2 * n + i] for i in offsets):
                d_a_all = g_all.t() @ rows
                for i, piece in zip(offsets, d_a_all.split([adapters_a[i].shape[0] for i in offsets])):
                    if needs[4 + 2 * n + i]:
                        d_a[i] = piece
            if need_x and g_all.shape[1]:
                dx.addmm_(g_all, a_all)
        dx = dx.view(ctx.x_shape) if dx is not None and need_x else None
        return (dx, None, None, None, *([None] * (2 * n)), *d_a, *d_b)


def _shared_input_args(modules: Sequence[nn.Module], x: Tensor) -> tuple | None:
    """``(x, scales, grad_format, tensors)`` for :class:`SharedInputLoraFP8` over ``modules``; None
    unless every layer is in the plain case (see :func:`shared_input_fp8`)."""
    resolved = []
    for module in modules:
        parts = plain_parts(module)
        if parts is None or not plain_fp8(parts[1]):
            return None
        adapter, base, lora_a, lora_b = parts
        scale = (
            module.__dict__["scaling"][adapter] if "scaling" in module.__dict__ else module.scaling[adapter]
        )
        resolved.append((base, lora_a._parameters["weight"], lora_b._parameters["weight"], float(scale)))
    if len({base.grad_format for base, *_ in resolved}) != 1 or resolved[0][0].weight.device != x.device:
        return None
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    x_c = x if x.dtype == dtype else x.to(dtype)
    bits = [base.weight for base, *_ in resolved]
    w_scales = [base.weight_scale.view(torch.float32) for base, *_ in resolved]
    adapters_a = [adapter_in(a, dtype) for _, a, _, _ in resolved]
    adapters_b = [adapter_in(b, dtype) for _, _, b, _ in resolved]
    scales = tuple(scale for *_, scale in resolved)
    fmt = check_grad_format(resolved[0][0].grad_format)
    return x_c, scales, fmt, (*bits, *w_scales, *adapters_a, *adapters_b)


def shared_input_fp8(modules: Sequence[nn.Module], x: Tensor) -> tuple[Tensor, ...] | None:
    """The outputs of PEFT LoRA layers over FP8 bases that read ``x``, computed as one
    :class:`SharedInputLoraFP8` node; None unless every layer is in the plain case (one adapter, no
    dropout or bias, :func:`plain_fp8` base) with one input-gradient format and x on their device."""
    args = _shared_input_args(modules, x)
    if args is None:
        return None
    x_c, scales, fmt, tensors = args
    return SharedInputLoraFP8.apply(x_c, scales, fmt, False, *tensors)


def shared_input_fp8_bases(gate: nn.Module, up: nn.Module, x: Tensor) -> tuple | None:
    """Gate and up over FP8 bases as one :class:`SharedInputLoraFP8` node that leaves the low-rank
    parts to the activation (``bases_only``): ``(gate_base, up_base, xa, B_gate, B_up, s_gate,
    s_up)`` for :func:`~lightning_sloth.ops.glu_lora.swiglu_lora`, or None where
    :func:`shared_input_fp8` would not apply."""
    args = _shared_input_args((gate, up), x)
    if args is None:
        return None
    x_c, scales, fmt, tensors = args
    gate_base, up_base, xa = SharedInputLoraFP8.apply(x_c, scales, fmt, True, *tensors)
    return gate_base, up_base, xa, tensors[-2], tensors[-1], *scales
