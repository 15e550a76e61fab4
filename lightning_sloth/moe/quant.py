"""4-bit expert weights: storage on the experts module and the grouped GEMM over it.

:func:`quantize_experts` stores a MoE layer's frozen 3-D ``gate_up_proj`` / ``down_proj`` in the
bitsandbytes layout of :mod:`lightning_sloth.ops.nf4_formats` (NF4 / NF4-DQ / FP4, blocks of 64 over
the flattened ``[E, ., .]`` tensor). The parameter keeps its name and holds the packed ``uint8``
codes; the block scales and code books sit beside it as ``int32`` buffers holding float32 bits
(``<name>_absmax``, ``<name>_code``, ...), so a dtype cast of the model never rounds them.
GPT-OSS biases stay in the compute dtype.

``sloth::moe_lora_grouped_mm_4bit`` runs the grouped GEMM (with per-expert LoRA, rank 0 for none)
on such a weight::

    forward   W = dequant(storage)  [E, ., .]  into a reusable per-shape buffer; the grouped GEMM(s)
    backward  W = dequant(storage)  again, into the same buffer; dx (and dA, dB) from it

Saved for the backward: the input, ``x A^T`` and the 4-bit storage, never a dequantised weight.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sloth.moe.gemm import (
    _grouped_mm_backward_op,
    _grouped_mm_op,
    _lora_flops,
    _lora_grouped_mm_backward_op,
    _lora_grouped_mm_op,
    bias_grad,
)
from lightning_sloth.moe.layouts import require_sloth_experts
from lightning_sloth.ops.nf4 import _check_storage, _scratch, dequantize_4bit_into
from lightning_sloth.ops.nf4_formats import (
    Packed4bit,
    check_quant_type,
    code_book,
    dequantize_4bit_reference,
    quantize_4bit,
)
from lightning_sloth.ops.registry import call, register_autograd, register_flops, sloth_op

__all__ = [
    "EXPERT_WEIGHTS",
    "dequantize_experts",
    "expert_formats",
    "expert_storage",
    "lora_grouped_mm_4bit",
    "model_expert_formats",
    "quantize_experts",
]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The 3-D expert parameters stored in 4 bits."""

_RECORD = "_sloth_4bit_experts"
_HOOK = "_sloth_4bit_hook"
_PARTS = ("absmax", "code", "nested_absmax", "nested_code", "offset")


def _bits(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.int32) if t.dtype == torch.float32 else t.reshape(-1)


def quantize_experts(
    experts: nn.Module, quant_type: str = "nf4", device: torch.device | str | None = None
) -> list[str]:
    """Store ``experts``' 3-D ``gate_up_proj`` and ``down_proj`` in 4 bits, in place (frozen).

    Args:
        experts: a transformers experts module of a family in :data:`~lightning_sloth.moe.layouts.LAYOUTS`.
        quant_type: ``"nf4"``, ``"nf4-dq"`` or ``"fp4"``.
        device: where to quantise (default: where each weight is).

    Returns:
        The parameter names converted (already converted ones are skipped).
    """
    check_quant_type(quant_type)
    record = experts.__dict__.setdefault(_RECORD, {})
    done = []
    for name in EXPERT_WEIGHTS:
        param = getattr(experts, name, None)
        if name in record or param is None:
            continue
        if param.dim() != 3:
            raise ValueError(
                f"{type(experts).__name__}.{name} is {tuple(param.shape)}, not a 3-D expert weight"
            )
        weight = param.detach() if device is None else param.detach().to(device)
        storage = quantize_4bit(weight, quant_type)
        delattr(experts, name)
        experts.register_parameter(name, nn.Parameter(storage.packed, requires_grad=False))
        for part in _PARTS:
            value = getattr(storage, part)
            if value is not None:
                experts.register_buffer(f"{name}_{part}", _bits(value))
        record[name] = storage
        del weight, param
        done.append(name)
    if done and _HOOK not in experts.__dict__:
        experts.__dict__[_HOOK] = experts.register_forward_pre_hook(
            functools.partial(require_sloth_experts, "4 bits")
        )
    return done


