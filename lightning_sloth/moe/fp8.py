"""FP8 expert weights: e4m3 storage of a MoE layer's frozen 3-D weights and the grouped GEMM over it.

:func:`quantize_experts_fp8` stores ``gate_up_proj`` / ``down_proj`` in FP8 e4m3 with one float32
scale per output channel of each expert (``[E, out]``), as :class:`~lightning_sloth.quant.fp8.LinearFP8`
stores a linear layer. The parameter keeps its name and shape and holds the ``uint8`` codes in the
family's layout; ``<name>_scale`` holds the scales as ``int32`` bits (a dtype cast of the model
never rounds them) and ``<name>_transposed`` the codes in the other layout (not saved; remade on
load), since each of the two products wants its own column-major operand::

    forward   q_x, s_x = rowwise_e4m3(x)                            x [S, K] rows in expert order
              y = _scaled_grouped_mm(q_x, q_W^T, s_x, s_W)          bf16 [S, N]; + b_e + LoRA
    backward  q_g, s_g = rowwise(dy * s_W[e(row)])                  each row's expert scales folded in
              dx = _scaled_grouped_mm(q_g, q_W, s_g, 1)             + the LoRA term (bf16)

``sloth::moe_lora_grouped_mm_fp8`` is that product with per-expert LoRA (rank 0 for none) in the
compute dtype, through the separate passes of :mod:`~lightning_sloth.moe.gemm` (the fused
permutation's Triton GEMMs are bf16: experts in FP8 take the separate gather and combine). The
input gradient's format is the experts' ``grad_format``: ``"e4m3"`` (the default) runs the FP8
grouped GEMM; ``"e5m2"`` the emulation; ``"bf16"`` a 16-bit grouped GEMM on the dequantised weight.

Where it runs in FP8: CUDA devices of compute capability 9.0 or newer (``torch._scaled_grouped_mm``),
bfloat16 rows, both sizes multiples of 16. Elsewhere the plain-torch emulation of
:mod:`lightning_sloth.ops.fp8_formats` (quantise, dequantise, float32 product), which is also the
GPU path's oracle. Saved for the backward: the input (for dA), ``x A^T``, the codes and scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sloth.moe.gemm import _lora_flops, _mm, _mm_into, _weight_grad, add_bias_and_lora, bias_grad
from lightning_sloth.moe.layouts import layout_of, require_sloth_experts
from lightning_sloth.ops import fp8 as fp8_ops
from lightning_sloth.ops.fp8_formats import (
    FP8_DTYPES,
    check_fp8_device,
    check_grad_format,
    dequantize_rows,
    quantize_rows,
)
from lightning_sloth.ops.registry import (
    TRITON_OPS,
    call,
    register_autograd,
    register_flops,
    sloth_op,
    use_triton,
)

if TRITON_OPS:
    from lightning_sloth.kernels import fp8 as _kernels

__all__ = [
    "FP8Experts",
    "dequantize_experts_fp8",
    "expert_fp8_storage",
    "has_fp8_experts",
    "lora_grouped_mm_fp8",
    "quantize_experts_fp8",
]

_E4M3 = FP8_DTYPES["e4m3"]
_WEIGHTS = ("gate_up_proj", "down_proj")
_RECORD = "_sloth_fp8_experts"
_HOOKS = "_sloth_fp8_hooks"


@dataclass(frozen=True)
class _Record:
    shape: tuple[int, ...]
    transposed: bool
    dtype: torch.dtype
    grad_format: str


@dataclass(frozen=True)
class FP8Experts:
    """One FP8 expert weight, sharing the experts module's tensors.

    Attributes:
        codes: ``uint8 [E, N, K]`` e4m3 bits of ``W_e`` (``y = x W_e^T``).
        codes_t: ``uint8 [E, K, N]``, the same codes transposed.
        scale: float32 ``[E, N]``, one per output channel.
        grad_format: the input gradient's format (``"e4m3"``, ``"e5m2"``, ``"bf16"``).
    """

    codes: Tensor
    codes_t: Tensor
    scale: Tensor
    grad_format: str

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[E, N, K]``: the weight the codes stand for, rounded once to ``dtype``."""
        return (self.codes.view(_E4M3).float() * self.scale[..., None]).to(dtype)


def has_fp8_experts(experts: nn.Module) -> bool:
    """Whether ``experts`` stores an expert weight in FP8."""
    return bool(experts.__dict__.get(_RECORD))


