"""``SlothStrategy``: transforms the model once at ``setup``, then lets Lightning place and wrap it.

At ``setup(trainer)`` — after ``configure_model``, before DDP wrapping — the strategy finds the
transformers model inside the LightningModule and applies, in place:

1. packed attention ("sloth" in transformers' ``AttentionInterface``) and ``use_cache=False``;
2. per-layer non-reentrant activation checkpointing.

Placement, precision conversion and DDP wrapping are Lightning's own: ``SlothStrategy`` extends
``SingleDeviceStrategy`` and ``SlothDDPStrategy`` extends ``DDPStrategy``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from torch import nn

log = logging.getLogger(__name__)


def find_hf_model(module: nn.Module) -> nn.Module:
    """The outermost transformers ``PreTrainedModel`` inside ``module`` (PEFT wrappers see through)."""
    from transformers import PreTrainedModel

    for sub in module.modules():
        if isinstance(sub, PreTrainedModel):
            return sub
    raise TypeError(
        f"SlothStrategy needs a LightningModule holding a transformers PreTrainedModel; "
        f"none found in {type(module).__name__}"
    )


class _SlothSetup:
    """The model transformation shared by the single-device and DDP strategies."""

    def _init_sloth(self, packed_attention: bool, gradient_checkpointing: bool) -> None:
        self.packed_attention = packed_attention
        self.gradient_checkpointing = gradient_checkpointing

    def _apply_sloth(self) -> None:
        model = find_hf_model(self.lightning_module)
        applied = []
        model.config.use_cache = False
        if self.packed_attention:
            from lightning_sloth.attention import enable_packed_attention

            enable_packed_attention(model)
            applied.append("packed attention")
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            applied.append("activation checkpointing")
        log.info("SlothStrategy applied to %s: %s", type(model).__name__, ", ".join(applied) or "nothing")


class SlothStrategy(_SlothSetup, SingleDeviceStrategy):
    """Single-device strategy that applies lightning_sloth's model transformations.

    ``Trainer(strategy="sloth")`` or ``Trainer(strategy=SlothStrategy(...))``.

    Args:
        packed_attention: use the packed "sloth" attention (needs ``PackedBatch`` inputs or
            unpadded rows).
        gradient_checkpointing: non-reentrant activation checkpointing of every decoder layer.
        device: the device; by default the one the Trainer's accelerator picks.
    """

    strategy_name = "sloth"

    def __init__(
        self,
        packed_attention: bool = True,
        gradient_checkpointing: bool = True,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        self._device_given = device is not None
        self._init_sloth(packed_attention, gradient_checkpointing)

    def setup_environment(self) -> None:
        if not self._device_given:
            # Registered strategies are built without a device: take the accelerator's first.
            devices = self.lightning_module.trainer._accelerator_connector._parallel_devices
            self._root_device = devices[0] if devices else torch.device("cpu")
        super().setup_environment()

    def setup(self, trainer) -> None:
        self._apply_sloth()
        super().setup(trainer)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning_sloth, single device")


class SlothDDPStrategy(_SlothSetup, DDPStrategy):
    """DDP with lightning_sloth's model transformations (``Trainer(strategy="sloth_ddp")``).

    Takes the same arguments as :class:`SlothStrategy` plus everything ``DDPStrategy`` takes
    (``start_method="spawn"`` is what the Hydra app uses under ``-m`` multirun).
    """

    strategy_name = "sloth_ddp"

    def __init__(
        self, packed_attention: bool = True, gradient_checkpointing: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._init_sloth(packed_attention, gradient_checkpointing)

    def setup(self, trainer) -> None:
        self._apply_sloth()
        super().setup(trainer)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning_sloth, DDP (subprocess launch)"
        )
        strategy_registry.register(
            "sloth_ddp_spawn", cls, description="lightning_sloth, DDP (spawn launch)", start_method="spawn"
        )


SlothStrategy.register_strategies(StrategyRegistry)
SlothDDPStrategy.register_strategies(StrategyRegistry)