@torch.no_grad()
def dequantize_experts(experts: nn.Module, dtype: torch.dtype = torch.float32) -> list[str]:
    """Undo :func:`quantize_experts` in place: each 4-bit expert weight becomes a dense frozen parameter.

    The weight is decoded as training decoded it (``code[q] * absmax`` in float32, rounded once to
    ``dtype``); the scale buffers and the guard on the forward go. Used to merge and export.

    Returns:
        The parameter names converted.
    """
    record = experts.__dict__.get(_RECORD, {})
    done = []
    for name in list(record):
        dense = dequantize_4bit_reference(expert_storage(experts, name), dtype)
        for part in _PARTS:
            if f"{name}_{part}" in experts._buffers:
                delattr(experts, f"{name}_{part}")
        delattr(experts, name)
        experts.register_parameter(name, nn.Parameter(dense, requires_grad=False))
        del record[name]
        done.append(name)
    handle = experts.__dict__.pop(_HOOK, None)
    if handle is not None and not record:
        handle.remove()
    return done


def expert_formats(state_dict: dict[str, Any]) -> dict[str, str]:
    """``{"<experts>.<weight>": quant_type}`` of the 4-bit expert weights a state dict stores.

    The format is read from the tensors themselves: the ``uint8`` weight beside its ``_absmax``,
    ``nf4-dq`` when the nested scales are there, else ``fp4`` or ``nf4`` by the code book.
    """
    fp4 = code_book("fp4")
    found = {}
    for key, value in state_dict.items():
        if not key.endswith(tuple(f".{w}" for w in EXPERT_WEIGHTS)):
            continue
        if not torch.is_tensor(value) or value.dtype != torch.uint8 or f"{key}_absmax" not in state_dict:
            continue
        if f"{key}_nested_absmax" in state_dict:
            found[key] = "nf4-dq"
            continue
        code = state_dict.get(f"{key}_code")
        is_fp4 = code is not None and torch.equal(code.reshape(-1).view(torch.float32).cpu(), fp4)
        found[key] = "fp4" if is_fp4 else "nf4"
    return found


def model_expert_formats(model: nn.Module) -> dict[str, str]:
    """``{"<experts>.<weight>": quant_type}`` of the expert weights ``model`` stores in 4 bits."""
    return {
        f"{name}.{weight}" if name else weight: storage.quant_type
        for name, module in model.named_modules()
        for weight, storage in module.__dict__.get(_RECORD, {}).items()
    }


def expert_storage(experts: nn.Module, name: str) -> Packed4bit | None:
    """The :class:`Packed4bit` of ``experts.<name>`` (sharing the module's tensors), or None if dense."""
    record = experts.__dict__.get(_RECORD, {}).get(name)
    if record is None:
        return None

    def part(key: str) -> Tensor | None:
        if getattr(record, key) is None:
            return None
        value = getattr(experts, f"{name}_{key}")
        return value.view(torch.float32) if value.dtype == torch.int32 else value

    offset = part("offset")
    return Packed4bit(
        packed=getattr(experts, name),
        absmax=part("absmax"),
        code=part("code"),
        shape=record.shape,
        dtype=record.dtype,
        quant_type=record.quant_type,
        blocksize=record.blocksize,
        nested_absmax=part("nested_absmax"),
        nested_code=part("nested_code"),
        offset=offset.reshape(()) if offset is not None else None,
    )


def _weight(packed, absmax, code, blocksize, shape, dtype) -> Tensor:
    experts, rows, cols = shape
    buffer = _scratch(experts * rows, cols, dtype, packed.device).view(experts, rows, cols)
    return dequantize_4bit_into(packed, absmax, code, blocksize, buffer)


