"""Expert compute as ``sloth::`` ops: gather into expert order, grouped GEMM, GPT-OSS activation, combine.

One layer call, with ``S = T * k`` routed rows sorted by expert (see :mod:`.routing`)::

    x_g = moe_gather(x, perm, inv, k)                  [S, H]   token rows in expert order
    h   = moe_grouped_mm(x_g, W_gate_up, b, ends, ...) [S, 2I]  (+ LoRA: two more, rank r)
    a   = swiglu(gate, up) | moe_clamped_swiglu(h)     [S, I]
    y   = moe_grouped_mm(a, W_down, b, ends, ...)      [S, H]
    out = moe_combine(y, weights, perm, inv)           [T, H]   sum_j w[t, j] y[inv[t k + j]], fp32

Backward of each is its own op: the gather's is a gather-sum through ``inv`` (each token sums its
``k`` rows in a fixed order, no atomics); the combine's gives the rows' gradient (a gather through
``perm`` scaled by the routing weight) and the routing weights' gradient (a dot product per slot), so
the router trains. The grouped GEMM's backward gives the input's and (when it trains) the weight's
gradient; a weight that is frozen costs no saved input.

Implementations: ``torch._grouped_mm`` on CUDA for bfloat16 with 16-byte aligned rows (Hopper's
grouped GEMM); the Triton kernels of ``lightning_sloth.kernels.moe`` for the other CUDA cases
(float16, float32, odd sizes); a plain per-expert loop as the CPU reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sloth.ops._registry import (
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
    "lora_grouped_mm",
    "moe_sum",
    "weighted_swiglu",
    "clamped_swiglu_reference",
    "grouped_mm",
    "grouped_mm_reference",
    "moe_combine",
    "moe_gather",
]


# ------------------------------------------------------------------------------------ references
def grouped_mm_reference(x: Tensor, weight: Tensor, ends: Tensor, transposed: bool) -> Tensor:
    """Per-expert loop: rows ``ends[e-1]:ends[e]`` of x times expert e's weight (reads ends on the host).

    Args:
        x: ``[S, K]`` rows sorted by expert.
        weight: ``[E, N, K]`` (``transposed=False``: ``y = x W_e^T``) or ``[E, K, N]`` (``y = x W_e``).
        ends: int32 ``[E]`` cumulative row ends.
        transposed: the weight layout, as above.

    Returns:
        ``[S, N]`` in x's dtype; rows past ``ends[-1]`` are zero.
    """
    n_out = weight.shape[2] if transposed else weight.shape[1]
    out = x.new_zeros((x.shape[0], n_out))
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            w = weight[e] if transposed else weight[e].t()
            out[start:end] = x[start:end] @ w
        start = end
    return out


def _weight_grad_reference(a: Tensor, b: Tensor, ends: Tensor) -> Tensor:
    out = a.new_zeros((ends.shape[0], a.shape[1], b.shape[1]))
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[e] = a[start:end].t() @ b[start:end]
        start = end
    return out


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


# --------------------------------------------------------------------------------- dispatch
def _hopper_grouped_mm(*tensors: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bfloat16 CUDA, rows aligned to 16 bytes."""
    first = tensors[0]
    if first.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(first.device) < (9, 0):
        return False
    return all(t.dtype == torch.bfloat16 and t.shape[-1] % 8 == 0 and t.shape[-2] % 8 == 0 for t in tensors)


def _mm(x: Tensor, weight: Tensor, ends: Tensor, w_is_kn: bool) -> Tensor:
    """``x[rows of e] @ W_e`` with ``W_e = weight[e]`` (``w_is_kn``) or ``weight[e].T``."""
    kn = weight if w_is_kn else weight.transpose(-2, -1)
    if _hopper_grouped_mm(x, weight):
        return torch._grouped_mm(x, kn, offs=ends)
    if use_triton(x):
        return _kernels.grouped_mm(x, weight, ends, w_is_kn)
    return grouped_mm_reference(x, weight, ends, transposed=w_is_kn)


def _weight_grad(a: Tensor, b: Tensor, ends: Tensor) -> Tensor:
    """``[E, A, B]``: ``a[rows of e]^T @ b[rows of e]`` (zero for an expert without rows)."""
    if _hopper_grouped_mm(a, b):
        out = torch._grouped_mm(a.t(), b, offs=ends)
        return torch.where((torch.diff(ends, prepend=ends.new_zeros(1)) > 0)[:, None, None], out, 0)
    if use_triton(a):
        return _kernels.grouped_mm_weight_grad(a, b, ends)
    return _weight_grad_reference(a, b, ends)


