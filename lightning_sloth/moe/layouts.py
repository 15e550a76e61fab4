"""How each MoE family stores and activates its experts, and the names the "sloth" experts go by.

The static description every part of the package shares — the experts forward, 4-bit experts,
PEFT's expert LoRA, 4-bit loading — so it sits below all of them.

Layouts (:data:`LAYOUTS`)::

    qwen3_moe, mixtral  gate_up_proj [E, 2I, H]  gate rows then up rows   down_proj [E, H, I]
                        act = silu(gate) * up
    gpt_oss             gate_up_proj [E, H, 2I]  gate/up interleaved      down_proj [E, I, H]
                        + gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
                        act = (clamp(up, -l, l) + 1) * g sigmoid(alpha g),  g = min(gate, l)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["COUNTS_ATTR", "EXPERTS_NAME", "LAYOUTS", "ExpertLayout", "layout_of"]

EXPERTS_NAME = "sloth"
"""The name in transformers' ``ExpertsInterface``."""

COUNTS_ATTR = "_sloth_expert_counts"
"""Attribute on each experts module holding the last forward's int32 ``[E]`` rows per expert
(a device tensor, read by the expert-load callback)."""


@dataclass(frozen=True)
class ExpertLayout:
    """How one family stores and activates its experts.

    Attributes:
        transposed: weights are ``[E, in, out]`` (``y = x W_e``); else ``[E, out, in]``.
        interleaved: gate/up columns alternate (GPT-OSS); else gate then up.
        bias: the experts have ``gate_up_proj_bias`` and ``down_proj_bias``.
        clamped: GPT-OSS's clamped activation (alpha and limit from the module); else
            ``act_fn(gate) * up``.
    """

    transposed: bool
    interleaved: bool
    bias: bool
    clamped: bool


LAYOUTS: dict[str, ExpertLayout] = {
    "qwen3_moe": ExpertLayout(transposed=False, interleaved=False, bias=False, clamped=False),
    "mixtral": ExpertLayout(transposed=False, interleaved=False, bias=False, clamped=False),
    "gpt_oss": ExpertLayout(transposed=True, interleaved=True, bias=True, clamped=True),
}
"""``config.model_type`` -> :class:`ExpertLayout`."""


def layout_of(experts: nn.Module) -> ExpertLayout:
    """The layout of a transformers experts module, from its config's ``model_type``.

    Raises:
        NotImplementedError: the family has no layout here (names it and the supported list).
    """
    model_type = getattr(getattr(experts, "config", None), "model_type", None)
    layout = LAYOUTS.get(model_type)
    if layout is None:
        raise NotImplementedError(
            f"the 'sloth' experts do not support MoE family {model_type!r} "
            f"({type(experts).__name__}); supported: {sorted(LAYOUTS)}"
        )
    return layout
