"""QLoRA with FP8 compute as one op: ``sloth::lora_linear_4bit_fp8``, LoRA over a frozen base stored
in 4 bits (NF4/FP4, :class:`~lightning_sloth.quant.linear.Linear4bit` or bitsandbytes' storage)
whose products run on FP8 tensor cores: each call decodes the weight and quantises it per row to
e4m3 inside the op (:func:`~lightning_sloth.ops.fp8.fp8_from_4bit`), then computes
:mod:`lightning_sloth.ops.fp8_lora`'s products with the adapter's parts added into the FP8 GEMMs'
outputs. The weight stays in 4 bits; nothing dense is saved for the backward.

``overwrite_input=True``: the backward (``sloth::lora_linear_4bit_fp8_backward_``) writes x's
gradient into x's memory, as ``sloth::lora_linear_fp8_backward_`` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sloth.ops.fp8 import fp8_from_4bit, fp8_grad_product_4bit, fp8_product
from lightning_sloth.ops.fp8_formats import check_grad_format
from lightning_sloth.ops.fp8_lora import (
    UnreadSumFP8,
    check_unread,
    grads_fake,
    input_grads,
    lora_backward_flops,
    lora_forward_flops,
    lora_grads,
    lora_grads_into,
    lora_outputs,
)
from lightning_sloth.ops.nf4 import _check_storage
from lightning_sloth.ops.registry import call, register_autograd, register_flops, sloth_op

__all__ = ["lora_linear_4bit_fp8"]


@sloth_op("lora_linear_4bit_fp8")
def _lora_4bit_op(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    overwrite_input: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(y, xa)``: ``sloth::lora_linear_fp8``'s products for a 4-bit ``W [out, in]`` (``out`` from
    ``lora_b``), decoded and quantised to e4m3 inside the op as ``sloth::linear_4bit_fp8`` does.
    ``overwrite_input``: the backward writes x's gradient into x."""
    shape = (lora_b.shape[0], x.shape[1])
    return lora_outputs(
        x,
        lora_a,
        lora_b,
        scale,
        lambda: fp8_product(x, *fp8_from_4bit(packed, absmax, code, blocksize, shape)),
    )


@_lora_4bit_op.register_fake
def _lora_4bit_fake(
    x, packed, absmax, code, blocksize, lora_a, lora_b, scale, grad_format, overwrite_input=False
):
    return x.new_empty((x.shape[0], lora_b.shape[0])), x.new_empty((x.shape[0], lora_a.shape[0]))


@sloth_op("lora_linear_4bit_fp8_backward")
def _lora_4bit_backward_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    grad_x: bool,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dA, dB)`` of :func:`_lora_4bit_op` (empty where not asked for), the weight decoded again."""
    return lora_grads(
        grad_y, x, xa, lora_a, lora_b, scale, (grad_x, grad_a, grad_b),
        lambda: fp8_grad_product_4bit(grad_y, packed, absmax, code, blocksize, x.shape[1], grad_format),
    )  # fmt: skip


@_lora_4bit_backward_op.register_fake
def _lora_4bit_backward_fake(
    grad_y, x, xa, packed, absmax, code, blocksize, lora_a, lora_b, scale, grad_format, grad_x, grad_a, grad_b
):
    return grads_fake(x, lora_a, lora_b, grad_x, grad_a, grad_b)


@sloth_op("lora_linear_4bit_fp8_backward_", mutates_args=("x",))
def _lora_4bit_backward_inplace_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`_lora_4bit_backward_op` writing ``dx`` into x (after ``dA`` has read it): the same
    products in the same order. Returns ``(dA, dB)``."""
    return lora_grads_into(
        grad_y, x, xa, lora_a, lora_b, scale, grad_a, grad_b,
        lambda out: fp8_grad_product_4bit(grad_y, packed, absmax, code, blocksize, x.shape[1], grad_format, out),
    )  # fmt: skip


@_lora_4bit_backward_inplace_op.register_fake
def _lora_4bit_backward_inplace_fake(
    grad_y, x, xa, packed, absmax, code, blocksize, lora_a, lora_b, scale, grad_format, grad_a, grad_b
):
    return grads_fake(x, lora_a, lora_b, False, grad_a, grad_b)[1:]


def _lora_4bit_setup(ctx, inputs, output):
    x, packed, absmax, code, blocksize, lora_a, lora_b, scale, grad_format = inputs[:9]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], packed, absmax, code, lora_a, lora_b)
    ctx.blocksize, ctx.scale, ctx.grad_format = blocksize, scale, grad_format
    ctx.overwrite_input = len(inputs) > 9 and bool(inputs[9])


