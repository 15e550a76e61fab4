"""Gated MLP forwards with gate and up's LoRA parts added inside the activation
(``KernelSettings(glu_lora=True)``).

Where gate and up are fused LoRA layers (our forward, no hooks) over FP8 bases in the plain case (one
adapter, no dropout or bias), one node makes the two base products and ``xa = [x A_g^T, x A_u^T]``
and leaves the low-rank parts out (:func:`~lightning_sloth.ops.fp8_lora.shared_input_fp8_bases`);
the activation adds them tile by tile (:mod:`lightning_sloth.ops.glu_lora`). The two ``[tokens, I]``
read-modify-write passes that would add them into the base products are not run, in the forward
and in a checkpointed layer's recompute. Anything else runs :mod:`._forwards`' gated MLP forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_sloth.ops.fp8_lora import shared_input_fp8_bases
from lightning_sloth.ops.glu import geglu, swiglu
from lightning_sloth.ops.glu_lora import geglu_lora, swiglu_lora
from lightning_sloth.patching._forwards import _hooked, _op_forward, _project_fresh, patched_op
from lightning_sloth.patching.families import GluLayout
from lightning_sloth.patching.mlp_chunks import token_chunked

__all__ = ["GLU_LORA_FORWARDS", "geglu_lora_mlp_forward", "swiglu_lora_mlp_forward"]


def _glu_with_lora(mlp: nn.Module, x: torch.Tensor, glu_lora: Callable) -> torch.Tensor | None:
    """The activation of ``mlp``'s gate and up with their LoRA parts added inside it; None unless
    both are fused LoRA layers over FP8 bases in the plain case."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if patched_op(gate) != "lora" or patched_op(up) != "lora" or _hooked(gate) or _hooked(up):
        return None
    parts = shared_input_fp8_bases(gate, up, x)
    return None if parts is None else glu_lora(*parts, inplace_backward=True)


@_op_forward("glu")
@token_chunked
def swiglu_lora_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with gate and up's LoRA parts inside the
    activation where they apply (see the module notes); the in-place backwards as
    :func:`~lightning_sloth.patching._forwards.swiglu_mlp_forward`'s."""
    h = _glu_with_lora(self, x, swiglu_lora)
    if h is None:
        h = swiglu(self.gate_proj(x), self.up_proj(x), inplace_backward=True)
    return _project_fresh(self.down_proj, h)


@_op_forward("glu")
@token_chunked
def geglu_lora_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_lora_mlp_forward` with ``gelu_tanh``."""
    h = _glu_with_lora(self, x, geglu_lora)
    if h is None:
        h = geglu(self.gate_proj(x), self.up_proj(x), inplace_backward=True)
    return _project_fresh(self.down_proj, h)


GLU_LORA_FORWARDS: dict[tuple[str, GluLayout], Callable] = {
    ("silu", "split"): swiglu_lora_mlp_forward,
    ("swish", "split"): swiglu_lora_mlp_forward,
    ("gelu_pytorch_tanh", "split"): geglu_lora_mlp_forward,
}
"""``(config.hidden_act, glu_layout)`` -> the forward with ``glu_lora``: separate gate and up only (a
fused gate-up projection keeps :data:`~lightning_sloth.patching._forwards.GLU_FORWARDS`' forward)."""
