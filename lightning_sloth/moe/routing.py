"""Routing and grouping: which experts each token goes to, and the token rows sorted by expert.

Routers, per family, with transformers' exact semantics (probabilities in float32):

==========  ================================================================================
qwen3_moe   softmax(logits) in fp32 -> top-k -> renormalise if ``norm_topk_prob``; weights in
            the logits' dtype
mixtral     softmax(logits) in fp32 -> top-k -> renormalise; weights stay float32
gpt_oss     top-k of the logits (bias included) -> softmax over the k values
==========  ================================================================================

Grouping (:func:`group_by_expert`) runs once per layer call and only on the device: a stable sort
of the flattened ``[T * k]`` expert ids, the per-expert row ends by one ``searchsorted`` of the
sorted ids against ``0..E-1`` (int32, the form grouped GEMMs take), counts as their difference, and
the inverse permutation by one scatter. No ``.item()``, ``.tolist()``, ``nonzero()`` or branch on
a count: a training step stays free of device-to-host syncs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ROUTERS",
    "Grouping",
    "group_by_expert",
    "route_softmax_topk",
    "route_topk_softmax",
    "router_logits",
]


class Grouping(NamedTuple):
    """Rows ``S = T * k`` (slot ``t * k + j`` is token t's j-th choice) in expert order.

    Attributes:
        perm: int64 ``[S]`` sorted position -> slot (stable: a token's slots keep their order).
        inv: int64 ``[S]`` slot -> sorted position.
        expert_ids: int64 ``[S]`` expert of each sorted row (non-decreasing).
        ends: int32 ``[E]`` cumulative row ends per expert (``ends[-1] == S``).
        counts: int32 ``[E]`` rows per expert (zero for an expert no token chose).
    """

    perm: Tensor
    inv: Tensor
    expert_ids: Tensor
    ends: Tensor
    counts: Tensor


def group_by_expert(top_k_index: Tensor, num_experts: int) -> Grouping:
    """Sort the routed rows by expert, on the device, without a host sync.

    Args:
        top_k_index: ``[T, k]`` integer expert ids in ``[0, num_experts)``.
        num_experts: E.

    Returns:
        The :class:`Grouping`.
    """
    flat = top_k_index.reshape(-1)
    expert_ids, perm = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=expert_ids.dtype)
    ends = torch.searchsorted(expert_ids, experts, right=True, out_int32=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    positions = torch.arange(flat.shape[0], device=flat.device)
    inv = torch.empty_like(perm).scatter_(0, perm, positions)
    return Grouping(perm, inv, expert_ids.to(torch.int64), ends, counts)


def router_logits(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``[T, E]`` router logits computed in float32 (autocast off), whatever the model's dtype.

    A bf16 logit carries 8 bits of mantissa, so near-tied experts are chosen by rounding; the
    router's GEMM is small (``E`` columns), so float32 costs little. Gradients flow to the
    hidden states and the router's weight and bias in their own dtypes.
    """
    with torch.autocast(hidden_states.device.type, enabled=False):
        return torch.nn.functional.linear(
            hidden_states.float(), weight.float(), None if bias is None else bias.float()
        )


def route_softmax_topk(
    logits: Tensor, top_k: int, normalize: bool, keep_float32: bool
) -> tuple[Tensor, Tensor]:
    """Qwen3-MoE / Mixtral router: softmax in fp32, top-k, optional renormalisation.

    Args:
        logits: ``[T, E]`` router logits.
        top_k: experts per token.
        normalize: divide the k weights by their sum.
        keep_float32: return float32 weights (Mixtral) instead of the logits' dtype (Qwen3-MoE).

    Returns:
        ``(weights [T, k], index [T, k])``.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if keep_float32 else weights.to(logits.dtype)), index


def route_topk_softmax(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """GPT-OSS router: top-k of the logits, then softmax over those k (in the logits' dtype)."""
    values, index = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), index


ROUTERS = {
    "qwen3_moe": lambda logits, config: route_softmax_topk(
        logits, config.num_experts_per_tok, bool(config.norm_topk_prob), keep_float32=False
    ),
    "mixtral": lambda logits, config: route_softmax_topk(
        logits, config.num_experts_per_tok, True, keep_float32=True
    ),
    "gpt_oss": lambda logits, config: route_topk_softmax(logits, config.num_experts_per_tok),
}
"""``model_type`` -> ``router(logits [T, E], config) -> (weights [T, k], index [T, k])``."""