def _lora_4bit_backward(ctx, grad_y, _grad_xa):
    need = ctx.needs_input_grad
    if any(need[1:4]):
        raise RuntimeError("sloth::lora_linear_4bit_fp8: the 4-bit base weight is frozen; it has no gradient")
    x, xa, packed, absmax, code, lora_a, lora_b = ctx.saved_tensors
    args = (
        grad_y.contiguous(),
        x,
        xa,
        packed,
        absmax,
        code,
        ctx.blocksize,
        lora_a,
        lora_b,
        ctx.scale,
        ctx.grad_format,
    )
    ops = (_lora_4bit_backward_op, _lora_4bit_backward_inplace_op if ctx.overwrite_input else None)
    dx, da, db = input_grads(ops, args, need[0], need[5], need[6])
    return dx, None, None, None, None, da, db, None, None, None


def _lora_4bit_forward_flops(
    x, p, a_max, c, blocksize, a, b, scale, fmt, overwrite=False, out_shape=None
) -> int:
    return lora_forward_flops(x, (b[0], x[1]), None, a, b, scale, fmt) + x[1] * b[0]  # + the decode


def _lora_4bit_backward_flops(
    dy, x, xa, p, a_max, c, blocksize, a, b, scale, fmt, gx, ga, gb, out_shape=None
) -> int:
    w = (dy[1], x[1])
    return lora_backward_flops(dy, x, xa, w, None, a, b, scale, fmt, gx, ga, gb) + (w[0] * w[1] if gx else 0)


register_autograd(_lora_4bit_op, _lora_4bit_backward, _lora_4bit_setup)
register_flops(_lora_4bit_op, _lora_4bit_forward_flops)
register_flops(_lora_4bit_backward_op, _lora_4bit_backward_flops)
register_flops(
    _lora_4bit_backward_inplace_op,
    lambda dy, x, xa, p, a_max, c, blocksize, a, b, scale, fmt, ga, gb, out_shape=None: (
        _lora_4bit_backward_flops(dy, x, xa, p, a_max, c, blocksize, a, b, scale, fmt, True, ga, gb)
    ),
)


def lora_linear_4bit_fp8(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str = "e4m3",
    unread_sum_with: Tensor | None = None,
    overwrite_input: bool = False,
) -> Tensor:
    """QLoRA with FP8 compute as one op: ``x W^T + scale (x A^T) B^T`` for a frozen 4-bit ``W``
    (``[out, in]``, ``out = lora_b.shape[0]``) computed as ``sloth::linear_4bit_fp8`` computes it,
    the adapter's parts added into the FP8 products' outputs (as
    :func:`~lightning_sloth.ops.fp8_lora.lora_linear_fp8`). The weight stays in 4 bits; nothing dense
    is saved for the backward. ``unread_sum_with`` and ``overwrite_input``: as ``lora_linear_fp8``'s
    (no decode either for an unread sum).

    Returns:
        ``[..., out]`` in x's dtype; gradients flow to x, A and B.
    """
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"lora_linear_4bit_fp8 computes in float16/bfloat16/float32, got {x.dtype}")
    out_features, in_features = lora_b.shape[0], x.shape[-1]
    if tuple(lora_a.shape[1:]) != (in_features,) or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(
            f"lora_linear_4bit_fp8: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit x {tuple(x.shape)}"
        )
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise TypeError(
            f"lora_linear_4bit_fp8: A ({lora_a.dtype}) and B ({lora_b.dtype}) must be in x's dtype ({x.dtype})"
        )
    _check_storage(packed, absmax, code, blocksize, out_features * in_features)
    fmt = check_grad_format(grad_format)
    if unread_sum_with is not None:
        check_unread(unread_sum_with, x, out_features)
        ops = (_lora_4bit_backward_op, _lora_4bit_backward_inplace_op if overwrite_input else None)
        storage = (packed, absmax, code)
        return UnreadSumFP8.apply(
            unread_sum_with, x, lora_a, lora_b, float(scale), fmt, ops, (int(blocksize),), *storage
        )
    rows = x.reshape(-1, in_features)
    y, _ = call(
        _lora_4bit_op, rows, packed, absmax, code, int(blocksize), lora_a, lora_b, float(scale), fmt,
        bool(overwrite_input),
    )  # fmt: skip
    return y.view(*x.shape[:-1], out_features)
