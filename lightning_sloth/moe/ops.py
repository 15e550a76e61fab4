"""Token movement and activations of the experts as ``sloth::`` ops: gather, combine, activations.

One layer call, with ``S = T * k`` routed rows sorted by expert (see :mod:`.routing`; the GEMMs are
in :mod:`.gemm`)::

    x_g = moe_gather(x, perm, inv, k)                  [S, H]   token rows in expert order
    h   = grouped GEMM (+ LoRA)                        [S, 2I]
    a   = moe_weighted_swiglu(h, w, perm)              [S, I]   silu(gate) up w_s (bias-free families)
        | moe_clamped_swiglu(h)                                 GPT-OSS (weights applied in the combine)
    y   = grouped GEMM (+ LoRA)                        [S, H]
    out = moe_gather_sum(y, perm, inv, k)              [T, H]   sum of each token's k rows, fp32
        | moe_combine(y, w, perm, inv)                          sum_j w[t, j] y[inv[t k + j]], fp32

Backward of each is its own op: the gather's is a gather-sum through ``inv`` (each token sums its
``k`` rows in a fixed order, no atomics), the sum's a gather through ``perm``; the combine's gives
the rows' gradient (a gather through ``perm`` scaled by the routing weight) and the routing
weights' gradient (a dot product per slot); the weighted SwiGLU's gives the routing weights'
gradient ``<grad_s, act_s>`` from h, which it keeps anyway. Either way the router trains.

CUDA float16/bfloat16/float32 tensors run the Triton kernels of ``lightning_sloth.kernels.moe``;
anything else the plain-torch references here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sloth.ops.registry import (
    TRITON_OPS,
    call,
    register_autograd,
    register_flops,
    sloth_op,
    use_triton,
)

if TRITON_OPS:
    from lightning_sloth.kernels import moe as _kernels

__all__ = [
    "clamped_swiglu",
    "clamped_swiglu_reference",
    "moe_combine",
    "moe_gather",
    "moe_sum",
    "weighted_swiglu",
]


# ------------------------------------------------------------------------------------ references
def clamped_swiglu_reference(h: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's activation, transformers' expression: interleaved ``h [S, 2I]`` -> ``[S, I]``."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).contiguous()


def _clamped_swiglu_backward_reference(dout: Tensor, h: Tensor, alpha: float, limit: float) -> Tensor:
    compute = torch.promote_types(h.dtype, torch.float32)
    gate_in, up_in, dy = h[..., ::2].to(compute), h[..., 1::2].to(compute), dout.to(compute)
    gate, up = gate_in.clamp(max=limit), up_in.clamp(-limit, limit)
    s = torch.sigmoid(gate * alpha)
    glu = gate * s
    d_gate = torch.where(gate_in <= limit, dy * (up + 1) * (s + glu * alpha * (1 - s)), 0.0)
    d_up = torch.where((up_in >= -limit) & (up_in <= limit), dy * glu, 0.0)
    return torch.stack((d_gate, d_up), dim=-1).flatten(-2).to(h.dtype)


# ----------------------------------------------------------------------------- gather / combine
def _rows(src: Tensor, idx: Tensor, div: int, scale: Tensor | None) -> Tensor:
    if use_triton(src):
        return _kernels.gather_rows(src, idx, div, scale)
    out = src.index_select(0, idx // div if div != 1 else idx)
    if scale is None:
        return out
    return (out.to(torch.promote_types(out.dtype, torch.float32)) * scale[idx, None]).to(src.dtype)


def _combine_weight_grad(grad: Tensor, y: Tensor, inv: Tensor, top_k: int) -> Tensor:
    """``[T, k]``: ``<grad[t], y[inv[t k + j]]>`` in fp32 (the routing weights' gradient)."""
    if use_triton(grad):
        return _kernels.combine_weight_grad(grad, y, inv, top_k)
    compute = torch.promote_types(y.dtype, torch.float32)
    rows = y.index_select(0, inv).to(compute).view(-1, top_k, y.shape[1])
    return (rows * grad.to(compute)[:, None, :]).sum(-1)


def _gather_sum(src: Tensor, inv: Tensor, top_k: int, weights: Tensor | None) -> Tensor:
    if use_triton(src):
        return _kernels.gather_sum(src, inv, top_k, weights)
    compute = torch.promote_types(src.dtype, torch.float32)
    rows = src.index_select(0, inv).to(compute).view(-1, top_k, src.shape[1])
    if weights is not None:
        rows = rows * weights.to(compute).view(-1, top_k, 1)
    return rows.sum(dim=1).to(src.dtype)


@sloth_op("moe_gather")
def _gather_op(x: Tensor, perm: Tensor, inv: Tensor, top_k: int) -> Tensor:
    """``[S, H]``: row s is token ``perm[s] // top_k``."""
    return _rows(x, perm, top_k, None)


@_gather_op.register_fake
def _gather_fake(x, perm, inv, top_k):
    return x.new_empty((perm.shape[0], x.shape[1]))


@sloth_op("moe_gather_sum")
def _gather_sum_op(src: Tensor, perm: Tensor, inv: Tensor, top_k: int) -> Tensor:
    """``[T, H]``: token t sums rows ``inv[t k : t k + k]`` in fp32 (the gather's backward, and the
    combine of rows already scaled by their routing weights)."""
    return _gather_sum(src, inv, top_k, None)


@_gather_sum_op.register_fake
def _gather_sum_fake(src, perm, inv, top_k):
    return src.new_empty((inv.shape[0] // top_k, src.shape[1]))


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.top_k = inputs[3]


def _gather_backward(ctx, grad):
    perm, inv = ctx.saved_tensors
    return call(_gather_sum_op, grad.contiguous(), perm, inv, ctx.top_k), None, None, None


def _gather_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.top_k = inputs[3]


def _gather_sum_backward(ctx, grad):
    perm, inv = ctx.saved_tensors
    return call(_gather_op, grad.contiguous(), perm, inv, ctx.top_k), None, None, None


register_autograd(_gather_op, _gather_backward, _gather_setup)
register_autograd(_gather_sum_op, _gather_sum_backward, _gather_sum_setup)
register_flops(_gather_op, lambda x, perm, inv, top_k, out_shape=None: 0)
register_flops(_gather_sum_op, lambda src, perm, inv, top_k, out_shape=None: math.prod(src))


@sloth_op("moe_combine")
def _combine_op(y: Tensor, weights: Tensor, perm: Tensor, inv: Tensor) -> Tensor:
    """``[T, H]``: ``out[t] = sum_j weights[t, j] * y[inv[t k + j]]`` in fp32, in y's dtype."""
    return _gather_sum(y, inv, weights.shape[1], weights)


@_combine_op.register_fake
def _combine_fake(y, weights, perm, inv):
    return y.new_empty((weights.shape[0], y.shape[1]))


@sloth_op("moe_combine_backward")
def _combine_backward_op(
    grad: Tensor, y: Tensor, weights: Tensor, perm: Tensor, inv: Tensor, need_y: bool, need_w: bool
) -> tuple[Tensor, Tensor]:
    """``(dy [S, H], dweights [T, k])``; a gradient not asked for is an empty tensor."""
    top_k = weights.shape[1]
    flat = weights.reshape(-1)
    dy = _rows(grad, perm, top_k, flat) if need_y else grad.new_empty(0)
    if not need_w:
        return dy, grad.new_empty(0)
    return dy, _combine_weight_grad(grad, y, inv, top_k).to(weights.dtype)


@_combine_backward_op.register_fake
def _combine_backward_fake(grad, y, weights, perm, inv, need_y, need_w):
    dy = y.new_empty(y.shape) if need_y else grad.new_empty(0)
    return dy, (weights.new_empty(weights.shape) if need_w else grad.new_empty(0))


def _combine_setup(ctx, inputs, output):
    y, weights, perm, inv = inputs
    ctx.save_for_backward(y if weights.requires_grad else None, weights, perm, inv)


def _combine_backward(ctx, grad):
    y, weights, perm, inv = ctx.saved_tensors
    need_y, need_w = ctx.needs_input_grad[:2]
    dy, dw = call(
        _combine_backward_op,
        grad.contiguous(),
        y if y is not None else grad.new_empty(0),
        weights,
        perm,
        inv,
        need_y,
        need_w,
    )
    return (dy if need_y else None), (dw if need_w else None), None, None


register_autograd(_combine_op, _combine_backward, _combine_setup)
register_flops(_combine_op, lambda y, weights, perm, inv, out_shape=None: 2 * math.prod(y))
register_flops(
    _combine_backward_op,
    lambda grad, y, weights, perm, inv, need_y, need_w, out_shape=None: 2 * math.prod(y) * (need_y + need_w),
)


def moe_gather(x: Tensor, perm: Tensor, inv: Tensor, top_k: int) -> Tensor:
    """Token rows in expert order: ``[S, H]`` with row s = ``x[perm[s] // top_k]``.

    Args:
        x: ``[T, H]`` tokens.
        perm: int64 ``[S = T k]`` sorted position -> slot ``t k + j``.
        inv: int64 ``[S]`` slot -> sorted position (the inverse of perm).
        top_k: experts per token.
    """
    return call(_gather_op, x, perm, inv, int(top_k))


def moe_sum(y: Tensor, perm: Tensor, inv: Tensor, top_k: int) -> Tensor:
    """Sum of each token's ``k`` rows (already scaled by their routing weights), in fp32.

    Args:
        y: ``[S, H]`` rows in expert order.
        perm: int64 ``[S]`` sorted position -> slot.
        inv: int64 ``[S]`` slot -> sorted position.
        top_k: experts per token.

    Returns:
        ``[T, H]`` in y's dtype.
    """
    return call(_gather_sum_op, y, perm, inv, int(top_k))


def moe_combine(y: Tensor, weights: Tensor, perm: Tensor, inv: Tensor) -> Tensor:
    """Weighted sum of each token's ``k`` expert rows, in fp32, with gradients to y and the weights.

    Args:
        y: ``[S, H]`` expert outputs in expert order.
        weights: ``[T, k]`` routing weights (float32 or y's dtype); their gradient reaches the router.
        perm: int64 ``[S]`` sorted position -> slot.
        inv: int64 ``[S]`` slot -> sorted position.

    Returns:
        ``[T, H]`` in y's dtype.
    """
    return call(_combine_op, y, weights, perm, inv)


# --------------------------------------------------------------------------- GPT-OSS activation
@sloth_op("moe_clamped_swiglu")
def _clamped_swiglu_op(h: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS: interleaved ``[S, 2I]`` -> ``(clamp(up, +-limit) + 1) * g sigmoid(alpha g)``, g = min(gate, limit)."""
    if use_triton(h):
        return _kernels.clamped_swiglu_forward(h, alpha, limit)
    return clamped_swiglu_reference(h, alpha, limit)


@_clamped_swiglu_op.register_fake
def _clamped_swiglu_fake(h, alpha, limit):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@sloth_op("moe_clamped_swiglu_backward")
def _clamped_swiglu_backward_op(grad: Tensor, h: Tensor, alpha: float, limit: float) -> Tensor:
    """``dh [S, 2I]`` (interleaved, like h)."""
    if use_triton(h):
        return _kernels.clamped_swiglu_backward(grad, h, alpha, limit)
    return _clamped_swiglu_backward_reference(grad, h, alpha, limit)


@_clamped_swiglu_backward_op.register_fake
def _clamped_swiglu_backward_fake(grad, h, alpha, limit):
    return h.new_empty(h.shape)


def _clamped_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.alpha, ctx.limit = inputs[1], inputs[2]


register_autograd(
    _clamped_swiglu_op,
    lambda ctx, grad: (
        call(_clamped_swiglu_backward_op, grad.contiguous(), ctx.saved_tensors[0], ctx.alpha, ctx.limit),
        None,
        None,
    ),
    _clamped_setup,
)
register_flops(_clamped_swiglu_op, lambda h, alpha, limit, out_shape=None: 4 * math.prod(h))
register_flops(_clamped_swiglu_backward_op, lambda grad, h, alpha, limit, out_shape=None: 8 * math.prod(h))


def clamped_swiglu(h: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's clamped SwiGLU of an interleaved gate/up tensor.

    Args:
        h: ``[S, 2I]`` with gate in the even and up in the odd columns, unit column stride.
        alpha: ``config.swiglu_alpha`` (1.702).
        limit: ``config.swiglu_limit`` (7.0).

    Returns:
        ``[S, I]`` in h's dtype.
    """
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"clamped_swiglu takes an interleaved [S, 2I] tensor, got {tuple(h.shape)}")
    if h.stride(1) != 1:
        h = h.contiguous()
    return call(_clamped_swiglu_op, h, float(alpha), float(limit))


# ------------------------------------------------------------------ routing-weighted SwiGLU
def _weighted_swiglu_reference(h: Tensor, weights: Tensor, perm: Tensor) -> Tensor:
    compute = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(compute).chunk(2, dim=-1)
    scale = weights.reshape(-1).to(compute)[perm, None]
    return (torch.nn.functional.silu(gate) * up * scale).to(h.dtype)


def _weighted_swiglu_backward_reference(grad: Tensor, h: Tensor, weights: Tensor, perm: Tensor):
    compute = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(compute).chunk(2, dim=-1)
    dy = grad.to(compute)
    scale = weights.reshape(-1).to(compute)[perm, None]
    s = torch.sigmoid(gate)
    act = gate * s
    dh = torch.cat((dy * scale * up * (s + act * (1 - s)), dy * scale * act), dim=-1)
    dw = torch.empty(weights.numel(), dtype=compute, device=h.device)
    dw[perm] = (dy * act * up).sum(-1)
    return dh.to(h.dtype), dw


@sloth_op("moe_weighted_swiglu")
def _weighted_swiglu_op(h: Tensor, weights: Tensor, perm: Tensor) -> Tensor:
    """``[S, I]``: ``silu(gate) * up * weights.flat[perm[s]]`` of a concatenated ``[S, 2I]`` gate|up."""
    if use_triton(h):
        return _kernels.weighted_swiglu_forward(h, weights.reshape(-1), perm)
    return _weighted_swiglu_reference(h, weights, perm)


@_weighted_swiglu_op.register_fake
def _weighted_swiglu_fake(h, weights, perm):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@sloth_op("moe_weighted_swiglu_backward")
def _weighted_swiglu_backward_op(
    grad: Tensor, h: Tensor, weights: Tensor, perm: Tensor
) -> tuple[Tensor, Tensor]:
    """``(dh [S, 2I], dweights like weights)``."""
    if use_triton(h):
        dh, dw = _kernels.weighted_swiglu_backward(grad, h, weights.reshape(-1), perm)
    else:
        dh, dw = _weighted_swiglu_backward_reference(grad, h, weights, perm)
    return dh, dw.view(weights.shape).to(weights.dtype)


@_weighted_swiglu_backward_op.register_fake
def _weighted_swiglu_backward_fake(grad, h, weights, perm):
    return h.new_empty(h.shape), weights.new_empty(weights.shape)


def _weighted_swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _weighted_swiglu_backward(ctx, grad):
    h, weights, perm = ctx.saved_tensors
    dh, dw = call(_weighted_swiglu_backward_op, grad.contiguous(), h, weights, perm)
    return dh, dw, None


register_autograd(_weighted_swiglu_op, _weighted_swiglu_backward, _weighted_swiglu_setup)
register_flops(_weighted_swiglu_op, lambda h, weights, perm, out_shape=None: 3 * math.prod(h))
register_flops(_weighted_swiglu_backward_op, lambda grad, h, weights, perm, out_shape=None: 6 * math.prod(h))


def weighted_swiglu(h: Tensor, weights: Tensor, perm: Tensor) -> Tensor:
    """SwiGLU of expert rows times each row's routing weight, with gradients to h and the weights.

    Scaling before the (linear, bias-free) down projection is the same as scaling its output, and
    the weights' gradient ``<grad_s, act_s>`` then needs only h, which the activation keeps anyway:
    the ``[S, H]`` expert outputs need not be kept for the router's gradient.

    Args:
        h: ``[S, 2I]`` gate columns then up columns, unit column stride.
        weights: ``[T, k]`` routing weights (contiguous).
        perm: int64 ``[S]`` sorted position -> slot (``t * k + j``).

    Returns:
        ``[S, I]`` in h's dtype.
    """
    if h.dim() != 2 or h.shape[1] % 2 or perm.shape[0] != h.shape[0] or weights.numel() != h.shape[0]:
        raise ValueError(
            f"weighted_swiglu: h {tuple(h.shape)} must be [S, 2I] with S = weights.numel() "
            f"({weights.numel()}) = len(perm) ({perm.shape[0]})"
        )
    if h.stride(1) != 1:
        h = h.contiguous()
    return call(_weighted_swiglu_op, h, weights.contiguous(), perm)