# ------------------------------------------------------------------------------ grouped GEMM
@sloth_op("moe_grouped_mm")
def _grouped_mm_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, ends: Tensor, expert_ids: Tensor, transposed: bool
) -> Tensor:
    """``[S, N]``: per expert group, ``x W_e^T`` (``[E, N, K]``) or ``x W_e`` (``transposed``) + ``b_e``."""
    out = _mm(x, weight, ends, w_is_kn=transposed)
    if bias is not None:
        if use_triton(out):
            _kernels.add_group_bias(out, bias, expert_ids)
        else:
            out = out + bias.index_select(0, expert_ids)
    return out


@_grouped_mm_op.register_fake
def _grouped_mm_fake(x, weight, bias, ends, expert_ids, transposed):
    return x.new_empty((x.shape[0], weight.shape[2] if transposed else weight.shape[1]))


@sloth_op("moe_grouped_mm_backward")
def _grouped_mm_backward_op(
    grad: Tensor, x: Tensor, weight: Tensor, ends: Tensor, transposed: bool, need_x: bool, need_w: bool
) -> tuple[Tensor, Tensor]:
    """``(dx [S, K], dW like weight)``; a gradient not asked for is an empty tensor."""
    dx = _mm(grad, weight, ends, w_is_kn=not transposed) if need_x else grad.new_empty(0)
    if need_w:
        dw = _weight_grad(x, grad, ends) if transposed else _weight_grad(grad, x, ends)
    else:
        dw = grad.new_empty(0)
    return dx, dw


@_grouped_mm_backward_op.register_fake
def _grouped_mm_backward_fake(grad, x, weight, ends, transposed, need_x, need_w):
    k = weight.shape[1] if transposed else weight.shape[2]
    dx = grad.new_empty((grad.shape[0], k)) if need_x else grad.new_empty(0)
    return dx, (weight.new_empty(weight.shape) if need_w else grad.new_empty(0))


def _grouped_mm_setup(ctx, inputs, output):
    x, weight, bias, ends, expert_ids, transposed = inputs
    # The input is kept only for the weight's gradient: a frozen expert weight saves nothing.
    ctx.save_for_backward(x if weight.requires_grad else None, weight, ends, expert_ids)
    ctx.transposed = transposed
    ctx.bias_shape = None if bias is None else tuple(bias.shape)


def _grouped_mm_backward(ctx, grad):
    x, weight, ends, expert_ids = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad = grad.contiguous()
    dx = dw = db = None
    if need_x or need_w:
        dx, dw = call(
            _grouped_mm_backward_op,
            grad,
            x if x is not None else grad.new_empty(0),
            weight,
            ends,
            ctx.transposed,
            need_x,
            need_w,
        )
    if need_b:
        compute = torch.promote_types(grad.dtype, torch.float32)
        db = grad.new_zeros(ctx.bias_shape, dtype=compute).index_add_(0, expert_ids, grad.to(compute))
        db = db.to(grad.dtype)
    return (dx if need_x else None), (dw if need_w else None), db, None, None, None


register_autograd(_grouped_mm_op, _grouped_mm_backward, _grouped_mm_setup)


def _gemm_flops(rows: int, weight_shape) -> int:
    return 2 * rows * weight_shape[1] * weight_shape[2]


register_flops(
    _grouped_mm_op,
    lambda x, weight, bias, ends, expert_ids, transposed, out_shape=None: _gemm_flops(x[0], weight),
)
register_flops(
    _grouped_mm_backward_op,
    lambda grad, x, weight, ends, transposed, need_x, need_w, out_shape=None: (
        (int(need_x) + int(need_w)) * _gemm_flops(grad[0], weight)
    ),
)


def grouped_mm(
    x: Tensor,
    weight: Tensor,
    ends: Tensor,
    *,
    transposed: bool = False,
    bias: Tensor | None = None,
    expert_ids: Tensor | None = None,
) -> Tensor:
    """Grouped GEMM over rows sorted by expert, with gradients to x, weight and bias.

    Args:
        x: ``[S, K]`` rows in expert order; float16/bfloat16/float32/float64.
        weight: ``[E, N, K]`` (``y = x W_e^T``, Qwen3-MoE/Mixtral) or, with ``transposed``,
            ``[E, K, N]`` (``y = x W_e``, GPT-OSS); x's dtype and device.
        ends: int32 ``[E]`` cumulative row ends per expert (``ends[-1] == S``).
        transposed: the weight layout, as above.
        bias: optional ``[E, N]``, added per row's expert.
        expert_ids: int64 ``[S]`` expert of each row; needed with a bias.

    Returns:
        ``[S, N]`` in x's dtype.
    """
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"grouped_mm takes x [S, K] and weight [E, ., .], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    k = weight.shape[1] if transposed else weight.shape[2]
    if x.shape[1] != k or ends.shape != (weight.shape[0],):
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
            f"(transposed={transposed}) with ends {tuple(ends.shape)}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"grouped_mm: x is {x.dtype} but weight is {weight.dtype}")
    if bias is not None and expert_ids is None:
        raise ValueError("grouped_mm: a bias needs expert_ids")
    ids = expert_ids if expert_ids is not None else ends.new_zeros(0, dtype=torch.int64)
    return call(_grouped_mm_op, x, weight, bias, ends, ids, transposed)


