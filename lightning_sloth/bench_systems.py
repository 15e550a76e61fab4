"""Systems of the benchmark suite beyond :data:`lightning_sloth.bench.SYSTEMS`: the peers
(transformers + PEFT with a varlen attention, Liger-Kernel, Unsloth), the optimisation ablations,
and lightning_sloth through Lightning's ``Trainer``.

A system is either a *loop* system, ``(setup(workload) -> model, batches(workload, samples,
pad_id))`` exactly like the entries of ``bench.SYSTEMS`` (the suite trains it with its own loop),
or a *trainer* system, run by ``Trainer.fit`` with a timing callback. Peers are optional imports
of these functions only: the package never depends on them.

Systems (all LoRA r=16 on the seven projections, gradient checkpointing, bf16):
    hf_packed_varlen                 transformers + PEFT on the packed rows, attention by
                                     ``varlen_attn`` over ``cu_seqlens`` (our packed attention,
                                     nothing else of ours): the fair peer baseline.
    hf_packed_varlen_per_layer       the same, the metadata derived from ``position_ids`` in
                                     every layer (transformers' own way for packed rows).
    liger_packed_varlen              + Liger-Kernel's ``apply_liger_kernel_to_<family>`` (RMSNorm,
                                     RoPE, SwiGLU, fused linear cross-entropy).
    unsloth_packed                   Unsloth's ``FastLanguageModel`` (``use_gradient_checkpointing=
                                     "unsloth"``) on the packed rows (``packed_seq_lengths``).
    sloth_trainer                    ``Trainer(strategy=SlothStrategy(kernels=True),
                                     plugins=[SlothPrecision("bf16-mixed")])`` around
                                     ``CausalLMModule``: the user path.
    sloth_kernels_metadata_per_layer every kernel, but the packed attention derives ``cu_seqlens``
                                     and the longest document from ``position_ids`` in every layer
                                     (a device-to-host sync each), as transformers does.
    sloth_kernels_offload_single     kernels + offload, single-buffered (no prefetch).
    sloth_kernels_planned            kernels + the per-layer memory plan for the device's free
                                     memory (``offload="auto", memory_budget="auto"``).
    sloth_kernels_kv_repeat          the default, but K/V heads copied to one per query head
                                     before the varlen kernel (``set_varlen_kv_repeat(True)``).
    sloth_kernels_without_add_rms_norm  the default, but the residual add and the next norm as
                                     two passes (``kernels={"add_rms_norm": False}``).
    sloth_kernels_torch_checkpoint   the default, but torch's hook-based checkpoint per layer
                                     (``checkpoint_impl="torch"``) instead of one autograd node.
    sloth_kernels_before_host_gap    all three of the above and adapters cast per call: the
                                     default before the host-gap changes.
    sloth_kernels_per_call_casts     the default, but every fused LoRA call casts its adapters
                                     itself (``group_adapter_casts=False``).
    sloth_kernels_kept_embedding     the default, but the first layer's node keeps the embedding's
                                     output (``rebuild_embedding=False``).
    sloth_kernels_per_layer_projections  the default, but q/k/v and gate/up LoRA layers one node
                                     each instead of one per group (``group_projections=False``);
                                     ``sloth_kernels_grouped`` / ``sloth_kernels_offload_grouped``
                                     name the default's grouping explicitly (as first measured).
    sloth_kernels_full_recompute     the default, but the recompute runs each layer's last product
                                     too (``skip_unread_output=False``).
    sloth_kernels_loss_all_rows      the default, but the fused loss computes logits for every row
                                     (no ``num_target_tokens``).
    sloth_kernels_separate_b         the default, but the grouped LoRA layers add their ``B``
                                     products to the outputs after the base products instead of
                                     folding them into them (``lora.WIDE_ROWS_PER_INPUT = inf``);
                                     ``sloth_kernels_planned_separate_b``: the same on the memory plan.
    hf_bnb_padded / hf_bnb_packed    QLoRA baseline: transformers + PEFT + bitsandbytes over the
                                     same NF4 weights (``prepare_model_for_kbit_training``), padded
                                     micro-batches / packed rows with its SDPA.
    sloth_nf4 / sloth_nf4_offload    lightning_sloth on NF4 base weights built layer by layer in 4
                                     bits (``transform_model(kernels=True)``, + offload).
On a MoE shape (``SHAPE_FAMILIES``) the transformers systems keep transformers' own experts
(``grouped_mm``) and PEFT's ``target_parameters`` LoRA on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lightning_sloth import bench
from lightning_sloth.bench import Workload

PER_LAYER_ATTENTION = "sloth_per_layer"


@dataclass(frozen=True)
class SuiteSystem:
    """One system of the suite.

    Attributes:
        label: what the README and the plots call it.
        setup: ``setup(workload) -> model`` (loop systems).
        batches: ``batches(workload, samples, pad_id)`` yielding ``(micro_batches, real_tokens,
            sum_sq_lengths, target_tokens)`` per step (loop systems).
        trainer: ``trainer(workload) -> dict`` of raw measurements (trainer systems).
        preamble: Python run first in the system's fresh process (Unsloth wants to be imported
            before transformers).
    """

    label: str
    setup: Callable | None = None
    batches: Callable | None = None
    trainer: Callable | None = None
    preamble: str = ""


def _peft_varlen(workload: Workload):
    """transformers + PEFT with its own checkpointing; only the attention is our packed one."""
    from lightning_sloth.attention import enable_packed_attention

    model = bench.build_model(workload, "sdpa")
    enable_packed_attention(model)
    return model


def _liger_varlen(workload: Workload):
    import liger_kernel.transformers as liger

    family = bench.SHAPE_FAMILIES.get(workload.shape, "llama")
    apply = getattr(liger, f"apply_liger_kernel_to_{family}")
    # Class-level patches, so before the model is built; this process runs only this system.
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    return _peft_varlen(workload)


def _unsloth(workload: Workload):
    """The same random weights, saved and loaded through ``FastLanguageModel``."""
    import tempfile

    from unsloth import FastLanguageModel

    from lightning_sloth.data import build_char_tokenizer

    path = tempfile.mkdtemp(prefix="bench_unsloth_")
    bench.build_base_model(workload, "sdpa").save_pretrained(path)
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
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth",
        random_state=workload.seed,
    )


def _unsloth_batches(workload: Workload, samples, pad_id: int) -> Iterator:
    """The packed rows with Unsloth's own packing key (document lengths) instead of ``cu_seqlens``."""
    for micro, tokens, sum_sq, targets in bench._packed_batches(workload, samples, pad_id):
        inputs = micro[0]
        lengths = inputs["cu_seq_lens_q"].diff().to(torch.int32)
        keep = ("input_ids", "position_ids", "labels", "use_cache")
        yield [{k: inputs[k] for k in keep} | {"packed_seq_lengths": lengths}], tokens, sum_sq, targets