def expert_fp8_storage(experts: nn.Module, name: str) -> FP8Experts | None:
    """The :class:`FP8Experts` of ``experts.<name>``, or None if it is not stored in FP8."""
    record = experts.__dict__.get(_RECORD, {}).get(name)
    if record is None:
        return None
    own, other = getattr(experts, name), getattr(experts, f"{name}_transposed")
    codes, codes_t = (other, own) if record.transposed else (own, other)
    return FP8Experts(
        codes, codes_t, getattr(experts, f"{name}_scale").view(torch.float32), record.grad_format
    )


def quantize_experts_fp8(
    experts: nn.Module, grad_format: str = "e4m3", device: torch.device | str | None = None
) -> list[str]:
    """Store ``experts``' 3-D ``gate_up_proj`` and ``down_proj`` in FP8 e4m3, in place (frozen).

    Args:
        experts: a transformers experts module of a family in :data:`~lightning_sloth.moe.layouts.LAYOUTS`.
        grad_format: the input gradient's format (``"e4m3"``, ``"e5m2"``, ``"bf16"``).
        device: where to quantise (default: where each weight is).

    Returns:
        The parameter names converted (weights already in FP8 or in 4 bits are skipped).

    Raises:
        NotImplementedError: a family the "sloth" experts do not run.
        RuntimeError: a CUDA device without FP8 tensor cores.
    """
    check_grad_format(grad_format)
    layout = layout_of(experts)
    record = experts.__dict__.setdefault(_RECORD, {})
    done = []
    for name in _WEIGHTS:
        param = getattr(experts, name, None)
        if name in record or param is None or not param.is_floating_point():
            continue
        if param.dim() != 3:
            raise ValueError(
                f"{type(experts).__name__}.{name} is {tuple(param.shape)}, not a 3-D expert weight"
            )
        weight = param.detach() if device is None else param.detach().to(device)
        check_fp8_device(weight.device)
        nk = weight.transpose(-2, -1) if layout.transposed else weight
        e, n, k = nk.shape
        codes, scale = quantize_rows(nk.reshape(e * n, k), "e4m3")
        codes = codes.view(torch.uint8).view(e, n, k)
        own = codes.transpose(-2, -1).contiguous() if layout.transposed else codes
        other = codes if layout.transposed else codes.transpose(-2, -1).contiguous()
        delattr(experts, name)
        experts.register_parameter(name, nn.Parameter(own, requires_grad=False))
        experts.register_buffer(f"{name}_scale", scale.view(e, n).view(torch.int32))
        experts.register_buffer(f"{name}_transposed", other, persistent=False)
        record[name] = _Record(tuple(param.shape), layout.transposed, param.dtype, grad_format)
        del weight, nk, param
        done.append(name)
    if record and _HOOKS not in experts.__dict__:
        experts.__dict__[_HOOKS] = (
            experts.register_forward_pre_hook(functools.partial(require_sloth_experts, "FP8")),
            experts.register_load_state_dict_post_hook(_refresh_transposed),
        )
    return done


@torch.no_grad()
def dequantize_experts_fp8(experts: nn.Module, dtype: torch.dtype = torch.float32) -> list[str]:
    """Undo :func:`quantize_experts_fp8` in place: each FP8 expert weight becomes a dense frozen
    parameter in its layout, the codes times the scales rounded once to ``dtype`` (merge, export)."""
    record = experts.__dict__.get(_RECORD, {})
    done = []
    for name in list(record):
        dense = expert_fp8_storage(experts, name).dequantized(dtype)
        if record[name].transposed:
            dense = dense.transpose(-2, -1).contiguous()
        for suffix in ("_scale", "_transposed"):
            delattr(experts, name + suffix)
        delattr(experts, name)
        experts.register_parameter(name, nn.Parameter(dense, requires_grad=False))
        del record[name]
        done.append(name)
    if not record:
        for handle in experts.__dict__.pop(_HOOKS, ()):
            handle.remove()
    return done


@torch.no_grad()
def _refresh_transposed(experts: nn.Module, incompatible_keys) -> None:
    """After a state dict loads the codes, remake their transposed copies (they are not saved)."""
    for name in experts.__dict__.get(_RECORD, {}):
        codes = getattr(experts, name)
        getattr(experts, f"{name}_transposed").copy_(codes.transpose(-2, -1))