# ----------------------------------------------------------------------------- gather / combine
def _rows(src: Tensor, idx: Tensor, div: int, scale: Tensor | None) -> Tensor:
    if use_triton(src):
        return _kernels.gather_rows(src, idx, div, scale)
    out = src.index_select(0, idx // div if div != 1 else idx)
    if scale is None:
        return out
    return (out.to(torch.promote_types(out.dtype, torch.float32)) * scale[idx, None]).to(src.dtype)


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
    if use_triton(grad):
        dw = _kernels.combine_weight_grad(grad, y, inv, top_k)
    else:
        compute = torch.promote_types(y.dtype, torch.float32)
        rows = y.index_select(0, inv).to(compute).view(-1, top_k, y.shape[1])
        dw = (rows * grad.to(compute)[:, None, :]).sum(-1)
    return dy, dw.to(weights.dtype)


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


# ------------------------------------------------------------------ grouped GEMM with LoRA
def _mm_into(out: Tensor, x: Tensor, weight: Tensor, ends: Tensor, w_is_kn: bool) -> Tensor:
    """``out[rows of e] += x[rows of e] @ W_e`` in place (a rank-r update: x has r columns)."""
    if use_triton(out):
        return _kernels.grouped_mm(x, weight, ends, w_is_kn, out=out)
    return out.add_(grouped_mm_reference(x, weight, ends, transposed=w_is_kn))


@sloth_op("moe_lora_grouped_mm")
def _lora_grouped_mm_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    ends: Tensor,
    expert_ids: Tensor,
    transposed: bool,
) -> tuple[Tensor, Tensor]:
    """``(out [S, N], xa [S, r])``: ``out = x W_e (+ b_e) + scale (x A_e^T) B_e^T``; xa is kept for the backward."""
    out = _mm(x, weight, ends, w_is_kn=transposed)
    if bias is not None:
        if use_triton(out):
            _kernels.add_group_bias(out, bias, expert_ids)
        else:
            out = out + bias.index_select(0, expert_ids)
    xa = _mm(x, lora_a, ends, w_is_kn=False)
    _mm_into(out, xa * scale, lora_b, ends, w_is_kn=False)
    return out, xa


@_lora_grouped_mm_op.register_fake
def _lora_grouped_mm_fake(x, weight, bias, lora_a, lora_b, scale, ends, expert_ids, transposed):
    n = weight.shape[2] if transposed else weight.shape[1]
    return x.new_empty((x.shape[0], n)), x.new_empty((x.shape[0], lora_a.shape[1]))