def per_layer_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The packed attention with its metadata rebuilt from ``position_ids`` in every layer.

    ``cu_seqlens`` are the positions where ``position_ids`` restart at 0; the longest document
    becomes a Python int through a device-to-host sync, once per layer (and per recompute).
    """
    from lightning_sloth.attention import sloth_attention_forward

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


def _per_layer_metadata(setup: Callable) -> Callable:
    """``setup`` with its attention switched to :func:`per_layer_attention`."""

    def build(workload: Workload):
        from transformers import AttentionInterface

        model = setup(workload)
        AttentionInterface.register(PER_LAYER_ATTENTION, per_layer_attention)
        model.get_base_model().set_attn_implementation(PER_LAYER_ATTENTION)
        return model

    return build


def _position_ids_only_batches(workload: Workload, samples, pad_id: int) -> Iterator:
    """The packed rows without ``cu_seq_lens``/``max_length``: packing shows only in ``position_ids``."""
    drop = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    for micro, tokens, sum_sq, targets in bench._packed_batches(workload, samples, pad_id):
        yield [{k: v for k, v in m.items() if k not in drop} for m in micro], tokens, sum_sq, targets


def _sloth_offload_single(workload: Workload):
    model = bench._sloth(kernels=True, offload="on")(workload)
    model._sloth_report.offloader.double_buffer = False
    return model


def _checkpointing_set(setup: Callable, **attributes) -> Callable:
    """``setup``, then these attributes set on the model's ``CheckpointedLayers`` controller."""

    def wrapped(workload: Workload):
        model = setup(workload)
        for name, value in attributes.items():
            setattr(model._sloth_report.checkpointing, name, value)
        return model

    return wrapped