@sloth_op("moe_lora_grouped_mm_4bit")
def _op(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    shape: list[int],
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    ends: Tensor,
    expert_ids: Tensor,
    transposed: bool,
) -> tuple[Tensor, Tensor]:
    """``(out [S, N], xa [S, r])`` of ``sloth::moe_lora_grouped_mm`` on the dequantised weight."""
    weight = _weight(packed, absmax, code, blocksize, shape, x.dtype)
    if not lora_a.shape[1]:  # no adapter: the plain grouped GEMM
        return _grouped_mm_op(x, weight, bias, ends, expert_ids, transposed), x.new_empty((x.shape[0], 0))
    return _lora_grouped_mm_op(x, weight, bias, lora_a, lora_b, scale, ends, expert_ids, transposed)


@_op.register_fake
def _fake(
    x, packed, absmax, code, blocksize, shape, bias, lora_a, lora_b, scale, ends, expert_ids, transposed
):
    n = shape[2] if transposed else shape[1]
    return x.new_empty((x.shape[0], n)), x.new_empty((x.shape[0], lora_a.shape[1]))


@sloth_op("moe_lora_grouped_mm_4bit_backward")
def _backward_op(
    grad: Tensor,
    x: Tensor,
    xa: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    shape: list[int],
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    ends: Tensor,
    transposed: bool,
    need_x: bool,
    need_a: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dA, dB)``; the weight is dequantised again (only when dx is asked for)."""
    if need_x:
        weight = _weight(packed, absmax, code, blocksize, shape, grad.dtype)
    else:  # dA and dB do not read the base weight
        weight = grad.new_empty((1, 1, 1)).expand(shape)
    if not lora_a.shape[1]:
        empty = grad.new_empty(0)
        dx = (
            _grouped_mm_backward_op(grad, empty, weight, ends, transposed, True, False)[0]
            if need_x
            else empty
        )
        return (
            dx,
            torch.empty_like(lora_a) if need_a else empty,
            torch.empty_like(lora_b) if need_b else empty,
        )
    dx, _, da, db = _lora_grouped_mm_backward_op(
        grad, x, xa, weight, lora_a, lora_b, scale, ends, transposed, need_x, False, need_a, need_b
    )
    return dx, da, db


@_backward_op.register_fake
def _backward_fake(
    grad,
    x,
    xa,
    packed,
    absmax,
    code,
    blocksize,
    shape,
    lora_a,
    lora_b,
    scale,
    ends,
    transposed,
    need_x,
    need_a,
    need_b,
):
    empty = grad.new_empty(0)
    return (
        grad.new_empty((grad.shape[0], shape[1] if transposed else shape[2])) if need_x else empty,
        lora_a.new_empty(lora_a.shape) if need_a else empty,
        lora_b.new_empty(lora_b.shape) if need_b else empty,
    )


def _setup(ctx, inputs, output):
    x, packed, absmax, code, blocksize, shape, bias, lora_a, lora_b, scale, ends, expert_ids, transposed = (
        inputs
    )
    ctx.mark_non_differentiable(output[1])
    # The input is kept only for dA: without an adapter (rank 0) it is not saved at all.
    ctx.save_for_backward(
        x if lora_a.shape[1] else None, output[1], packed, absmax, code, lora_a, lora_b, ends, expert_ids
    )
    ctx.blocksize, ctx.shape, ctx.scale, ctx.transposed = blocksize, list(shape), scale, transposed
    ctx.bias_shape = None if bias is None else tuple(bias.shape)


def _backward(ctx, grad, _grad_xa):
    x, xa, packed, absmax, code, lora_a, lora_b, ends, expert_ids = ctx.saved_tensors
    need = ctx.needs_input_grad
    if need[1] or need[2] or need[3]:
        raise RuntimeError(
            "sloth::moe_lora_grouped_mm_4bit: the 4-bit expert weight is frozen; it has no gradient"
        )
    grad = grad.contiguous()
    dx, da, db = call(
        _backward_op,
        grad, x if x is not None else grad.new_empty(0), xa, packed, absmax, code, ctx.blocksize, ctx.shape, lora_a, lora_b, ctx.scale, ends,
        ctx.transposed, need[0], need[7], need[8],
    )  # fmt: skip
    dbias = bias_grad(grad, expert_ids, ctx.bias_shape) if need[6] else None
    return (
        dx if need[0] else None, None, None, None, None, None, dbias,
        da if need[7] else None, db if need[8] else None, None, None, None, None,
    )  # fmt: skip


register_autograd(_op, _backward, _setup)
register_flops(
    _op,
    lambda x, packed, absmax, code, blocksize, shape, bias, a, b, scale, ends, ids, transposed, out_shape=None: (
        _lora_flops(x[0], shape, a) + math.prod(shape)
    ),
)
register_flops(
    _backward_op,
    lambda grad, x, xa, packed, absmax, code, blocksize, shape, a, b, scale, ends, transposed, nx, na, nb, out_shape=None: (
        int(nx) * (2 * grad[0] * shape[1] * shape[2] + math.prod(shape)) + 2 * _lora_flops(grad[0], shape, a)
    ),
)


def lora_grouped_mm_4bit(
    x: Tensor,
    storage: Packed4bit,
    lora_a: Tensor | None,
    lora_b: Tensor | None,
    scale: float,
    ends: Tensor,
    *,
    transposed: bool = False,
    bias: Tensor | None = None,
    expert_ids: Tensor | None = None,
) -> Tensor:
    """:func:`~lightning_sloth.moe.gemm.lora_grouped_mm` over a 4-bit ``[E, ., .]`` expert weight.

    Args:
        x: ``[S, in]`` rows in expert order (float16/bfloat16/float32); the GEMMs run in its dtype.
        storage: the frozen weight's 4-bit storage, shape ``[E, out, in]`` or (``transposed``) ``[E, in, out]``.
        lora_a, lora_b: ``[E, r, in]`` and ``[E, out, r]`` in x's dtype, or both None (no adapter).
        scale: the LoRA scaling.
        ends: int32 ``[E]`` cumulative row ends.
        transposed: the weight layout.
        bias: optional ``[E, out]``.
        expert_ids: int64 ``[S]`` expert of each row; needed with a bias.

    Returns:
        ``[S, out]`` in x's dtype; gradients reach x, lora_a, lora_b and bias, never the storage.
    """
    shape = [int(s) for s in storage.shape]
    if len(shape) != 3:
        raise ValueError(f"lora_grouped_mm_4bit takes a 3-D expert weight, got shape {tuple(shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"lora_grouped_mm_4bit computes in float16/bfloat16/float32, got {x.dtype}")
    n_in, n_out = (shape[1], shape[2]) if transposed else (shape[2], shape[1])
    if lora_a is None:
        lora_a = x.new_empty((shape[0], 0, n_in))
        lora_b = x.new_empty((shape[0], n_out, 0))
    rank = lora_a.shape[1]
    if (
        x.dim() != 2
        or x.shape[1] != n_in
        or lora_a.shape != (shape[0], rank, n_in)
        or lora_b.shape != (shape[0], n_out, rank)
        or ends.shape != (shape[0],)
    ):
        raise ValueError(
            f"lora_grouped_mm_4bit: x {tuple(x.shape)}, weight {tuple(shape)} (transposed={transposed}), "
            f"lora_a {tuple(lora_a.shape)} [E, r, in], lora_b {tuple(lora_b.shape)} [E, out, r], "
            f"ends {tuple(ends.shape)} do not fit"
        )
    if bias is not None and expert_ids is None:
        raise ValueError("lora_grouped_mm_4bit: a bias needs expert_ids")
    absmax = storage.block_absmax()
    _check_storage(storage.packed, absmax, storage.code, storage.blocksize, math.prod(shape))
    ids = expert_ids if expert_ids is not None else ends.new_zeros(0, dtype=torch.int64)
    out, _ = call(
        _op, x, storage.packed, absmax, storage.code, int(storage.blocksize), shape, bias,
        lora_a, lora_b.contiguous(), float(scale), ends, ids, transposed,
    )  # fmt: skip
    return out