@sloth_op("moe_lora_grouped_mm_backward")
def _lora_grouped_mm_backward_op(
    grad: Tensor,
    x: Tensor,
    xa: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    ends: Tensor,
    transposed: bool,
    need_x: bool,
    need_w: bool,
    need_a: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dW, dA, dB)``; a gradient not asked for is an empty tensor."""
    empty = grad.new_empty(0)
    g = _mm(grad, lora_b, ends, w_is_kn=True) * scale if (need_x or need_a) else None  # [S, r]
    dx = (
        _mm_into(_mm(grad, weight, ends, w_is_kn=not transposed), g, lora_a, ends, w_is_kn=True)
        if need_x
        else empty
    )
    if need_w:
        dw = _weight_grad(x, grad, ends) if transposed else _weight_grad(grad, x, ends)
    else:
        dw = empty
    da = _weight_grad(g, x, ends) if need_a else empty
    db = _weight_grad(grad, xa * scale, ends) if need_b else empty
    return dx, dw, da, db


@_lora_grouped_mm_backward_op.register_fake
def _lora_grouped_mm_backward_fake(
    grad, x, xa, weight, lora_a, lora_b, scale, ends, transposed, need_x, need_w, need_a, need_b
):
    empty = grad.new_empty(0)
    return (
        x.new_empty(x.shape) if need_x else empty,
        weight.new_empty(weight.shape) if need_w else empty,
        lora_a.new_empty(lora_a.shape) if need_a else empty,
        lora_b.new_empty(lora_b.shape) if need_b else empty,
    )


def _lora_grouped_mm_setup(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b, scale, ends, expert_ids, transposed = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], weight, lora_a, lora_b, ends, expert_ids)
    ctx.scale, ctx.transposed = scale, transposed
    ctx.bias_shape = None if bias is None else tuple(bias.shape)


def _lora_grouped_mm_backward(ctx, grad, _grad_xa):
    x, xa, weight, lora_a, lora_b, ends, expert_ids = ctx.saved_tensors
    need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
    grad = grad.contiguous()
    dx, dw, da, db = call(
        _lora_grouped_mm_backward_op,
        grad, x, xa, weight, lora_a, lora_b, ctx.scale, ends, ctx.transposed, need_x, need_w, need_a, need_b,
    )  # fmt: skip
    dbias = None
    if need_bias:
        compute = torch.promote_types(grad.dtype, torch.float32)
        dbias = grad.new_zeros(ctx.bias_shape, dtype=compute).index_add_(0, expert_ids, grad.to(compute))
        dbias = dbias.to(grad.dtype)
    return (
        dx if need_x else None,
        dw if need_w else None,
        dbias,
        da if need_a else None,
        db if need_b else None,
        None,
        None,
        None,
        None,
    )


register_autograd(_lora_grouped_mm_op, _lora_grouped_mm_backward, _lora_grouped_mm_setup)


def _lora_flops(rows: int, weight_shape, a_shape) -> int:
    rank, n_in = a_shape[1], a_shape[2]
    n_out = weight_shape[1] * weight_shape[2] // n_in
    return 2 * rows * (n_in * n_out + rank * (n_in + n_out))


register_flops(
    _lora_grouped_mm_op,
    lambda x, weight, bias, a, b, scale, ends, ids, transposed, out_shape=None: _lora_flops(x[0], weight, a),
)
register_flops(
    _lora_grouped_mm_backward_op,
    lambda grad, x, xa, weight, a, b, scale, ends, transposed, nx, nw, na, nb, out_shape=None: (
        (int(nx) + int(nw)) * _gemm_flops(grad[0], weight) + 2 * _lora_flops(grad[0], weight, a)
    ),
)


def lora_grouped_mm(
    x: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    ends: Tensor,
    *,
    transposed: bool = False,
    bias: Tensor | None = None,
    expert_ids: Tensor | None = None,
) -> Tensor:
    """Grouped GEMM plus per-expert LoRA, never forming ``W_e + s B_e A_e``.

    ``out = x W_e (+ b_e) + s (x A_e^T) B_e^T`` per expert group; the rank-r update is added into the
    base output by the GEMM's epilogue (Triton) and, in the backward, into the input's gradient.

    Args:
        x: ``[S, in]`` rows in expert order.
        weight: the frozen base weight, ``[E, out, in]`` or (``transposed``) ``[E, in, out]``.
        lora_a: ``[E, r, in]``.
        lora_b: ``[E, out, r]``.
        scale: the LoRA scaling.
        ends: int32 ``[E]`` cumulative row ends.
        transposed: the base weight layout.
        bias: optional ``[E, out]``.
        expert_ids: int64 ``[S]`` expert of each row; needed with a bias.

    Returns:
        ``[S, out]`` in x's dtype; gradients reach x, lora_a and lora_b (and weight/bias if they train).
    """
    n_in = weight.shape[1] if transposed else weight.shape[2]
    n_out = weight.shape[2] if transposed else weight.shape[1]
    experts, rank = lora_a.shape[0], lora_a.shape[1]
    if lora_a.shape != (experts, rank, n_in) or lora_b.shape != (experts, n_out, rank) or x.shape[1] != n_in:
        raise ValueError(
            f"lora_grouped_mm: x {tuple(x.shape)}, weight {tuple(weight.shape)} (transposed={transposed}), "
            f"lora_a {tuple(lora_a.shape)} [E, r, in], lora_b {tuple(lora_b.shape)} [E, out, r] do not fit"
        )
    if bias is not None and expert_ids is None:
        raise ValueError("lora_grouped_mm: a bias needs expert_ids")
    ids = expert_ids if expert_ids is not None else ends.new_zeros(0, dtype=torch.int64)
    out, _ = call(
        _lora_grouped_mm_op, x, weight, bias, lora_a, lora_b.contiguous(), float(scale), ends, ids, transposed
    )
    return out
