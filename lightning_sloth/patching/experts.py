"""``apply_experts``: select the "sloth" experts (``lightning_sloth.moe``) for a MoE model, per the table.

Two ways in, by the family's row (:data:`~lightning_sloth.patching.families.FAMILIES`):

- ``experts`` + ``routers`` (Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, GPT-OSS, GLM-4-MoE,
  DeepSeek-V3): the experts dispatch through transformers' ``ExpertsInterface``, so "sloth" is
  selected there; each router gets :func:`router_forward` (float32 logits, the family's rule). The
  block around them (shared experts, their sigmoid gate, the sum) stays transformers' own.
- ``moe_blocks`` (Llama 4): the block runs every expert on every token as one ``bmm`` and never
  dispatches, so the block itself gets :func:`scaled_input_block_forward`: float32 router, then
  :func:`~lightning_sloth.moe.experts_forward` over the routed rows only, plus the shared expert.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_sloth.hf_model import base_model
from lightning_sloth.moe import (
    EXPERTS_NAME,
    experts_forward,
    install_lora_experts,
    register,
    uninstall_lora_experts,
)
from lightning_sloth.moe.layouts import experts_model_type
from lightning_sloth.moe.peft import experts_and_lora
from lightning_sloth.moe.router import fused_router_rule, route_topk
from lightning_sloth.moe.routing import ROUTERS, router_logits
from lightning_sloth.moe.switch import FUSED_ATTR, fused_permutation_setting
from lightning_sloth.patching import _forwards
from lightning_sloth.patching.families import FAMILIES, Family

log = logging.getLogger(__name__)

__all__ = [
    "ExpertsReport",
    "apply_experts",
    "install_router",
    "moe_families",
    "router_forward",
    "scaled_input_block_forward",
    "uninstall_router",
]

_MOE_OPS = ("moe_router", "moe_block")


def moe_families() -> list[str]:
    """``model_type`` of every family whose experts the table routes to ``lightning_sloth.moe``."""
    return sorted(name for name, family in FAMILIES.items() if family.experts)


@dataclass
class ExpertsReport:
    """What :func:`apply_experts` did.

    Attributes:
        model_type: ``config.model_type``.
        implementation: the experts implementation selected now (None for a dense model).
        experts: qualified names of the experts modules.
        lora: qualified names of the PEFT wrappers whose LoRA runs inside the grouped GEMMs.
        routers: qualified names of the routers computing their logits in float32.
        blocks: qualified names of the MoE blocks whose forward routes and calls the experts itself.
        fused: the token permutation runs inside the grouped GEMMs for this model (``"fused"``);
            False with ``"separate"`` or True (then the process-wide switch decides: by default,
            fused on CUDA).
        permutation: where the token permutation runs for this model: ``"fused"``, ``"separate"``
            or ``"fused on CUDA"`` (the process-wide switch's default).
    """

    model_type: str | None
    implementation: str | None = None
    experts: list[str] = field(default_factory=list)
    lora: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    fused: bool = False
    permutation: str = "fused on CUDA"


def _is_experts(module: nn.Module) -> bool:
    # transformers' use_experts_implementation decorator sets these flags on every experts module
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "num_experts")


def _experts_family(base: nn.Module, model_type: str | None) -> tuple[list, Family | None, str | None]:
    """The experts modules, and the table row and ``model_type`` that describe them.

    The row comes from the model's ``model_type``, else from the experts' own (a multimodal wrapper
    around a text MoE, e.g. Qwen3.5-MoE's ``qwen3_5_moe`` around ``qwen3_5_moe_text``).
    """
    configless = tuple(
        cls for family in FAMILIES.values() if family.moe_blocks for cls in family.classes(family.experts)
    )
    experts = [(name, m) for name, m in base.named_modules() if _is_experts(m) or isinstance(m, configless)]
    family = FAMILIES.get(model_type)
    if experts and (family is None or not family.experts):
        inner = experts_model_type(experts[0][1])
        if FAMILIES.get(inner) is not None and FAMILIES[inner].experts:
            return experts, FAMILIES[inner], inner
    return experts, family, model_type


def apply_experts(model: nn.Module, enabled: bool | str = True) -> ExpertsReport:
    """Select the "sloth" experts implementation for a transformers MoE model, in place.

    Registers "sloth" in transformers' ``ExpertsInterface``, sets it on the model (and its config),
    routes PEFT ``target_parameters`` LoRA on the experts through the grouped computation and
    gives the family's routers float32 logits (same routing rule as transformers'); a family whose
    block never dispatches its experts (Llama 4) gets the block forward instead. With
    ``enabled=False`` a model set to "sloth" goes back to transformers' ``grouped_mm``, and the
    PEFT wrappers, routers and blocks get their own forwards back. A dense model is left as it is.

    Args:
        model: a transformers ``PreTrainedModel``, a PEFT model around one, or a module holding one.
        enabled: select (True) or deselect (False) the "sloth" experts; ``"fused"`` selects them
            with the token permutation inside the grouped GEMMs for this model's experts
            (:mod:`lightning_sloth.moe.fused`), ``"separate"`` with separate gather and combine
            passes; True leaves it to the process-wide switch (:mod:`lightning_sloth.moe.switch`:
            by default fused where the rows are on CUDA).

    Returns:
        The :class:`ExpertsReport` (also logged at INFO).

    Raises:
        NotImplementedError: the model has MoE experts of a family the table does not support
            (names the family and the supported list).
        ValueError: ``num_experts_per_tok`` exceeds the number of experts, or ``enabled`` is none of
            True, False, ``"fused"`` and ``"separate"``.
    """
    if not (isinstance(enabled, bool) or enabled in ("fused", "separate")):
        raise ValueError(f"moe must be true, false, 'fused' or 'separate', got {enabled!r}")
    base = base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    report = ExpertsReport(model_type=model_type)
    experts, family, moe_type = _experts_family(base, model_type)
    if not experts:
        return report
    report.experts = [name for name, _ in experts]
    for _, module in experts:  # the model's own choice of the permutation path, or none
        if enabled in ("fused", "separate"):
            setattr(module, FUSED_ATTR, enabled == "fused")
        elif hasattr(module, FUSED_ATTR):
            delattr(module, FUSED_ATTR)
    report.fused = enabled == "fused"
    if enabled in ("fused", "separate"):
        report.permutation = enabled
    else:
        report.permutation = {None: "fused on CUDA", True: "fused", False: "separate"}[
            fused_permutation_setting()
        ]
    uninstall_lora_experts(base)
    for module in base.modules():
        if _forwards.patched_op(module) in _MOE_OPS:
            _forwards.restore(module)
    if not enabled:
        if config._experts_implementation == EXPERTS_NAME:
            base.set_experts_implementation("grouped_mm")
        report.implementation = config._experts_implementation
        return report
    if family is None or not family.experts:
        raise NotImplementedError(
            f"lightning_sloth's MoE experts do not support model family {model_type!r} "
            f"({type(base).__name__}); supported: {moe_families()}. Use moe=False to keep "
            f"transformers' experts implementation."
        )
    first = experts[0][1]
    moe_config = getattr(first, "config", None) or config.get_text_config()
    top_k = getattr(moe_config, "num_experts_per_tok", None)
    if top_k is not None and top_k > first.num_experts:
        raise ValueError(
            f"{moe_type}: num_experts_per_tok={top_k} exceeds the {first.num_experts} experts per layer"
        )
    register()
    if not family.moe_blocks:
        base.set_experts_implementation(EXPERTS_NAME)
    report.lora = install_lora_experts(base)
    routers, blocks = family.classes(family.routers), family.classes(family.moe_blocks)
    for name, module in base.named_modules():
        kind = "routers" if isinstance(module, routers) else "blocks" if isinstance(module, blocks) else None
        if kind is None or _forwards.has_foreign_forward(module):
            continue
        if kind == "routers":
            install_router(module, moe_type, moe_config)
        else:
            module._sloth_model_type, module._sloth_config = moe_type, moe_config
            _forwards.install(module, scaled_input_block_forward)
        getattr(report, kind).append(name)
    report.implementation = EXPERTS_NAME if report.blocks else config._experts_implementation
    log.info(
        "lightning_sloth experts: %s x%d, token permutation %s (%d with LoRA inside the grouped GEMMs), "
        "float32 routers x%d, MoE blocks x%d",
        moe_type,
        len(report.experts),
        report.permutation,
        len(report.lora),
        len(report.routers),
        len(report.blocks),
    )
    return report


def install_router(router: nn.Module, model_type: str, config) -> None:
    """Give one top-k router :func:`router_forward` (what :func:`apply_experts` does to each router of
    a model): float32 logits and the family's rule, one ``sloth::moe_router_topk`` op where it applies.

    Args:
        router: a router module of the family (``weight [E, H]``, optional ``bias``, ``hidden_dim``).
        model_type: the family's ``model_type`` (a key of ``lightning_sloth.moe.ROUTERS``).
        config: the experts' (text) config (``num_experts_per_tok`` and the family's routing fields).

    Raises:
        NotImplementedError: a family without a router rule.
    """
    if model_type not in ROUTERS:
        raise NotImplementedError(f"no router rule for model type {model_type!r}; known: {sorted(ROUTERS)}")
    router._sloth_model_type, router._sloth_config = model_type, config
    _forwards.install(router, router_forward)


def uninstall_router(router: nn.Module) -> bool:
    """Give a router its class's forward back; whether :func:`install_router` had been applied."""
    if _forwards.patched_op(router) != "moe_router":
        return False
    _forwards.restore(router)
    return True


