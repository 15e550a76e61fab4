"""The PEFT LoRA forward over a quantised base weight: 4-bit through ``sloth::lora_linear_4bit``,
FP8 (:class:`~lightning_sloth.quant.fp8.LinearFP8`) through ``sloth::linear_fp8``.

Takes PEFT's plain ``lora.Linear`` around a :class:`~lightning_sloth.quant.linear.Linear4bit` and
PEFT's ``lora.bnb.Linear4bit`` around a bitsandbytes ``Linear4bit`` (a model loaded with
``BitsAndBytesConfig(load_in_4bit=True)``): the bitsandbytes storage is read as it is, nothing is
re-quantised.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_sloth.ops.fp8_lora import plain_fp8
from lightning_sloth.ops.lora_layers import adapter_in
from lightning_sloth.quant.fp8 import LinearFP8, lora_4bit_fp8_storage, lora_fp8_forward
from lightning_sloth.quant.linear import compute_dtype, four_bit_storage, linear_4bit


def lora_4bit_forward(
    module: nn.Module, x: Tensor, overwrite_input: bool = False, unread_sum_with: Tensor | None = None
) -> Tensor | None:
    """Forward of a PEFT LoRA layer with a 4-bit or FP8 base, or None when it is outside the plain case.

    The plain case: one active adapter, unmerged and enabled, no dropout, no DoRA or other variant,
    no LoRA bias (a base bias is added). The product runs in the autocast dtype under autocast,
    else in x's dtype; adapters stored in another dtype are cast to it (gradients flow through the
    cast).

    Args:
        module: a PEFT ``LoraLayer``.
        x: ``[..., in]`` input.
        overwrite_input: the backward writes x's gradient into x's memory (an x nothing else reads
            afterwards; see :func:`~lightning_sloth.ops.nf4.lora_linear_4bit`), on a 4-bit base and
            on a plain FP8 one (computed in FP8 or not).
        unread_sum_with: a residual ``[..., out]`` in the compute dtype: returns ``residual +
            module(x)`` for a backward only, its values never computed (a checkpoint's recompute);
            None where that does not apply (a base bias, an FP8 base with hooks, another shape).

    Returns:
        ``[..., out]``, or None (the caller runs the module's own forward).
    """
    lora_a_modules = getattr(module, "lora_A", None)
    if lora_a_modules is None or getattr(module, "merged", True) or getattr(module, "disable_adapters", True):
        return None
    if len(module.active_adapters) != 1:
        return None
    adapter = module.active_adapters[0]
    if adapter not in lora_a_modules or adapter in getattr(module, "lora_variant", {}):
        return None
    if module.use_dora.get(adapter, False) or getattr(module, "fan_in_fan_out", False):
        return None
    base = module.get_base_layer()
    lora_a, lora_b = lora_a_modules[adapter], module.lora_B[adapter]
    if not isinstance(module.lora_dropout[adapter], nn.Identity):
        return None
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    unread = unread_sum_with
    if unread is not None and (
        (isinstance(base, LinearFP8) and not plain_fp8(base))
        or getattr(base, "bias", None) is not None
        or unread.shape != (*x.shape[:-1], lora_b.weight.shape[0])
        or not unread.is_floating_point()
    ):
        return None
    if isinstance(base, LinearFP8):
        if x.device != base.weight.device or compute_dtype(x) not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
        ):
            return None
        return lora_fp8_forward(base, x, lora_a, lora_b, module.scaling[adapter], unread, overwrite_input)
    storage = four_bit_storage(base)
    if storage is None:
        return None
    if x.device != storage.packed.device:
        return None
    dtype = compute_dtype(x)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if getattr(base, "fp8_grad", None) is not None:  # 4-bit storage, FP8 compute, one op
        y = lora_4bit_fp8_storage(
            x.to(dtype),
            storage,
            adapter_in(lora_a.weight, dtype),
            adapter_in(lora_b.weight, dtype),
            module.scaling[adapter],
            base.fp8_grad,
            unread,
            overwrite_input,
        )
    else:
        y = linear_4bit(
            x.to(dtype),
            storage,
            lora_a.weight.to(dtype),
            lora_b.weight.to(dtype),
            module.scaling[adapter],
            overwrite_input,
            unread,
        )
    bias = getattr(base, "bias", None)
    return y + bias.to(dtype) if bias is not None else y
