"""Finding things in a transformers model: the ``PreTrainedModel`` inside any wrapper, its decoder
layers, its family.

Every layer of the package needs these (the strategy, the patching, checkpointing, sharding, the
callbacks, generation), so they live here, below all of them, importing nothing of lightning_sloth.
A model reaches the package in many wrappers — plain, inside a PEFT ``PeftModel`` (whose
``LoraModel`` holds the ``PreTrainedModel``), inside a ``LightningModule``, with layers compiled by
``torch.compile`` — and each function here sees through all of them.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils.output_capturing import _active_collector

__all__ = [
    "base_model",
    "find_decoder_layers",
    "find_hf_model",
    "model_type",
    "recorded_outputs",
    "unwrap_compiled",
]


def find_hf_model(module: nn.Module) -> nn.Module:
    """The outermost transformers ``PreTrainedModel`` inside ``module`` (``module`` itself included).

    Raises:
        TypeError: if there is none (names the module's type).
    """
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel):
            return sub
    raise TypeError(
        f"lightning_sloth needs a transformers PreTrainedModel (plain, PEFT-wrapped or inside a "
        f"LightningModule); none found in {type(module).__name__}"
    )


def base_model(module: nn.Module) -> nn.Module:
    """:func:`find_hf_model`, or ``module`` itself when it holds no ``PreTrainedModel`` (a model the
    package treats as of an unknown family)."""
    try:
        return find_hf_model(module)
    except TypeError:
        return module


def model_type(module: nn.Module) -> str | None:
    """``config.model_type`` of the transformers model inside ``module`` (the family), or None."""
    return getattr(getattr(base_model(module), "config", None), "model_type", None)


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper holds, or ``module`` when it is not one."""
    return getattr(module, "_orig_mod", module)


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers model, plain or PEFT-wrapped.

    Looks for ``nn.ModuleList`` s of ``GradientCheckpointingLayer`` s (entries wrapped by
    ``torch.compile`` count): the one under ``model.get_decoder()`` when there are several,
    else the longest.

    Raises:
        TypeError: if ``model`` holds no such list.
    """

    def stacks(root: nn.Module) -> list[nn.ModuleList]:
        return [
            m
            for m in root.modules()
            if isinstance(m, nn.ModuleList)
            and len(m) > 0
            and all(isinstance(unwrap_compiled(layer), GradientCheckpointingLayer) for layer in m)
        ]

    found = stacks(model)
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no nn.ModuleList of transformers GradientCheckpointingLayer "
            "modules; lightning_sloth's checkpointing and sharding support transformers decoder models"
        )
    if len(found) > 1 and hasattr(model, "get_decoder"):
        decoder = stacks(model.get_decoder())
        found = decoder or found
    return max(found, key=len)


def recorded_outputs() -> list[str]:
    """The module outputs transformers is recording in the forward running now (``router_logits``
    under ``output_router_logits``, ``hidden_states``, ``attentions``), or ``[]``.

    transformers records them with forward hooks that keep each module's output as it is made; a
    layer run without a graph (the one-node checkpoint) would hand back outputs that carry no
    gradient, so a router load-balancing loss built from them would train nothing. The
    checkpointing asks this before running a layer as one node.
    """
    collected = _active_collector.get()
    return [key for key in collected or () if not key.startswith("_")]