@_forwards._op_forward("moe_router")
def router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A transformers top-k router's forward with float32 logits and the family's routing.

    Returns ``(router_logits [T, E] float32, weights [T, k], index [T, k])`` like the class's.
    """
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    bias = getattr(self, "bias", None)
    rule = fused_router_rule(self._sloth_model_type, self._sloth_config)
    if rule is not None:  # one op (one kernel on CUDA): the GEMM, the top k and the weights
        return route_topk(hidden_states, self.weight, bias, self._sloth_config.num_experts_per_tok, *rule)
    logits = router_logits(hidden_states, self.weight, bias)
    weights, index = ROUTERS[self._sloth_model_type](logits, self._sloth_config, self)
    return logits, weights, index


@_forwards._op_forward("moe_block")
def scaled_input_block_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """Llama 4's MoE block over the routed rows only.

    transformers' block scores all ``E`` experts per token (``sigmoid`` of the top-k logits, 0
    elsewhere), multiplies a copy of every token by each expert's score and runs all ``E x T`` rows
    through the experts. An expert given a zero row returns zero (no biases, ``act(0) * 0 = 0``),
    so only the k routed rows per token count: they are grouped, scaled by their weight and run
    through the grouped GEMMs (:func:`~lightning_sloth.moe.experts_forward`), then the shared
    expert's output is added.

    Returns:
        ``(out [T, H], router_logits [T, E] float32)`` like the class's (the decoder layer keeps
        ``out``). A router or experts module outside the plain case (PEFT LoRA on the router,
        several adapters on the experts, another library's forward) runs the class's forward.
    """
    x = hidden_states.reshape(-1, self.hidden_dim)
    experts, lora = experts_and_lora(self.experts)
    router = self.router
    if lora is None or not isinstance(router, nn.Linear) or _forwards.has_foreign_forward(router):
        return type(self).forward(self, hidden_states)
    logits = router_logits(x, router.weight, router.bias)
    weights, index = ROUTERS[self._sloth_model_type](logits, self._sloth_config, router)
    routed = experts_forward(experts, x, index, weights, lora)
    return self.shared_expert(x) + routed, logits