def _separate_b_products(setup: Callable) -> Callable:
    """``setup`` in a process whose grouped LoRA layers never fold ``s B`` into the base products
    (each system runs in its own process, so the module setting stays in it)."""

    def wrapped(workload: Workload):
        from lightning_sloth.ops import lora

        lora.WIDE_ROWS_PER_INPUT = float("inf")
        return setup(workload)

    return wrapped


def _loss_on_all_rows(setup: Callable) -> Callable:
    """``setup``, the fused loss then given no target count: logits for every row, as before."""

    def wrapped(workload: Workload):
        model = setup(workload)
        model._sloth_loss_all_rows = True  # read by bench.loss_kwargs
        return model

    return wrapped


def _kv_repeated(setup: Callable) -> Callable:
    """``setup`` with GQA's K/V heads copied before the varlen kernel (the switched-off default)."""

    def run(workload: Workload):
        from lightning_sloth.attention import set_varlen_kv_repeat

        set_varlen_kv_repeat(True)  # process-wide; this process runs only this system
        return setup(workload)

    return run


def packed_batch_list(workload: Workload, samples, pad_id: int = 0) -> list:
    """The packed steps as :class:`~lightning_sloth.data.PackedBatch` objects, as a DataLoader yields them."""
    from lightning_sloth.data import PackedCollator, pack_best_fit_decreasing

    collate = PackedCollator(max_tokens=workload.tokens_per_step, pad_token_id=pad_id)
    bins = pack_best_fit_decreasing([len(s[0]) for s in samples], workload.tokens_per_step)
    return [collate([samples[i] for i in idx]) for idx in bins]


def base_config(workload: Workload, attn: str = "sdpa"):
    """The transformers config of the workload's shape (family from ``bench.SHAPE_FAMILIES``)."""
    return bench.shape_config(workload.shape, attn)


def quantized_base_model(workload: Workload, quant_type: str = "nf4"):
    """The workload's shape with random weights built directly in 4 bits (``lm_head`` kept in bf16),
    layer by layer on :func:`~lightning_sloth.bench.bench_device` (the bf16 model never exists whole)."""
    from lightning_sloth.quant import random_quantized

    return random_quantized(
        base_config(workload),
        quant_type,
        device=bench.bench_device(),
        dtype=torch.bfloat16,
        seed=workload.seed,
    )


def _sloth_4bit(**settings) -> Callable:
    """lightning_sloth on NF4 base weights: 4-bit model, PEFT LoRA, ``transform_model(kernels=True)``."""

    def setup(workload: Workload):
        from lightning_sloth.plugins.strategy import transform_model

        model = bench.build_model(workload, "sdpa", checkpointing=False, base=quantized_base_model(workload))
        model._sloth_report = transform_model(model, kernels=True, **settings)
        return model

    return setup


def as_bitsandbytes(model):
    """The model's 4-bit layers as bitsandbytes ``Linear4bit`` modules over the same storage (nothing
    re-quantised), then PEFT's ``prepare_model_for_kbit_training`` with its checkpointing: the
    QLoRA baseline's recipe."""
    from peft import prepare_model_for_kbit_training

    from lightning_sloth.quant import Linear4bit

    for name, module in list(model.named_modules()):
        if isinstance(module, Linear4bit):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.to_bnb_module(torch.bfloat16))
    model.is_loaded_in_4bit = True
    return prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )


