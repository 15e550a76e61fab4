"""Grouped GEMMs over rows sorted by expert, as ``sloth::`` ops, with and without per-expert LoRA.

``moe_grouped_mm``: ``y[rows of e] = x[rows of e] W_e (+ b_e)`` for both weight layouts
(``[E, out, in]`` Qwen3-MoE/Mixtral, ``[E, in, out]`` GPT-OSS); its backward op gives the input's
and, when it trains, the weight's gradient (a frozen weight costs no saved input).

``moe_lora_grouped_mm``: the same plus ``s (x A_e^T) B_e^T``: two rank-r grouped GEMMs, the second
adding into the base output in place (the Triton GEMM's epilogue), and in the backward the rank-r
term added into the input's gradient the same way. ``W_e + s B_e A_e`` is never formed.

Implementations: ``torch._grouped_mm`` on CUDA for bfloat16 with 16-byte aligned rows (Hopper's
grouped GEMM); the Triton grouped GEMM of ``lightning_sloth.kernels.moe`` for the other CUDA cases
(float16, float32, odd sizes) and for the in-place rank-r updates; a per-expert loop as the CPU
reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sloth.moe.routing import counts_from_ends
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
    "add_bias_and_lora",
    "bias_grad",
    "grouped_mm",
    "grouped_mm_reference",
    "lora_grouped_mm",
    "lora_rows",
]


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
        return torch.where((counts_from_ends(ends) > 0)[:, None, None], out, 0)
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


def bias_grad(grad: Tensor, expert_ids: Tensor, bias_shape: tuple[int, ...]) -> Tensor:
    """The ``[E, N]`` gradient of a per-expert bias: each row's gradient summed into its expert's
    row in float32 (at least), rounded once to grad's dtype."""
    compute = torch.promote_types(grad.dtype, torch.float32)
    out = grad.new_zeros(bias_shape, dtype=compute).index_add_(0, expert_ids, grad.to(compute))
    return out.to(grad.dtype)


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
        db = bias_grad(grad, expert_ids, ctx.bias_shape)
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


# ------------------------------------------------------------------ grouped GEMM with LoRA
def _mm_into(
    out: Tensor, x: Tensor, weight: Tensor, ends: Tensor, w_is_kn: bool, bias: Tensor | None = None
) -> Tensor:
    """``out[rows of e] += x[rows of e] @ W_e`` in place (a rank-r update: x has r columns), and with the
    Triton kernel the ``[E, N]`` bias in the same pass (``bias`` is for the kernel path only)."""
    if use_triton(out):
        return _kernels.grouped_mm(x, weight, ends, w_is_kn, out=out, bias=bias)
    return out.add_(grouped_mm_reference(x, weight, ends, transposed=w_is_kn))


def lora_rows(
    x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scale: float, ends: Tensor,
    expert_ids: Tensor, transposed: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out [S, N], xa [S, r])``: ``out = x W_e (+ b_e) + scale (x A_e^T) B_e^T`` over rows in expert
    order, in separate passes (the base GEMM, the bias, the rank-r down and up products)."""
    out = _mm(x, weight, ends, w_is_kn=transposed)
    return add_bias_and_lora(out, x, bias, lora_a, lora_b, scale, ends, expert_ids)


def add_bias_and_lora(
    out: Tensor, x: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scale: float, ends: Tensor,
    expert_ids: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out + b_e + scale (x A_e^T) B_e^T, xa [S, r])`` for a base product ``out [S, N]`` already made
    (in place where the Triton kernels run)."""
    rank = lora_a.shape[1]
    fold = bias is not None and rank > 0 and use_triton(out)  # the bias rides the rank-r pass over out
    if bias is not None and not fold:
        if use_triton(out):
            _kernels.add_group_bias(out, bias, expert_ids)
        else:
            out = out + bias.index_select(0, expert_ids)
    if rank == 0:
        return out, x.new_empty((x.shape[0], 0))
    xa = _mm(x, lora_a, ends, w_is_kn=False)
    _mm_into(out, xa * scale, lora_b, ends, w_is_kn=False, bias=bias if fold else None)
    return out, xa


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
    return lora_rows(x, weight, bias, lora_a, lora_b, scale, ends, expert_ids, transposed)


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
    dbias = bias_grad(grad, expert_ids, ctx.bias_shape) if need_bias else None
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
