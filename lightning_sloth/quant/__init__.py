"""4-bit base weights for QLoRA: the 4-bit linear layer, quantise-while-loading, merging back.

The precision plugin (``lightning_sloth.plugins.SlothPrecision(quantize=...)``) is the face; this
room holds what sits behind it:

- :mod:`~lightning_sloth.quant.linear`: :class:`Linear4bit`, :func:`quantize_model` and its inverse
  :func:`dequantize_model` (in place; merging and export);
- :mod:`~lightning_sloth.quant.lora`: the PEFT LoRA forward over a 4-bit base (``sloth::lora_linear_4bit``);
- :mod:`~lightning_sloth.quant.fp8`: FP8 base weights: :class:`LinearFP8`, :func:`fp8_base_model`
  (from bf16 or 4 bits, in place), FP8 compute over 4-bit storage (:func:`fp8_compute_4bit`), and full fine-tuning in FP8 through torchao
  (:func:`float8_training`);
- :mod:`~lightning_sloth.quant.loading`: build a model on the meta device and fill it shard by
  shard, quantising each weight as it arrives.

The storage formats (NF4 / NF4-DQ / FP4 in the bitsandbytes layout, quantise and dequantise in plain
torch, conversion to and from bitsandbytes' ``QuantState``) are :mod:`lightning_sloth.ops.nf4_formats`,
below this room because the MoE experts read them too; the kernels are ``lightning_sloth.kernels.nf4``
behind the ops of ``lightning_sloth.ops.nf4``.
"""

from lightning_sloth.ops.nf4_formats import (
    QUANT_TYPES,
    Packed4bit,
    dequantize_4bit_reference,
    from_bnb,
    quantize_4bit,
    to_bnb,
)
from lightning_sloth.quant.fp8 import FP8_SKIP, LinearFP8, float8_training, fp8_base_model, fp8_compute_4bit
from lightning_sloth.quant.linear import (
    Linear4bit,
    check_checkpoint_quantization,
    dequantize_model,
    four_bit_storage,
    quantize_model,
)
from lightning_sloth.quant.loading import load_quantized, random_quantized
from lightning_sloth.quant.lora import lora_4bit_forward

__all__ = [
    "QUANT_TYPES",
    "Linear4bit",
    "LinearFP8",
    "Packed4bit",
    "check_checkpoint_quantization",
    "dequantize_4bit_reference",
    "dequantize_model",
    "float8_training",
    "four_bit_storage",
    "FP8_SKIP",
    "fp8_base_model",
    "fp8_compute_4bit",
    "from_bnb",
    "load_quantized",
    "lora_4bit_forward",
    "quantize_4bit",
    "quantize_model",
    "random_quantized",
    "to_bnb",
]