def _hf_bitsandbytes(workload: Workload):
    """transformers + PEFT + bitsandbytes over the same NF4 weights (:func:`as_bitsandbytes`)."""
    model = as_bitsandbytes(quantized_base_model(workload))
    return bench.build_model(workload, "sdpa", checkpointing=False, base=model)


SUITE_SYSTEMS: dict[str, SuiteSystem] = {
    "hf_padded": SuiteSystem("transformers + PEFT, SDPA, padded micro-batches of 8 (baseline)"),
    "hf_packed_sdpa": SuiteSystem("transformers + PEFT, packed rows, its own SDPA"),
    "hf_packed_varlen": SuiteSystem(
        "transformers + PEFT, packed rows, varlen attention", _peft_varlen, bench._packed_batches
    ),
    "hf_packed_varlen_per_layer": SuiteSystem(
        "transformers + PEFT, packed rows, varlen attention, metadata derived per layer",
        _per_layer_metadata(_peft_varlen),
        _position_ids_only_batches,
    ),
    "liger_packed_varlen": SuiteSystem(
        "Liger-Kernel + PEFT, packed rows, varlen attention", _liger_varlen, bench._packed_batches
    ),
    "unsloth_packed": SuiteSystem(
        'Unsloth, packed rows, use_gradient_checkpointing="unsloth"',
        _unsloth,
        _unsloth_batches,
        preamble="import os\nos.environ.setdefault('UNSLOTH_DISABLE_STATISTICS', '1')\nimport unsloth\n",
    ),
    "sloth_trainer": SuiteSystem("lightning_sloth: Trainer + SlothStrategy(kernels=True) (user path)"),
    "sloth_kernels": SuiteSystem("lightning_sloth: transform_model(kernels=True) (API path)"),
    "sloth": SuiteSystem("lightning_sloth, kernels off (packed attention, checkpointing)"),
    "sloth_kernels_metadata_per_layer": SuiteSystem(
        "lightning_sloth, packing metadata derived per layer from position_ids",
        _per_layer_metadata(bench._sloth(kernels=True)),
        _position_ids_only_batches,
    ),
    "sloth_kernels_offload": SuiteSystem("lightning_sloth + offload, double-buffered"),
    "sloth_kernels_graphs": SuiteSystem("lightning_sloth + CUDA graphs of the layers (cuda_graphs=True)"),
    "sloth_kernels_offload_graphs": SuiteSystem("lightning_sloth + offload + CUDA graphs of the layers"),
    "sloth_kernels_planned": SuiteSystem(
        'lightning_sloth + memory plan for the whole card (offload="auto", memory_budget="auto")'
    ),
    "sloth_kernels_offload_single": SuiteSystem(
        "lightning_sloth + offload, single-buffered", _sloth_offload_single, bench._packed_batches
    ),
    "sloth_kernels_kv_repeat": SuiteSystem(
        "lightning_sloth, GQA with the K/V copy",
        _kv_repeated(bench._sloth(kernels=True)),
        bench._packed_batches,
    ),
    "sloth_kernels_torch_checkpoint": SuiteSystem(
        "lightning_sloth, torch's checkpoint per layer",
        bench._sloth(kernels=True, checkpoint_impl="torch"),
        bench._packed_batches,
    ),
    "sloth_kernels_before_host_gap": SuiteSystem(
        "lightning_sloth, K/V copy + unfused add + torch's checkpoint (before the host-gap changes)",
        _kv_repeated(
            _checkpointing_set(
                bench._sloth(kernels={"add_rms_norm": False}, checkpoint_impl="torch"),
                group_adapter_casts=False,
                group_projections=False,
            )
        ),
        bench._packed_batches,
    ),
    "sloth_kernels_per_call_casts": SuiteSystem(
        "lightning_sloth, adapters cast by every LoRA call",
        _checkpointing_set(bench._sloth(kernels=True), group_adapter_casts=False),
        bench._packed_batches,
    ),
    "sloth_kernels_per_layer_projections": SuiteSystem(
        "lightning_sloth, q/k/v and gate/up LoRA layers one node each",
        _checkpointing_set(bench._sloth(kernels=True), group_projections=False),
        bench._packed_batches,
    ),
    "sloth_kernels_grouped": SuiteSystem(
        "lightning_sloth + LoRA layers sharing an input as one node (group_projections)",
        _checkpointing_set(bench._sloth(kernels=True), group_projections=True),
        bench._packed_batches,
    ),
    "sloth_kernels_offload_grouped": SuiteSystem(
        "lightning_sloth + offload + LoRA layers sharing an input as one node",
        _checkpointing_set(bench._sloth(kernels=True, offload="on"), group_projections=True),
        bench._packed_batches,
    ),
    "sloth_kernels_full_recompute": SuiteSystem(
        "lightning_sloth, the recompute runs the layer's last product too",
        _checkpointing_set(bench._sloth(kernels=True), skip_unread_output=False),
        bench._packed_batches,
    ),
    "sloth_kernels_loss_all_rows": SuiteSystem(
        "lightning_sloth, the loss's logits for every row",
        _loss_on_all_rows(bench._sloth(kernels=True)),
        bench._packed_batches,
    ),
    "sloth_kernels_separate_b": SuiteSystem(
        "lightning_sloth, LoRA B products added after the base products",
        _separate_b_products(bench._sloth(kernels=True)),
        bench._packed_batches,
    ),
    "sloth_kernels_planned_separate_b": SuiteSystem(
        "lightning_sloth + memory plan, LoRA B products added after the base products",
        _separate_b_products(bench._sloth(kernels=True, offload="auto", memory_budget="auto")),
        bench._packed_batches,
    ),
    "sloth_kernels_kept_embedding": SuiteSystem(
        "lightning_sloth, the first layer keeps the embedding output",
        _checkpointing_set(bench._sloth(kernels=True), rebuild_embedding=False),
        bench._packed_batches,
    ),
}
for _op in bench.KERNEL_OPS:
    SUITE_SYSTEMS[f"sloth_kernels_without_{_op}"] = SuiteSystem(f"lightning_sloth, {_op} kernel off")

