"""The "sloth" experts implementation: the grouped expert forward and LoRA on the experts.

transformers 5.x keeps a MoE layer's experts as one module with 3-D weights and dispatches its
forward through ``ExpertsInterface`` by ``config._experts_implementation``. :func:`register` adds
"sloth" there; the function receives ``(experts, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])`` from transformers' own router and block.

The family layouts are in :mod:`lightning_sloth.moe.layouts`. Llama 4's MoE block does not dispatch
through ``ExpertsInterface`` (its experts run every token as one ``bmm``); its block forward
(``lightning_sloth.patching``) routes and calls :func:`experts_forward` itself, which then scales
each gathered input row by its routing weight (``ExpertLayout.scaled_input``).

LoRA on the experts (PEFT's ``target_parameters``) never builds a delta weight: with factors
``A_e [r, in]``, ``B_e [out, r]`` and scale ``s`` the projection is computed as
``x W_e + s (x A_e^T) B_e^T`` by two more grouped GEMMs of rank r, so gradients reach A and B only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sloth.moe.fp8 import expert_fp8_storage, has_fp8_experts, lora_grouped_mm_fp8
from lightning_sloth.moe.fused import (
    fused_permutation_enabled,
    gather_lora_grouped_mm,
    lora_grouped_mm_combine,
)
from lightning_sloth.moe.gemm import grouped_mm, lora_grouped_mm
from lightning_sloth.moe.layouts import ENDS_ATTR, EXPERTS_NAME, LAYOUTS, ExpertLayout, layout_of
from lightning_sloth.moe.ops import clamped_swiglu, moe_combine, moe_gather, moe_sum, weighted_swiglu
from lightning_sloth.moe.quant import expert_storage, lora_grouped_mm_4bit
from lightning_sloth.moe.routing import group_by_expert

__all__ = [
    "EXPERTS_NAME",
    "LAYOUTS",
    "ExpertLayout",
    "LoraFactors",
    "experts_forward",
    "layout_of",
    "register",
]

_SILU = ("silu", "swish")


@dataclass(frozen=True)
class LoraFactors:
    """Per-expert LoRA factors of one 3-D weight.

    Attributes:
        a: ``[E, r, in]``.
        b: ``[E, out, r]``.
        scale: ``lora_alpha / r`` (or ``/ sqrt(r)`` for rsLoRA).
    """

    a: Tensor
    b: Tensor
    scale: float


def _compute_dtype(hidden_states: Tensor, weight: Tensor) -> torch.dtype:
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    # 4-bit storage (uint8 codes) computes in the activations' dtype
    return weight.dtype if weight.is_floating_point() else hidden_states.dtype


def _factors(lora: LoraFactors | None, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None, float]:
    """``(A, B, scale)`` in ``dtype`` for the grouped LoRA ops, ``(None, None, 0.0)`` without LoRA."""
    return (None, None, 0.0) if lora is None else (lora.a.to(dtype), lora.b.to(dtype), lora.scale)


def _project(
    x: Tensor,
    experts: nn.Module,
    name: str,
    bias: Tensor | None,
    grouping,
    transposed: bool,
    lora: LoraFactors | None,
) -> Tensor:
    dtype = x.dtype
    bias = None if bias is None else bias.to(dtype)
    weight = getattr(experts, name)
    fp8 = expert_fp8_storage(experts, name)
    if fp8 is not None:  # FP8 e4m3 codes with per-channel scales (lightning_sloth.moe.fp8)
        return lora_grouped_mm_fp8(
            x, fp8, *_factors(lora, dtype), grouping.ends, bias=bias, expert_ids=grouping.expert_ids
        )
    storage = expert_storage(experts, name)
    if storage is not None:  # 4-bit: dequantised into a reusable buffer inside the op
        return lora_grouped_mm_4bit(
            x,
            storage,
            *_factors(lora, dtype),
            grouping.ends,
            transposed=transposed,
            bias=bias,
            expert_ids=grouping.expert_ids,
        )
    if lora is None:
        return grouped_mm(
            x,
            weight.to(dtype),
            grouping.ends,
            transposed=transposed,
            bias=bias,
            expert_ids=grouping.expert_ids,
        )
    return lora_grouped_mm(
        x,
        weight.to(dtype),
        lora.a.to(dtype),
        lora.b.to(dtype),
        lora.scale,
        grouping.ends,
        transposed=transposed,
        bias=bias,
        expert_ids=grouping.expert_ids,
    )


def _fused_project(
    x: Tensor,
    experts: nn.Module,
    name: str,
    bias: Tensor | None,
    grouping,
    transposed: bool,
    lora: LoraFactors | None,
    top_k: int,
    weights: Tensor | None = None,
    first: bool = True,
) -> Tensor:
    """The first projection reading token rows through ``perm`` (x ``[T, in]``), or the second writing
    through it and summing per token (x ``[S, in]``, weighted by ``weights`` unless None)."""
    dtype = x.dtype
    storage = expert_storage(experts, name)
    weight = None if storage is not None else getattr(experts, name).to(dtype)
    args = (*_factors(lora, dtype), grouping.ends)
    kwargs = dict(
        storage=storage,
        transposed=transposed,
        bias=None if bias is None else bias.to(dtype),
        expert_ids=grouping.expert_ids,
    )
    if first:
        return gather_lora_grouped_mm(x, grouping.perm, top_k, weight, *args, **kwargs)
    return lora_grouped_mm_combine(x, weights, grouping.perm, top_k, weight, *args, **kwargs)


def _activate(experts: nn.Module, layout: ExpertLayout, h: Tensor) -> Tensor:
    if layout.clamped:
        return clamped_swiglu(h, experts.alpha, experts.limit)
    gate, up = h.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def experts_forward(
    experts: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    lora: dict[str, LoraFactors] | None = None,
) -> Tensor:
    """One MoE layer's experts: gather into expert order, two grouped GEMMs, combine in fp32.

    Registered as "sloth" in ``ExpertsInterface`` (called as ``fn(experts, hidden_states,
    top_k_index, top_k_weights)``).

    Args:
        experts: a transformers experts module of a family in :data:`LAYOUTS`.
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, k]`` integer expert ids from the router.
        top_k_weights: ``[T, k]`` routing weights (their gradient reaches the router).
        lora: optional ``{"gate_up_proj": LoraFactors, "down_proj": LoraFactors}`` (either may be absent).

    Returns:
        ``[T, H]`` in hidden_states' dtype.

    Raises:
        ValueError: more experts per token than experts, or mismatched shapes.
        NotImplementedError: an unsupported family.
    """
    layout = layout_of(experts)
    num_experts = experts.num_experts
    tokens, top_k = top_k_index.shape
    if top_k > num_experts:
        raise ValueError(
            f"top_k={top_k} experts per token exceeds the {num_experts} experts of {type(experts).__name__}"
        )
    if top_k_weights.shape != top_k_index.shape or hidden_states.shape[0] != tokens:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)}, top_k_index {tuple(top_k_index.shape)} and "
            f"top_k_weights {tuple(top_k_weights.shape)} do not describe the same tokens"
        )
    lora = lora or {}
    dtype = _compute_dtype(hidden_states, experts.gate_up_proj)
    grouping = group_by_expert(top_k_index, num_experts)
    setattr(experts, ENDS_ATTR, grouping.ends)

    # Intermediates are not kept in locals longer than needed: autograd keeps what the backward
    # needs, and a local would hold e.g. the [S, H] gathered rows through the whole layer.
    # Without biases the down projection is linear, so the routing weights may scale its input:
    # the router's gradient then needs only the activation's input, not the [S, H] expert outputs.
    activation = getattr(getattr(experts, "config", None), "hidden_act", None)
    weight_first = not (layout.bias or layout.clamped or layout.scaled_input) and activation in _SILU
    fused = fused_permutation_enabled(experts, hidden_states.device)
    if fused and not layout.scaled_input and not has_fp8_experts(experts):
        # The gather and the combine run inside the GEMMs (lightning_sloth.moe.fused); its Triton
        # GEMMs are 16-bit, so FP8 experts take the separate passes.
        h = _fused_project(
            hidden_states.to(dtype),
            experts,
            "gate_up_proj",
            experts.gate_up_proj_bias if layout.bias else None,
            grouping,
            layout.transposed,
            lora.get("gate_up_proj"),
            top_k,
        )
        a = (
            weighted_swiglu(h, top_k_weights, grouping.perm)
            if weight_first
            else _activate(experts, layout, h)
        )
        del h
        out = _fused_project(
            a,
            experts,
            "down_proj",
            experts.down_proj_bias if layout.bias else None,
            grouping,
            layout.transposed,
            lora.get("down_proj"),
            top_k,
            None if weight_first else top_k_weights,
            first=False,
        )
        return out.to(hidden_states.dtype)
    x = moe_gather(hidden_states.to(dtype), grouping.perm, grouping.inv, top_k)
    if layout.scaled_input:
        # Llama 4: expert(w x). The weight is rounded to the rows' dtype first, as transformers'
        # routed_in = x * scores (both in the model's dtype) rounds it.
        x = x * top_k_weights.reshape(-1).index_select(0, grouping.perm).to(dtype)[:, None]
    h = _project(
        x,
        experts,
        "gate_up_proj",
        experts.gate_up_proj_bias if layout.bias else None,
        grouping,
        layout.transposed,
        lora.get("gate_up_proj"),
    )
    if weight_first:
        a = weighted_swiglu(h, top_k_weights, grouping.perm)
    else:
        a = _activate(experts, layout, h)
    del h, x
    y = _project(
        a,
        experts,
        "down_proj",
        experts.down_proj_bias if layout.bias else None,
        grouping,
        layout.transposed,
        lora.get("down_proj"),
    )
    del a
    if weight_first or layout.scaled_input:
        out = moe_sum(y, grouping.perm, grouping.inv, top_k)
    else:
        out = moe_combine(y, top_k_weights, grouping.perm, grouping.inv)
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register :func:`experts_forward` as "sloth" in transformers' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_NAME, experts_forward)
