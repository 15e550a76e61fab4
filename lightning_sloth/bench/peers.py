"""The peers of the benchmark suite, each at its strongest: transformers + PEFT on the packed rows with a
varlen attention, Liger-Kernel, Unsloth, and transformers + PEFT + bitsandbytes for QLoRA.

Each is a ``setup(workload) -> model`` (and where it needs its own, a batches function) for a loop
system of :mod:`lightning_sloth.bench.systems`. Peers are optional imports inside these functions
only: the package never depends on them, and each system runs in its own process.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator

import torch
from peft import prepare_model_for_kbit_training
from transformers import AttentionInterface

from lightning_sloth.attention import enable_packed_attention, sloth_attention_forward
from lightning_sloth.bench.workload import (
    SHAPE_FAMILIES,
    Workload,
    build_base_model,
    build_model,
    lora_targets,
    packed_batches,
    quantized_base_model,
)
from lightning_sloth.data import build_char_tokenizer
from lightning_sloth.linear_attention.fla_hopper import register_hopper_backend
from lightning_sloth.linear_attention.fla_kernels import fla_available
from lightning_sloth.quant import Linear4bit

PER_LAYER_ATTENTION = "sloth_per_layer"


def peft_varlen(workload: Workload):
    """transformers + PEFT with its own checkpointing; only the attention is our packed one."""
    model = build_model(workload, "sdpa")
    enable_packed_attention(model)
    kinds = getattr(getattr(model, "config", None), "layer_types", None) or ()
    if "linear_attention" in kinds and fla_available():
        # transformers runs these layers on fla too; on Hopper with Triton 3.4-3.7.0 fla refuses the
        # gated backward unless a backend serves it: the same wide-tile one as ours.
        register_hopper_backend()
    return model


def liger_varlen(workload: Workload):
    import liger_kernel.transformers as liger

    family = SHAPE_FAMILIES.get(workload.shape, "llama")
    apply = getattr(liger, f"apply_liger_kernel_to_{family}")
    # Class-level patches, so before the model is built; this process runs only this system.
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    return peft_varlen(workload)


def unsloth(workload: Workload):
    """The same random weights, saved and loaded through ``FastLanguageModel``."""
    from unsloth import FastLanguageModel

    path = tempfile.mkdtemp(prefix="bench_unsloth_")
    build_base_model(workload, "sdpa").save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    model, _ = FastLanguageModel.from_pretrained(
        path,
        # The longest document, not the packed row: positions restart per document, and a longer
        # max_seq_length would switch on RoPE scaling. Packed rows pass as such (packed_seq_lengths).
        max_seq_length=workload.max_len,
        dtype=torch.bfloat16,
        load_in_4bit=False,
        use_exact_model_name=True,
        local_files_only=True,
    )
    return FastLanguageModel.get_peft_model(
        model,
        r=workload.lora_r,
        lora_alpha=2 * workload.lora_r,
        lora_dropout=0.0,
        bias="none",
        **lora_targets(workload),  # the same layers (and MoE expert parameters) as every system
        use_gradient_checkpointing="unsloth",
        random_state=workload.seed,
    )


def unsloth_batches(workload: Workload, samples, pad_id: int) -> Iterator:
    """The packed rows with Unsloth's own packing key (document lengths) instead of ``cu_seqlens``."""
    for micro, tokens, sum_sq, targets in packed_batches(workload, samples, pad_id):
        inputs = micro[0]
        lengths = inputs["cu_seq_lens_q"].diff().to(torch.int32)
        keep = ("input_ids", "position_ids", "labels", "use_cache")
        yield [{k: inputs[k] for k in keep} | {"packed_seq_lengths": lengths}], tokens, sum_sq, targets


def per_layer_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The packed attention with its metadata rebuilt from ``position_ids`` in every layer.

    ``cu_seqlens`` are the positions where ``position_ids`` restart at 0; the longest document
    becomes a Python int through a device-to-host sync, once per layer (and per recompute).
    """
    positions = kwargs.pop("position_ids").reshape(-1)
    starts = torch.nonzero(positions == 0).flatten()
    cu_seqlens = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(cu_seqlens.diff().max())
    return sloth_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout,
        scaling,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=longest,
        max_length_k=longest,
        **kwargs,
    )


def per_layer_metadata(setup: Callable) -> Callable:
    """``setup`` with its attention switched to :func:`per_layer_attention`."""

    def build(workload: Workload):
        model = setup(workload)
        AttentionInterface.register(PER_LAYER_ATTENTION, per_layer_attention)
        model.get_base_model().set_attn_implementation(PER_LAYER_ATTENTION)
        return model

    return build


def position_ids_only_batches(workload: Workload, samples, pad_id: int) -> Iterator:
    """The packed rows without ``cu_seq_lens``/``max_length``: packing shows only in ``position_ids``."""
    drop = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    for micro, tokens, sum_sq, targets in packed_batches(workload, samples, pad_id):
        yield [{k: v for k, v in m.items() if k not in drop} for m in micro], tokens, sum_sq, targets


def as_bitsandbytes(model):
    """The model's 4-bit layers as bitsandbytes ``Linear4bit`` modules over the same storage (nothing
    re-quantised), then PEFT's ``prepare_model_for_kbit_training`` with its checkpointing: the
    QLoRA baseline's recipe."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear4bit):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.to_bnb_module(torch.bfloat16))
    model.is_loaded_in_4bit = True
    return prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )


def hf_bitsandbytes(workload: Workload):
    """transformers + PEFT + bitsandbytes over the same NF4 weights (:func:`as_bitsandbytes`)."""
    model = as_bitsandbytes(quantized_base_model(workload))
    return build_model(workload, "sdpa", checkpointing=False, base=model)