# QLoRA (conf/bench/scenario/qlora_*.yaml, systems=qlora): NF4 base weights, the same LoRA.
SUITE_SYSTEMS.update(
    {
        "hf_bnb_padded": SuiteSystem(
            "transformers + PEFT + bitsandbytes NF4, SDPA, padded micro-batches of 8",
            _hf_bitsandbytes,
            bench._hf_padded_batches,
        ),
        "hf_bnb_packed": SuiteSystem(
            "transformers + PEFT + bitsandbytes NF4, packed rows, its own SDPA",
            _hf_bitsandbytes,
            bench._packed_batches,
        ),
        "sloth_nf4": SuiteSystem(
            'lightning_sloth, quantize="nf4" (kernels=True)', _sloth_4bit(), bench._packed_batches
        ),
        "sloth_nf4_offload": SuiteSystem(
            'lightning_sloth, quantize="nf4" + offload="on"', _sloth_4bit(offload="on"), bench._packed_batches
        ),
    }
)


def resolve(name: str) -> SuiteSystem:
    """A suite system by name, completing loop systems from :func:`lightning_sloth.bench.resolve_system`
    (so every system of ``bench.SYSTEMS`` runs in the suite too)."""
    if name == "sloth_trainer":
        from lightning_sloth.bench_suite import run_trainer_system

        return SuiteSystem(SUITE_SYSTEMS[name].label, trainer=run_trainer_system)
    system = SUITE_SYSTEMS.get(name)
    if system is not None and system.setup is not None:
        return system
    setup, batches = bench.resolve_system(name)
    label = system.label if system is not None else name
    return SuiteSystem(label, setup, batches, preamble=system.preamble if system else "")