# ------------------------------------------------------------------------------------ products
def _grouped_fp8_applies(x: Tensor, n: int, k: int) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs: CUDA sm90+, bfloat16, both sizes multiples of 16."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and n % 16 == 0
        and k % 16 == 0
        and hasattr(torch, "_scaled_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def _dequantized_t(codes_t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``[E, K, N]``: ``W_e^T`` from the transposed codes and the ``[E, N]`` scales."""
    return (codes_t.view(_E4M3).float() * scale[:, None, :]).to(dtype)


def _base_product(x: Tensor, codes: Tensor, codes_t: Tensor, scale: Tensor, ends: Tensor) -> Tensor:
    """``[S, N]``: ``x W_e^T`` per expert group with x quantised per row to e4m3."""
    e, n, k = codes.shape
    if _grouped_fp8_applies(x, n, k):
        qx, sx = fp8_ops.quantize_activation(x, "e4m3")
        return torch._scaled_grouped_mm(
            qx, codes.view(_E4M3).transpose(-2, -1), sx.view(-1), scale, offs=ends,
            out_dtype=x.dtype, use_fast_accum=fp8_ops.FAST_ACCUM,
        )  # fmt: skip
    qx, sx = quantize_rows(x, "e4m3")
    return _mm(dequantize_rows(qx, sx), _dequantized_t(codes_t, scale, torch.float32), ends, True).to(x.dtype)


def _input_grad(
    grad: Tensor, codes_t: Tensor, scale: Tensor, ends: Tensor, expert_ids: Tensor, grad_format: str
) -> Tensor:
    """``[S, K]``: ``dy W_e`` per expert group in ``grad_format`` (see the module notes)."""
    e, k, n = codes_t.shape
    if grad_format == "bf16":
        return _mm(grad, _dequantized_t(codes_t, scale, grad.dtype), ends, w_is_kn=False)
    if grad_format == "e4m3" and _grouped_fp8_applies(grad, n, k) and use_triton(grad):
        qg, sg = _kernels.quantize_rows(grad, _E4M3, scale, expert_ids)
        ones = fp8_ops._unit_scales(k, grad.device, rows=e)
        return torch._scaled_grouped_mm(
            qg, codes_t.view(_E4M3).transpose(-2, -1), sg.view(-1), ones, offs=ends,
            out_dtype=grad.dtype, use_fast_accum=fp8_ops.FAST_ACCUM,
        )  # fmt: skip
    qg, sg = quantize_rows(grad.float() * scale.index_select(0, expert_ids), grad_format)
    return _mm(dequantize_rows(qg, sg), codes_t.view(_E4M3).float(), ends, w_is_kn=False).to(grad.dtype)


# -------------------------------------------------------------------------------------- the op
@sloth_op("moe_lora_grouped_mm_fp8")
def _op(
    x: Tensor,
    codes: Tensor,
    codes_t: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    lora_scale: float,
    ends: Tensor,
    expert_ids: Tensor,
    grad_format: str,
) -> tuple[Tensor, Tensor]:
    """``(out [S, N], xa [S, r])``: ``out = fp8(x) W_e^T (+ b_e) + s (x A_e^T) B_e^T``."""
    out = _base_product(x, codes, codes_t, scale, ends)
    return add_bias_and_lora(out, x, bias, lora_a, lora_b, lora_scale, ends, expert_ids)


@_op.register_fake
def _fake(x, codes, codes_t, scale, bias, lora_a, lora_b, lora_scale, ends, expert_ids, grad_format):
    return x.new_empty((x.shape[0], codes.shape[1])), x.new_empty((x.shape[0], lora_a.shape[1]))


@sloth_op("moe_lora_grouped_mm_fp8_backward")
def _backward_op(
    grad: Tensor,
    x: Tensor,
    xa: Tensor,
    codes_t: Tensor,
    scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    lora_scale: float,
    ends: Tensor,
    expert_ids: Tensor,
    grad_format: str,
    need_x: bool,
    need_a: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dA, dB)``; a gradient not asked for is an empty tensor."""
    empty = grad.new_empty(0)
    rank = lora_a.shape[1]
    g = _mm(grad, lora_b, ends, w_is_kn=True) * lora_scale if rank and (need_x or need_a) else None
    dx = empty
    if need_x:
        dx = _input_grad(grad, codes_t, scale, ends, expert_ids, grad_format)
        if g is not None:
            dx = _mm_into(dx, g, lora_a, ends, w_is_kn=True)
    if not rank:
        return (
            dx,
            torch.empty_like(lora_a) if need_a else empty,
            torch.empty_like(lora_b) if need_b else empty,
        )
    da = _weight_grad(g, x, ends) if need_a else empty
    db = _weight_grad(grad, xa * lora_scale, ends) if need_b else empty
    return dx, da, db


@_backward_op.register_fake
def _backward_fake(
    grad,
    x,
    xa,
    codes_t,
    scale,
    lora_a,
    lora_b,
    lora_scale,
    ends,
    expert_ids,
    grad_format,
    need_x,
    need_a,
    need_b,
):
    empty = grad.new_empty(0)
    return (
        grad.new_empty((grad.shape[0], codes_t.shape[1])) if need_x else empty,
        lora_a.new_empty(lora_a.shape) if need_a else empty,
        lora_b.new_empty(lora_b.shape) if need_b else empty,
    )


def _setup(ctx, inputs, output):
    x, codes, codes_t, scale, bias, lora_a, lora_b, lora_scale, ends, expert_ids, grad_format = inputs
    ctx.mark_non_differentiable(output[1])
    # The input is kept only for dA: without an adapter (rank 0) it is not saved at all.
    ctx.save_for_backward(
        x if lora_a.shape[1] else None, output[1], codes_t, scale, lora_a, lora_b, ends, expert_ids
    )
    ctx.lora_scale, ctx.grad_format = lora_scale, grad_format
    ctx.bias_shape = None if bias is None else tuple(bias.shape)


def _backward(ctx, grad, _grad_xa):
    x, xa, codes_t, scale, lora_a, lora_b, ends, expert_ids = ctx.saved_tensors
    need = ctx.needs_input_grad
    if need[1] or need[2] or need[3]:
        raise RuntimeError(
            "sloth::moe_lora_grouped_mm_fp8: the FP8 expert weight is frozen; it has no gradient"
        )
    grad = grad.contiguous()
    dx, da, db = call(
        _backward_op,
        grad, x if x is not None else grad.new_empty(0), xa, codes_t, scale, lora_a, lora_b, ctx.lora_scale, ends,
        expert_ids, ctx.grad_format, need[0], need[5], need[6],
    )  # fmt: skip
    dbias = bias_grad(grad, expert_ids, ctx.bias_shape) if need[4] else None
    return (
        dx if need[0] else None, None, None, None, dbias,
        da if need[5] else None, db if need[6] else None, None, None, None, None,
    )  # fmt: skip


register_autograd(_op, _backward, _setup)
register_flops(
    _op,
    lambda x, codes, codes_t, scale, bias, a, b, s, ends, ids, fmt, out_shape=None: _lora_flops(
        x[0], codes, a
    ),
)
register_flops(
    _backward_op,
    lambda grad, x, xa, codes_t, scale, a, b, s, ends, ids, fmt, nx, na, nb, out_shape=None: (
        int(nx) * 2 * grad[0] * codes_t[1] * codes_t[2] + 2 * _lora_flops(grad[0], codes_t, a)
    ),
)


def lora_grouped_mm_fp8(
    x: Tensor,
    storage: FP8Experts,
    lora_a: Tensor | None,
    lora_b: Tensor | None,
    scale: float,
    ends: Tensor,
    *,
    bias: Tensor | None = None,
    expert_ids: Tensor | None = None,
) -> Tensor:
    """:func:`~lightning_sloth.moe.gemm.lora_grouped_mm` over an FP8 ``[E, N, K]`` expert weight.

    Args:
        x: ``[S, K]`` rows in expert order (bfloat16 for the FP8 GEMMs; other dtypes emulate).
        storage: the frozen weight's :class:`FP8Experts`.
        lora_a, lora_b: ``[E, r, K]`` and ``[E, N, r]`` in x's dtype, or both None (no adapter).
        scale: the LoRA scaling.
        ends: int32 ``[E]`` cumulative row ends.
        bias: optional ``[E, N]``.
        expert_ids: int64 ``[S]`` expert of each row (the input gradient folds each row's expert
            scales into it).

    Returns:
        ``[S, N]`` in x's dtype; gradients reach x, lora_a, lora_b and bias, never the storage.
    """
    e, n, k = storage.codes.shape
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"lora_grouped_mm_fp8 computes in a floating-point dtype, got {x.dtype}")
    if lora_a is None:
        lora_a, lora_b = x.new_empty((e, 0, k)), x.new_empty((e, n, 0))
    rank = lora_a.shape[1]
    if (
        x.dim() != 2
        or x.shape[1] != k
        or lora_a.shape != (e, rank, k)
        or lora_b.shape != (e, n, rank)
        or ends.shape != (e,)
        or expert_ids is None
        or expert_ids.shape != (x.shape[0],)
    ):
        raise ValueError(
            f"lora_grouped_mm_fp8: x {tuple(x.shape)}, weight [E, N, K] {(e, n, k)}, lora_a "
            f"{tuple(lora_a.shape)} [E, r, K], lora_b {tuple(lora_b.shape)} [E, N, r], ends {tuple(ends.shape)}, "
            f"expert_ids {None if expert_ids is None else tuple(expert_ids.shape)} [S] do not fit"
        )
    out, _ = call(
        _op, x, storage.codes, storage.codes_t, storage.scale, bias, lora_a, lora_b.contiguous(), float(scale),
        ends, expert_ids, check_grad_format(storage.grad_format),
    )  # fmt: skip
    return out
