"""Gated MLP forwards with gate and up's LoRA parts added inside the activation
(``KernelSettings(glu_lora=True)``).

Where gate and up are fused LoRA layers (our forward, no hooks) over FP8 bases in the plain case (one
adapter, no dropout or bias), one node makes the two base products and ``xa = [x A_g^T, x A_u^T]``
and leaves the low-rank parts out (:func:`~lightning_sloth.ops.fp8_lora.shared_input_fp8_bases`);
the activation adds them tile by tile (:mod:`lightning_sloth.ops.glu_lora`). The two ``[tokens, I]``
read-modify-write passes that would add them into the base products are not run, in the forward
and in a checkpointed layer's recompute (which, as the plain forward's, skips the down product).
Anything else runs the plain activation on gate and up's outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_sloth.ops.fp8_lora import shared_input_fp8_bases
from lightning_sloth.ops.glu import geglu, swiglu
from lightning_sloth.ops.glu_lora import geglu_lora, swiglu_lora
from lightning_sloth.patching._forwards import _hooked, gated_mlp_forward, patched_op
from lightning_sloth.patching.families import GluLayout

__all__ = ["GLU_LORA_FORWARDS", "geglu_lora_mlp_forward", "swiglu_lora_mlp_forward"]


def _lora_hidden(glu_lora: Callable, glu: Callable) -> Callable:
    def hidden(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.gate_proj, mlp.up_proj
        if patched_op(gate) == "lora" and patched_op(up) == "lora" and not (_hooked(gate) or _hooked(up)):
            parts = shared_input_fp8_bases(gate, up, x)
            if parts is not None:
                return glu_lora(*parts, inplace_backward=True)
        return glu(gate(x), up(x), inplace_backward=True)

    hidden.__doc__ = (
        f"``down_proj({glu.__name__}(gate_proj(x), up_proj(x)))`` with gate and up's LoRA parts inside "
        "the activation where both are fused LoRA layers over FP8 bases in the plain case (see the "
        "module notes); the in-place backwards as the plain gated MLP forward's."
    )
    return hidden


swiglu_lora_mlp_forward = gated_mlp_forward(_lora_hidden(swiglu_lora, swiglu), "swiglu_lora_mlp_forward")
geglu_lora_mlp_forward = gated_mlp_forward(_lora_hidden(geglu_lora, geglu), "geglu_lora_mlp_forward")

GLU_LORA_FORWARDS: dict[tuple[str, GluLayout], Callable] = {
    ("silu", "split"): swiglu_lora_mlp_forward,
    ("swish", "split"): swiglu_lora_mlp_forward,
    ("gelu_pytorch_tanh", "split"): geglu_lora_mlp_forward,
}
"""``(config.hidden_act, glu_layout)`` -> the forward with ``glu_lora``: separate gate and up only (a
fused gate-up projection keeps :data:`~lightning_sloth.patching._forwards.GLU_FORWARDS`' forward)."""
