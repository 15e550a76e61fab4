"""The gated RMSNorm after a Gated DeltaNet layer's delta rule (``Qwen3_5RMSNormGated`` and its
Qwen3.5-MoE / Qwen3-Next copies) through ``sloth::rms_norm_gated``
(``KernelSettings.rms_norm_gated``, on by default): one pass each way in the module's cast order, instead of
its dozen elementwise kernels and their fp32 intermediates kept for the backward."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sloth.ops.rms_norm_gated import rms_norm_gated
from lightning_sloth.patching._forwards import _op_forward

__all__ = ["gated_norm_forward", "gated_norm_fits"]


def gated_norm_fits(module: nn.Module) -> bool:
    """Whether ``module`` is the SiLU-gated RMSNorm the op computes: a weight, a float eps and the
    ``silu`` activation."""
    return (
        isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and getattr(module, "activation", None) == "silu"
    )


@_op_forward("rms_norm_gated")
def gated_norm_forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(weight * rms_norm(hidden_states)) * silu(gate)``, the module's forward as one op."""
    return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)
