"""``apply_experts``: select the "sloth" experts (``lightning_sloth.moe``) for a MoE model, per the table."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_sloth.hf_model import base_model
from lightning_sloth.moe import EXPERTS_NAME, install_lora_experts, register, uninstall_lora_experts
from lightning_sloth.moe.routing import ROUTERS, router_logits
from lightning_sloth.patching import _forwards
from lightning_sloth.patching.families import FAMILIES

log = logging.getLogger(__name__)

__all__ = ["ExpertsReport", "apply_experts", "moe_families", "router_forward"]


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
    """

    model_type: str | None
    implementation: str | None = None
    experts: list[str] = field(default_factory=list)
    lora: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)


def _is_experts(module: nn.Module) -> bool:
    # transformers' use_experts_implementation decorator sets these flags on every experts module
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "num_experts")


def apply_experts(model: nn.Module, enabled: bool = True) -> ExpertsReport:
    """Select the "sloth" experts implementation for a transformers MoE model, in place.

    Registers "sloth" in transformers' ``ExpertsInterface``, sets it on the model (and its config),
    routes PEFT ``target_parameters`` LoRA on the experts through the grouped computation and
    gives the family's routers float32 logits (same routing rule as transformers').
    With ``enabled=False`` a model set to "sloth" goes back to transformers' ``grouped_mm``, and the
    PEFT wrappers and routers get their own forwards back. A dense model is left as it is.

    Args:
        model: a transformers ``PreTrainedModel``, a PEFT model around one, or a module holding one.
        enabled: select (True) or deselect (False) the "sloth" experts.

    Returns:
        The :class:`ExpertsReport` (also logged at INFO).

    Raises:
        NotImplementedError: the model has MoE experts of a family the table does not support
            (names the family and the supported list).
        ValueError: ``num_experts_per_tok`` exceeds the number of experts.
    """
    base = base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    report = ExpertsReport(model_type=model_type)
    experts = [(name, m) for name, m in base.named_modules() if _is_experts(m)]
    if not experts:
        return report
    report.experts = [name for name, _ in experts]
    family = FAMILIES.get(model_type)
    uninstall_lora_experts(base)
    for module in base.modules():
        if _forwards.patched_op(module) == "moe_router":
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
    top_k = getattr(config, "num_experts_per_tok", None)
    num_experts = experts[0][1].num_experts
    if top_k is not None and top_k > num_experts:
        raise ValueError(
            f"{model_type}: num_experts_per_tok={top_k} exceeds the {num_experts} experts per layer"
        )
    register()
    base.set_experts_implementation(EXPERTS_NAME)
    report.implementation = config._experts_implementation
    report.lora = install_lora_experts(base)
    routers = family.classes(family.routers)
    for name, module in base.named_modules():
        if isinstance(module, routers) and not _forwards.has_foreign_forward(module):
            module._sloth_model_type, module._sloth_config = model_type, config
            _forwards.install(module, router_forward)
            report.routers.append(name)
    log.info(
        "lightning_sloth experts: %s x%d (%d with LoRA inside the grouped GEMMs), float32 routers x%d",
        model_type,
        len(report.experts),
        len(report.lora),
        len(report.routers),
    )
    return report


@_forwards._op_forward("moe_router")
def router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A transformers top-k router's forward with float32 logits and the family's routing.

    Returns ``(router_logits [T, E] float32, weights [T, k], index [T, k])`` like the class's.
    """
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = router_logits(hidden_states, self.weight, getattr(self, "bias", None))
    weights, index = ROUTERS[self._sloth_model_type](logits, self._sloth_config)
    return logits, weights, index
