"""``apply_experts``: select the "sloth" experts (``lightning_sloth.moe``) for a MoE model, per the table."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from lightning_sloth.patching._apply import _base_model
from lightning_sloth.patching.families import FAMILIES

log = logging.getLogger(__name__)

__all__ = ["ExpertsReport", "apply_experts", "moe_families"]


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
    """

    model_type: str | None
    implementation: str | None = None
    experts: list[str] = field(default_factory=list)
    lora: list[str] = field(default_factory=list)


def _is_experts(module: nn.Module) -> bool:
    # transformers' use_experts_implementation decorator sets these flags on every experts module
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "num_experts")


def apply_experts(model: nn.Module, enabled: bool = True) -> ExpertsReport:
    """Select the "sloth" experts implementation for a transformers MoE model, in place.

    Registers "sloth" in transformers' ``ExpertsInterface``, sets it on the model (and its config)
    and routes PEFT ``target_parameters`` LoRA on the experts through the grouped computation.
    With ``enabled=False`` a model set to "sloth" goes back to transformers' ``grouped_mm`` and the
    PEFT wrappers get PEFT's forward back. A dense model is left as it is.

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
    from lightning_sloth.moe import EXPERTS_NAME, install_lora_experts, register, uninstall_lora_experts

    base = _base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    report = ExpertsReport(model_type=model_type)
    experts = [(name, m) for name, m in base.named_modules() if _is_experts(m)]
    if not experts:
        return report
    report.experts = [name for name, _ in experts]
    family = FAMILIES.get(model_type)
    uninstall_lora_experts(base)
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
    log.info(
        "lightning_sloth experts: %s x%d (%d with LoRA inside the grouped GEMMs)",
        model_type,
        len(report.experts),
        len(report.lora),
    )
    return report
