"""Routing and grouping: which experts each token goes to, and the token rows sorted by expert.

Routers, per family, with transformers' exact rules (scores in float32):

===================  =======================================================================
qwen3_moe,           softmax(logits) in fp32 -> top-k -> renormalise if ``norm_topk_prob``;
qwen2_moe,           weights in the logits' dtype (Qwen3.5-MoE always renormalises)
qwen3_next,
qwen3_5_moe_text
mixtral              softmax(logits) in fp32 -> top-k -> renormalise; weights stay float32
gpt_oss              top-k of the logits (bias included) -> softmax over the k values
glm4_moe,            s = sigmoid(logits); choice = s + ``e_score_correction_bias``; the E experts
deepseek_v3          in ``n_group`` groups, each scored by the sum of its two best choices; the
                     ``topk_group`` best groups stay, the others are masked to -inf; top-k of
                     the choice; weights = s at those experts (not the bias-corrected choice),
                     renormalised (sum + 1e-20) if ``norm_topk_prob``, times
                     ``routed_scaling_factor``; weights float32
llama4_text          top-k of the logits; weights = sigmoid(those logits) (the block scales each
                     expert's input by its weight)
===================  =======================================================================

Every rule is a handful of device ops on ``[T, E]`` (softmax/sigmoid, ``topk``, ``scatter``,
``masked_fill``, ``gather``) with shapes fixed by the config: no host sync.

Grouping (:func:`group_by_expert`) runs once per layer call and only on the device: a stable sort
of the flattened ``[T * k]`` expert ids (as ``uint8`` keys up to 256 experts, ``int16`` up to 32,768:
one or two radix passes where ``int64`` keys take eight, a dozen fewer launches on the host's
critical path before the first expert GEMM), the per-expert row ends by one ``searchsorted`` of the
sorted ids against ``0..E-1`` (int32, the form grouped GEMMs take), counts as their difference, and
the inverse permutation by one scatter. No ``.item()``, ``.tolist()``, ``nonzero()`` or branch on
a count: a training step stays free of device-to-host syncs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "ROUTERS",
    "Grouping",
    "counts_from_ends",
    "group_by_expert",
    "inverse_permutation",
    "route_sigmoid_group_topk",
    "route_softmax_topk",
    "route_topk_sigmoid",
    "route_topk_softmax",
    "router_logits",
    "sort_key_dtype",
]


class Grouping:
    """Rows ``S = T * k`` (slot ``t * k + j`` is token t's j-th choice) in expert order.

    ``inv`` and ``counts`` are made on first use (the fused permutation needs neither, and each is a
    few kernel launches on the host's critical path before the first expert GEMM).

    Attributes:
        perm: int64 ``[S]`` sorted position -> slot (stable: a token's slots keep their order).
        inv: int64 ``[S]`` slot -> sorted position.
        expert_ids: int64 ``[S]`` expert of each sorted row (non-decreasing).
        ends: int32 ``[E]`` cumulative row ends per expert (``ends[-1] == S``).
        counts: int32 ``[E]`` rows per expert (zero for an expert no token chose).
    """

    def __init__(self, perm: Tensor, expert_ids: Tensor, ends: Tensor) -> None:
        self.perm, self.ends = perm, ends
        self._sorted_ids = expert_ids  # any integer dtype (the sort's narrow keys): int64 on first use
        self._inv: Tensor | None = None
        self._counts: Tensor | None = None

    @property
    def expert_ids(self) -> Tensor:
        if self._sorted_ids.dtype != torch.int64:
            self._sorted_ids = self._sorted_ids.to(torch.int64)
        return self._sorted_ids

    @property
    def inv(self) -> Tensor:
        if self._inv is None:
            self._inv = inverse_permutation(self.perm)
        return self._inv

    @property
    def counts(self) -> Tensor:
        if self._counts is None:
            self._counts = counts_from_ends(self.ends)
        return self._counts


def group_by_expert(top_k_index: Tensor, num_experts: int) -> Grouping:
    """Sort the routed rows by expert, on the device, without a host sync.

    Args:
        top_k_index: ``[T, k]`` integer expert ids in ``[0, num_experts)``.
        num_experts: E.

    Returns:
        The :class:`Grouping`.
    """
    flat = top_k_index.reshape(-1)
    keys = flat.to(sort_key_dtype(num_experts))
    sorted_ids, perm = torch.sort(keys, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return Grouping(perm, sorted_ids, ends)


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The sort's key dtype for expert ids ``0..num_experts-1``: ``uint8`` or ``int16`` where they fit, else ``int64``."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int64


def counts_from_ends(ends: Tensor) -> Tensor:
    """Rows per expert from the cumulative row ends (same dtype)."""
    return torch.diff(ends, prepend=ends.new_zeros(1))


def inverse_permutation(perm: Tensor) -> Tensor:
    """``inv[perm[s]] = s``: the sorted position of each slot (a device op, no host sync)."""
    positions = torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype)
    return torch.empty_like(perm).scatter_(0, perm, positions)


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


def route_sigmoid_group_topk(
    logits: Tensor,
    top_k: int,
    correction_bias: Tensor,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """GLM-4-MoE / DeepSeek-V3 router: sigmoid scores, group-limited top-k, routed scaling.

    Args:
        logits: ``[T, E]`` router logits (float32).
        top_k: experts per token.
        correction_bias: ``[E]`` ``e_score_correction_bias``, added for the choice only.
        n_group: expert groups (``E % n_group == 0``, at least two experts per group).
        topk_group: groups a token may choose from.
        normalize: divide the k weights by their sum (+ 1e-20).
        scaling: ``routed_scaling_factor``.

    Returns:
        ``(weights [T, k] in the scores' dtype, index [T, k])``.
    """
    experts = logits.shape[-1]
    if experts % n_group or experts // n_group < 2 or not 0 < topk_group <= n_group:
        raise ValueError(
            f"group-limited routing needs n_group ({n_group}) to divide the {experts} experts into groups of at "
            f"least two and 0 < topk_group ({topk_group}) <= n_group"
        )
    scores = logits.sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    index = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, index


def route_topk_sigmoid(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Llama 4 router: top-k of the logits, weights ``sigmoid`` of those logits in float32.

    transformers scatters the k logits into a ``[T, E]`` row of -inf and takes the sigmoid of the
    row, so every other expert gets weight ``sigmoid(-inf) = 0`` (and a zero input row); the k
    weights here are the same values.
    """
    values, index = torch.topk(logits, top_k, dim=-1)
    return torch.sigmoid(values.float()), index


def _group_limited(logits: Tensor, config, router) -> tuple[Tensor, Tensor]:
    if router is None:
        raise ValueError("the group-limited router reads e_score_correction_bias from the router module")
    return route_sigmoid_group_topk(
        logits,
        config.num_experts_per_tok,
        router.e_score_correction_bias,
        config.n_group,
        config.topk_group,
        bool(config.norm_topk_prob),
        float(config.routed_scaling_factor),
    )


def _softmax_topk(normalize, keep_float32: bool = False):
    def route(logits: Tensor, config, router=None) -> tuple[Tensor, Tensor]:
        norm = normalize if isinstance(normalize, bool) else bool(getattr(config, normalize))
        return route_softmax_topk(logits, config.num_experts_per_tok, norm, keep_float32)

    return route


ROUTERS = {
    "qwen3_moe": _softmax_topk("norm_topk_prob"),
    "mixtral": _softmax_topk(True, keep_float32=True),
    "gpt_oss": lambda logits, config, router=None: route_topk_softmax(logits, config.num_experts_per_tok),
    "qwen2_moe": _softmax_topk("norm_topk_prob"),
    "qwen3_next": _softmax_topk("norm_topk_prob"),
    "qwen3_5_moe_text": _softmax_topk(True),
    "glm4_moe": _group_limited,
    "deepseek_v3": _group_limited,
    "llama4_text": lambda logits, config, router=None: route_topk_sigmoid(logits, config.num_experts_per_tok),
}
"""``model_type`` -> ``router(logits [T, E], config, router_module=None) -> (weights [T, k], index [T, k])``.

``config`` is the experts' (text) config; the module supplies state beyond it (the score
correction bias)."""
