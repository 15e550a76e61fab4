"""How each MoE family stores and activates its experts, and the names the "sloth" experts go by.

The static description every part of the package shares — the experts forward, 4-bit experts,
PEFT's expert LoRA, 4-bit loading — so it sits below all of them.

Layouts (:data:`LAYOUTS`, by the experts module's ``config.model_type``)::

    qwen3_moe, mixtral,      gate_up_proj [E, 2I, H]  gate rows then up rows  down_proj [E, H, I]
    qwen2_moe, qwen3_next,   act = act_fn(gate) * up; the routing weight scales the expert's output
    qwen3_5_moe_text,
    glm4_moe, deepseek_v3
    gpt_oss                  gate_up_proj [E, H, 2I]  gate/up interleaved     down_proj [E, I, H]
                             + gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
                             act = (clamp(up, -l, l) + 1) * g sigmoid(alpha g),  g = min(gate, l)
    llama4_text              gate_up_proj [E, H, 2I]  gate columns then up    down_proj [E, I, H]
                             act = up * act_fn(gate); the routing weight scales the expert's *input*

transformers' ``use_experts_implementation`` decorator records a family's layout on each experts
module (``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``); :func:`layout_of`
checks them against the table, so a family whose storage changes is refused, not misread. Llama 4's
experts are not decorated (its MoE block runs every expert on every token as one ``bmm``) and carry
no config: :data:`CONFIGLESS_EXPERTS` names their family.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = [
    "CONFIGLESS_EXPERTS",
    "ENDS_ATTR",
    "EXPERTS_NAME",
    "LAYOUTS",
    "ExpertLayout",
    "experts_model_type",
    "layout_of",
    "require_sloth_experts",
]

EXPERTS_NAME = "sloth"
"""The name in transformers' ``ExpertsInterface``."""

ENDS_ATTR = "_sloth_expert_ends"
"""Attribute on each experts module holding the last forward's int32 ``[E]`` cumulative row ends per
expert (a device tensor; the expert-load callback takes the rows per expert from it)."""


@dataclass(frozen=True)
class ExpertLayout:
    """How one family stores and activates its experts.

    Attributes:
        transposed: weights are ``[E, in, out]`` (``y = x W_e``); else ``[E, out, in]``.
        interleaved: gate/up columns alternate (GPT-OSS); else gate then up.
        bias: the experts have ``gate_up_proj_bias`` and ``down_proj_bias``.
        clamped: GPT-OSS's clamped activation (alpha and limit from the module); else
            ``act_fn(gate) * up``.
        scaled_input: the routing weight multiplies the expert's input rows (Llama 4:
            ``expert(w x)``); else its output (``w expert(x)``).
    """

    transposed: bool
    interleaved: bool
    bias: bool
    clamped: bool
    scaled_input: bool = False


_GATE_UP = ExpertLayout(transposed=False, interleaved=False, bias=False, clamped=False)

LAYOUTS: dict[str, ExpertLayout] = {
    "qwen3_moe": _GATE_UP,
    "mixtral": _GATE_UP,
    "gpt_oss": ExpertLayout(transposed=True, interleaved=True, bias=True, clamped=True),
    "qwen2_moe": _GATE_UP,
    "qwen3_next": _GATE_UP,
    "qwen3_5_moe_text": _GATE_UP,
    "glm4_moe": _GATE_UP,
    "deepseek_v3": _GATE_UP,
    "llama4_text": ExpertLayout(
        transposed=True, interleaved=False, bias=False, clamped=False, scaled_input=True
    ),
}
"""``config.model_type`` -> :class:`ExpertLayout`."""

CONFIGLESS_EXPERTS: dict[str, str] = {"Llama4TextExperts": "llama4_text"}
"""Experts classes that hold no ``config`` -> their family's ``model_type``."""


def experts_model_type(experts: nn.Module) -> str | None:
    """The ``model_type`` whose layout an experts module follows (its config's, else its class's)."""
    model_type = getattr(getattr(experts, "config", None), "model_type", None)
    return model_type if model_type is not None else CONFIGLESS_EXPERTS.get(type(experts).__name__)


def layout_of(experts: nn.Module) -> ExpertLayout:
    """The layout of a transformers experts module.

    Raises:
        NotImplementedError: the family has no layout here (names it and the supported list), or
            the module's own layout flags disagree with the table's row.
    """
    model_type = experts_model_type(experts)
    layout = LAYOUTS.get(model_type)
    if layout is None:
        raise NotImplementedError(
            f"the 'sloth' experts do not support MoE family {model_type!r} "
            f"({type(experts).__name__}); supported: {sorted(LAYOUTS)}"
        )
    expected = {
        "is_transposed": layout.transposed,
        "is_concatenated": not layout.interleaved,
        "has_bias": layout.bias,
        "has_gate": True,
    }
    found = {flag: getattr(experts, flag) for flag in expected if hasattr(experts, flag)}
    if any(found[flag] != expected[flag] for flag in found):
        raise NotImplementedError(
            f"{type(experts).__name__} ({model_type}) declares the layout {found}, but lightning_sloth's "
            f"{model_type} row expects {expected}: this transformers version stores the experts differently"
        )
    return layout


def require_sloth_experts(storage: str, experts: nn.Module, args) -> None:
    """Forward pre-hook of an experts module whose weights are stored as ``storage`` (``"4 bits"``,
    ``"FP8"``; bound with ``functools.partial``): only the "sloth" experts read such storage, any
    other implementation would see ``uint8`` codes."""
    selected = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if selected != EXPERTS_NAME:
        raise RuntimeError(
            f"{type(experts).__name__} stores its expert weights in {storage}, which only the {EXPERTS_NAME!r} "
            f"experts implementation reads, but {selected!r} is selected: train with SlothStrategy(moe=True) "
            "(the default) or call lightning_sloth.patching.apply_experts(model)"
        )
