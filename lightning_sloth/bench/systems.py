"""The systems the benchmark can run, by name.

A *loop* system is ``(setup(workload) -> model, batches(workload, samples, pad_id))``, trained by
:func:`lightning_sloth.bench.measure.run_loop_system`; a *trainer* system runs through Lightning's
``Trainer`` (:func:`lightning_sloth.bench.measure.run_trainer_system`). :data:`SUITE_SYSTEMS` names
and labels every system of the suite; :func:`resolve` completes a name, including the generated
ones (``sloth_kernels_without_<op>``, ``sloth_kernels_offload_budget_<N>gib``).

Loop systems (all with LoRA r=16 on the 7 projections and gradient checkpointing, bf16):
    hf_padded              transformers + PEFT, SDPA, padded micro-batches of 8 samples
                           accumulated to the step's token budget (the baseline).
    hf_packed_sdpa         transformers + PEFT on our packed rows with its own SDPA (packing alone,
                           transformers detects the documents from position_ids).
    hf_packed_flex         the same with transformers' FlexAttention (the packed baseline for
                           GPT-OSS, which has no SDPA path).
    sloth                  packed rows + packed attention (``SlothStrategy()``).
    sloth_kernels          + Triton kernels (``SlothStrategy(kernels=True)``).
    sloth_kernels_compile  + regional compile.
    sloth_kernels_offload  + activation offload (``offload="on"``).
    sloth_kernels_planned  + offload "auto" and ``memory_budget="auto"``: the per-layer
                           keep/recompute/offload plan for what the device has free, the caching
                           allocator in expandable segments (its process's preamble).
    sloth_kernels_planned_without_gated_norm
                           the plan with the gated RMSNorm op of Gated DeltaNet layers off
                           (``kernels={"rms_norm_gated": False}``; its ablation).
    sloth_kernels_fused    MoE experts with the token permutation fused into the grouped GEMMs
                           (``moe.fused.set_fused_permutation(True)`` in the system's process; the
                           default on CUDA); ``sloth_kernels_planned_fused``: with the plan.
                           ``sloth_kernels_separate`` / ``sloth_kernels_planned_separate``: the
                           separate gather and combine passes (``set_fused_permutation(False)``).
    sloth_kernels_no_checkpointing
                           kernels without gradient checkpointing (every activation kept).
    sloth_kernels_graphs   + CUDA graphs of each layer's forward and recompute + backward
                           (``cuda_graphs=True``; rows padded to the budget, ``cu_seqlens`` to a
                           power-of-two length). ``sloth_kernels_offload_graphs``: with offload.
    sloth_kernels_offload_budget_<N>gib
                           + offload "on" and a memory plan for ``N`` GiB of layer activations.
    sloth_kernels_without_<op>
                           every kernel but one (ablation; op from KERNEL_OPS).

Trainer systems (lightning_sloth as a user runs it, ``run_trainer_system``; in every GPU system
set next to the ``transform_model`` rows):
    sloth_trainer          ``Trainer(strategy=SlothStrategy(kernels=True),
                           plugins=[SlothPrecision("bf16-mixed")])`` around ``CausalLMModule``.
    sloth_trainer_offload  + ``offload="on"``.
    sloth_trainer_nf4      + ``SlothPrecision(quantize="nf4")`` (QLoRA scenarios);
                           ``sloth_trainer_nf4_offload`` with offload.

FP8 systems (``systems=fp8``; FP8 tensor cores, sm89+):
    sloth_fp8              ``sloth_kernels`` with the frozen base linear layers in FP8 e4m3
                           (``SlothPrecision(base_dtype="fp8")``: k/v kept in bf16);
                           ``sloth_fp8_all`` with k/v in FP8 too (``fp8_skip=()``);
                           ``sloth_fp8_e5m2`` and ``sloth_fp8_bf16grad`` with the other
                           input-gradient formats. ``sloth_fp8_planned``: with
                           ``sloth_kernels_planned``'s memory plan for the whole card;
                           ``sloth_fp8_without_glu_lora`` with gate and up's LoRA parts added by
                           passes of their own (``kernels={"glu_lora": False}``).
    sloth_nf4_fp8          ``sloth_nf4``'s NF4 storage, its products in FP8 (QLoRA with FP8 compute,
                           ``SlothPrecision(quantize="nf4", base_dtype="fp8")``).
    sloth_fp8_exact_accum  ``sloth_fp8`` and ``sloth_nf4_fp8`` with the FP8 products promoting their
    sloth_nf4_fp8_exact_accum  sums to float32 (``fp8_fast_accum=False``).

The suite over these and the peers (Hydra configs under ``conf/bench/``, one JSON per run,

The peers (transformers + PEFT, Liger-Kernel, Unsloth, bitsandbytes) are in
:mod:`lightning_sloth.bench.peers`; the ablations that switch one optimisation off are below,
each with its label.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lightning_sloth.attention import set_varlen_kv_repeat
from lightning_sloth.bench import peers
from lightning_sloth.bench.measure import run_trainer_system
from lightning_sloth.bench.workload import (
    SHAPE_FAMILIES,
    Workload,
    build_model,
    hf_padded_batches,
    packed_batches,
    packed_micro_batches,
    quantized_base_model,
    static_packed_batches,
)
from lightning_sloth.moe.fused import set_fused_permutation
from lightning_sloth.ops import fp8 as fp8_ops
from lightning_sloth.ops import lora_groups
from lightning_sloth.patching import OPS
from lightning_sloth.quant.fp8 import FP8_SKIP, fp8_base_model, fp8_compute_4bit
from lightning_sloth.transform import transform_model


def sloth_setup(**settings) -> Callable:
    """A system that builds the model and applies what ``SlothStrategy(**settings)`` applies."""

    def setup(workload: Workload):
        # The packed attention replaces whatever is built with; GPT-OSS has no SDPA path to build with.
        attn = "eager" if SHAPE_FAMILIES.get(workload.shape) == "gpt_oss" else "sdpa"
        model = build_model(workload, attn, checkpointing=False)
        model._sloth_report = transform_model(model, **settings)
        return model

    return setup


SYSTEMS: dict[str, tuple[Callable, Callable]] = {
    "hf_padded": (lambda w: build_model(w, "sdpa"), hf_padded_batches),
    "hf_packed_sdpa": (lambda w: build_model(w, "sdpa"), packed_batches),
    # transformers' FlexAttention on the packed rows (documents found from position_ids): the packed
    # baseline for families without SDPA (GPT-OSS's attention sinks).
    "hf_packed_flex": (lambda w: build_model(w, "flex_attention"), packed_batches),
    "sloth": (sloth_setup(), packed_batches),
    "sloth_kernels": (sloth_setup(kernels=True), packed_batches),
    "sloth_kernels_compile": (sloth_setup(kernels=True, compile=True), packed_batches),
    "sloth_kernels_offload": (sloth_setup(kernels=True, offload="on"), packed_batches),
    "sloth_kernels_planned": (
        sloth_setup(kernels=True, offload="auto", memory_budget="auto"),
        packed_batches,
    ),
    "sloth_kernels_no_checkpointing": (
        sloth_setup(kernels=True, gradient_checkpointing=False),
        packed_batches,
    ),
    "sloth_kernels_graphs": (sloth_setup(kernels=True, cuda_graphs=True), static_packed_batches),
    "sloth_kernels_offload_graphs": (
        sloth_setup(kernels=True, offload="on", cuda_graphs=True),
        static_packed_batches,
    ),
}


KERNEL_OPS = OPS  # the ops apply_kernels can install, each switched off in an ablation


def resolve_system(name: str) -> tuple[Callable, Callable]:
    """A system by name: one of :data:`SYSTEMS`, a loop system of :data:`SUITE_SYSTEMS` (``sloth_fp8``,
    ``sloth_nf4``, ...: so the harness can profile a step of any of them),
    ``sloth_kernels_without_<op>`` (ablation) or ``sloth_kernels_offload_budget_<N>gib`` (offload
    with a memory plan for N GiB of activations)."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    suite = SUITE_SYSTEMS.get(name)
    if suite is not None and suite.setup is not None and suite.batches is not None:
        return suite.setup, suite.batches
    ablation, budget = "sloth_kernels_without_", "sloth_kernels_offload_budget_"
    if name.startswith(ablation) and name[len(ablation) :] in KERNEL_OPS:
        op = name[len(ablation) :]
        # Without the RMSNorm kernel the fused add + norm (the same kernel) goes too.
        off = {op, "add_rms_norm"} if op == "rms_norm" else {op}
        return sloth_setup(kernels={o: o not in off for o in KERNEL_OPS}), packed_batches
    gib = name[len(budget) : -len("gib")] if name.startswith(budget) and name.endswith("gib") else ""
    try:
        budget_bytes = int(float(gib) * 2**30)
    except ValueError:
        budget_bytes = -1
    if budget_bytes >= 0:
        return sloth_setup(kernels=True, offload="on", memory_budget=budget_bytes), packed_batches
    loops = [n for n, system in SUITE_SYSTEMS.items() if system.setup is not None and n not in SYSTEMS]
    known = sorted(SYSTEMS) + sorted(loops) + [ablation + o for o in KERNEL_OPS] + [budget + "<N>gib"]
    raise SystemExit(f"unknown system {name!r}; choose from {known}")


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


def _sloth_offload_single(workload: Workload):
    model = sloth_setup(kernels=True, offload="on")(workload)
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
        lora_groups.WIDE_ROWS_PER_INPUT = float("inf")
        return setup(workload)

    return wrapped


def _fused_permutation(setup: Callable, enabled: bool = True) -> Callable:
    """``setup`` in a process whose MoE experts read and write their token rows through the sort
    permutation (the fused grouped GEMMs; ``enabled=False``: the separate gather and combine passes)
    whatever the default (each system runs in its own process, so the module setting stays in it)."""

    def wrapped(workload: Workload):
        set_fused_permutation(enabled)
        return setup(workload)

    return wrapped


def _loss_on_all_rows(setup: Callable) -> Callable:
    """``setup``, the fused loss then given no target count: logits for every row, as before."""

    def wrapped(workload: Workload):
        model = setup(workload)
        model._sloth_loss_all_rows = True  # read by measure.loss_kwargs
        return model

    return wrapped


def _kv_repeated(setup: Callable) -> Callable:
    """``setup`` with GQA's K/V heads copied before the varlen kernel (the switched-off default)."""

    def run(workload: Workload):
        set_varlen_kv_repeat(True)  # process-wide; this process runs only this system
        return setup(workload)

    return run


def _sloth_4bit(**settings) -> Callable:
    """lightning_sloth on NF4 base weights: 4-bit model, PEFT LoRA, ``transform_model(kernels=True)``."""

    def setup(workload: Workload):
        model = build_model(workload, "sdpa", checkpointing=False, base=quantized_base_model(workload))
        model._sloth_report = transform_model(model, kernels=True, **settings)
        return model

    return setup


def _sloth_fp8(
    grad_format: str = "e4m3",
    from_4bit: bool = False,
    skip: tuple[str, ...] = FP8_SKIP,
    fast_accum: bool = True,
    **settings,
) -> Callable:
    """lightning_sloth on FP8 base weights: the bf16 model with PEFT LoRA, its base linear layers
    requantised to FP8 e4m3 (``lm_head`` and ``skip`` kept: ``SlothPrecision``'s default
    ``fp8_skip``, the key and value projections); ``from_4bit``: the NF4 model, its storage kept
    and its products but ``skip``'s in FP8 (QLoRA with FP8 compute). ``fast_accum``: the FP8
    products' ``use_fast_accum`` (``SlothPrecision``'s ``fp8_fast_accum``; each system runs in a
    process of its own). Then ``transform_model(kernels=True)``."""

    def setup(workload: Workload):
        fp8_ops.FAST_ACCUM = fast_accum
        base = quantized_base_model(workload) if from_4bit else None
        model = build_model(workload, "sdpa", checkpointing=False, base=base)
        if from_4bit:
            fp8_compute_4bit(model, grad_format, skip)
        else:
            fp8_base_model(model, skip=("lm_head", *skip), grad_format=grad_format)
        model._sloth_report = transform_model(model, **{"kernels": True, **settings})
        return model

    return setup


EXPANDABLE_SEGMENTS = (
    "import os\nos.environ.setdefault('PYTORCH_CUDA_ALLOC_CONF', 'expandable_segments:True')\n"
)
"""The preamble of a plan for the whole card: the caching allocator's fragmentation, without
expandable segments, can take more than the slack the plan leaves (``offload.transient.note_fragmentation``)."""

SUITE_SYSTEMS: dict[str, SuiteSystem] = {
    "hf_padded": SuiteSystem("transformers + PEFT, SDPA, padded micro-batches of 8 (baseline)"),
    "hf_packed_sdpa": SuiteSystem("transformers + PEFT, packed rows, its own SDPA"),
    "hf_packed_varlen": SuiteSystem(
        "transformers + PEFT, packed rows, varlen attention", peers.peft_varlen, packed_batches
    ),
    **{
        f"hf_packed_varlen_micro{parts}": SuiteSystem(
            f"transformers + PEFT, packed rows, varlen attention, {parts} packed micro-batches per step "
            "(gradients accumulated)",
            peers.peft_varlen,
            partial(packed_micro_batches, parts=parts),
        )
        for parts in (2, 4, 8)
    },
    "hf_packed_varlen_per_layer": SuiteSystem(
        "transformers + PEFT, packed rows, varlen attention, metadata derived per layer",
        peers.per_layer_metadata(peers.peft_varlen),
        peers.position_ids_only_batches,
    ),
    "liger_packed_varlen": SuiteSystem(
        "Liger-Kernel + PEFT, packed rows, varlen attention", peers.liger_varlen, packed_batches
    ),
    "unsloth_packed": SuiteSystem(
        'Unsloth, packed rows, use_gradient_checkpointing="unsloth"',
        peers.unsloth,
        peers.unsloth_batches,
        preamble="import os\nos.environ.setdefault('UNSLOTH_DISABLE_STATISTICS', '1')\nimport unsloth\n",
    ),
    "sloth_trainer": SuiteSystem(
        "lightning_sloth: Trainer + SlothStrategy(kernels=True) (user path)", trainer=run_trainer_system
    ),
    "sloth_trainer_offload": SuiteSystem(
        'lightning_sloth: Trainer + SlothStrategy(kernels=True, offload="on") (user path)',
        trainer=partial(run_trainer_system, offload="on"),
    ),
    "sloth_kernels": SuiteSystem("lightning_sloth: transform_model(kernels=True) (API path)"),
    "sloth": SuiteSystem("lightning_sloth, kernels off (packed attention, checkpointing)"),
    "sloth_kernels_metadata_per_layer": SuiteSystem(
        "lightning_sloth, packing metadata derived per layer from position_ids",
        peers.per_layer_metadata(sloth_setup(kernels=True)),
        peers.position_ids_only_batches,
    ),
    "sloth_kernels_offload": SuiteSystem("lightning_sloth + offload, double-buffered"),
    "sloth_kernels_graphs": SuiteSystem("lightning_sloth + CUDA graphs of the layers (cuda_graphs=True)"),
    "sloth_kernels_offload_graphs": SuiteSystem("lightning_sloth + offload + CUDA graphs of the layers"),
    "sloth_kernels_planned": SuiteSystem(
        'lightning_sloth + memory plan for the whole card (offload="auto", memory_budget="auto", '
        "expandable segments)",
        preamble=EXPANDABLE_SEGMENTS,
    ),
    "sloth_kernels_fused": SuiteSystem(
        "lightning_sloth: transform_model(kernels=True), MoE permutation fused into the grouped GEMMs",
        _fused_permutation(sloth_setup(kernels=True)),
        packed_batches,
    ),
    "sloth_kernels_planned_fused": SuiteSystem(
        "lightning_sloth + memory plan for the whole card, MoE permutation fused into the grouped GEMMs",
        _fused_permutation(sloth_setup(kernels=True, offload="auto", memory_budget="auto")),
        packed_batches,
        preamble=EXPANDABLE_SEGMENTS,
    ),
    "sloth_kernels_separate": SuiteSystem(
        "lightning_sloth: transform_model(kernels=True), MoE permutation in separate gather/combine passes",
        _fused_permutation(sloth_setup(kernels=True), enabled=False),
        packed_batches,
    ),
    "sloth_kernels_planned_separate": SuiteSystem(
        "lightning_sloth + memory plan for the whole card, MoE permutation in separate gather/combine passes",
        _fused_permutation(sloth_setup(kernels=True, offload="auto", memory_budget="auto"), enabled=False),
        packed_batches,
        preamble=EXPANDABLE_SEGMENTS,
    ),
    "sloth_kernels_offload_single": SuiteSystem(
        "lightning_sloth + offload, single-buffered", _sloth_offload_single, packed_batches
    ),
    "sloth_kernels_kv_repeat": SuiteSystem(
        "lightning_sloth, GQA with the K/V copy",
        _kv_repeated(sloth_setup(kernels=True)),
        packed_batches,
    ),
    "sloth_kernels_torch_checkpoint": SuiteSystem(
        "lightning_sloth, torch's checkpoint per layer",
        sloth_setup(kernels=True, checkpoint_impl="torch"),
        packed_batches,
    ),
    "sloth_kernels_before_host_gap": SuiteSystem(
        "lightning_sloth, K/V copy + unfused add + torch's checkpoint (before the host-gap changes)",
        _kv_repeated(
            _checkpointing_set(
                sloth_setup(kernels={"add_rms_norm": False}, checkpoint_impl="torch"),
                group_adapter_casts=False,
                group_projections=False,
            )
        ),
        packed_batches,
    ),
    "sloth_kernels_per_call_casts": SuiteSystem(
        "lightning_sloth, adapters cast by every LoRA call",
        _checkpointing_set(sloth_setup(kernels=True), group_adapter_casts=False),
        packed_batches,
    ),
    "sloth_kernels_per_layer_projections": SuiteSystem(
        "lightning_sloth, q/k/v and gate/up LoRA layers one node each",
        _checkpointing_set(sloth_setup(kernels=True), group_projections=False),
        packed_batches,
    ),
    "sloth_kernels_grouped": SuiteSystem(
        "lightning_sloth + LoRA layers sharing an input as one node (group_projections)",
        _checkpointing_set(sloth_setup(kernels=True), group_projections=True),
        packed_batches,
    ),
    "sloth_kernels_offload_grouped": SuiteSystem(
        "lightning_sloth + offload + LoRA layers sharing an input as one node",
        _checkpointing_set(sloth_setup(kernels=True, offload="on"), group_projections=True),
        packed_batches,
    ),
    "sloth_kernels_full_recompute": SuiteSystem(
        "lightning_sloth, the recompute runs the layer's last product too",
        _checkpointing_set(sloth_setup(kernels=True), skip_unread_output=False),
        packed_batches,
    ),
    "sloth_kernels_loss_all_rows": SuiteSystem(
        "lightning_sloth, the loss's logits for every row",
        _loss_on_all_rows(sloth_setup(kernels=True)),
        packed_batches,
    ),
    "sloth_kernels_separate_b": SuiteSystem(
        "lightning_sloth, LoRA B products added after the base products",
        _separate_b_products(sloth_setup(kernels=True)),
        packed_batches,
    ),
    "sloth_kernels_planned_without_gated_norm": SuiteSystem(
        'lightning_sloth + memory plan for the whole card, gated RMSNorm op off (kernels={"rms_norm_gated": False})',
        sloth_setup(kernels={"rms_norm_gated": False}, offload="auto", memory_budget="auto"),
        packed_batches,
        preamble=EXPANDABLE_SEGMENTS,
    ),
    "sloth_kernels_planned_separate_b": SuiteSystem(
        "lightning_sloth + memory plan, LoRA B products added after the base products",
        _separate_b_products(sloth_setup(kernels=True, offload="auto", memory_budget="auto")),
        packed_batches,
    ),
    "sloth_kernels_kept_embedding": SuiteSystem(
        "lightning_sloth, the first layer keeps the embedding output",
        _checkpointing_set(sloth_setup(kernels=True), rebuild_embedding=False),
        packed_batches,
    ),
}


for _op in KERNEL_OPS:
    SUITE_SYSTEMS[f"sloth_kernels_without_{_op}"] = SuiteSystem(f"lightning_sloth, {_op} kernel off")


# QLoRA (conf/bench/scenario/qlora_*.yaml, systems=qlora): NF4 base weights, the same LoRA.
SUITE_SYSTEMS.update(
    {
        "hf_bnb_padded": SuiteSystem(
            "transformers + PEFT + bitsandbytes NF4, SDPA, padded micro-batches of 8",
            peers.hf_bitsandbytes,
            hf_padded_batches,
        ),
        "hf_bnb_packed": SuiteSystem(
            "transformers + PEFT + bitsandbytes NF4, packed rows, its own SDPA",
            peers.hf_bitsandbytes,
            packed_batches,
        ),
        "sloth_nf4": SuiteSystem(
            'lightning_sloth, quantize="nf4" (kernels=True)', _sloth_4bit(), packed_batches
        ),
        "sloth_nf4_offload": SuiteSystem(
            'lightning_sloth, quantize="nf4" + offload="on"', _sloth_4bit(offload="on"), packed_batches
        ),
        "sloth_nf4_planned": SuiteSystem(
            'lightning_sloth, quantize="nf4" + memory plan for the whole card (offload="auto", memory_budget="auto")',
            _sloth_4bit(offload="auto", memory_budget="auto"),
            packed_batches,
        ),
        "sloth_trainer_nf4": SuiteSystem(
            'lightning_sloth: Trainer + SlothPrecision("bf16-mixed", quantize="nf4") (user path)',
            trainer=partial(run_trainer_system, quantize="nf4"),
        ),
        "sloth_trainer_nf4_offload": SuiteSystem(
            'lightning_sloth: Trainer, quantize="nf4" + offload="on" (user path)',
            trainer=partial(run_trainer_system, quantize="nf4", offload="on"),
        ),
    }
)


# FP8 base weights (systems=fp8): beside sloth_kernels (bf16 bases) and sloth_nf4 (NF4 bases).
SUITE_SYSTEMS.update(
    {
        "sloth_fp8": SuiteSystem(
            'lightning_sloth, base_dtype="fp8" (kernels=True)', _sloth_fp8(), packed_batches
        ),
        "sloth_fp8_without_glu_lora": SuiteSystem(
            'lightning_sloth, base_dtype="fp8", gate and up\'s LoRA parts added by passes of their own '
            '(kernels={"glu_lora": False})',
            _sloth_fp8(kernels={"glu_lora": False}),
            packed_batches,
        ),
        "sloth_fp8_all": SuiteSystem(
            'lightning_sloth, base_dtype="fp8", fp8_skip=() (k/v in FP8 too)',
            _sloth_fp8(skip=()),
            packed_batches,
        ),
        "sloth_fp8_e5m2": SuiteSystem(
            'lightning_sloth, base_dtype="fp8", fp8_grad="e5m2"', _sloth_fp8("e5m2"), packed_batches
        ),
        "sloth_fp8_bf16grad": SuiteSystem(
            'lightning_sloth, base_dtype="fp8", fp8_grad="bf16"', _sloth_fp8("bf16"), packed_batches
        ),
        "sloth_fp8_planned": SuiteSystem(
            'lightning_sloth, base_dtype="fp8" + memory plan for the whole card (offload="auto", '
            'memory_budget="auto", expandable segments)',
            _sloth_fp8(offload="auto", memory_budget="auto"),
            packed_batches,
            preamble=EXPANDABLE_SEGMENTS,
        ),
        "sloth_fp8_offload": SuiteSystem(
            'lightning_sloth, base_dtype="fp8" + offload="on"', _sloth_fp8(offload="on"), packed_batches
        ),
        "sloth_nf4_fp8": SuiteSystem(
            'lightning_sloth, quantize="nf4" + base_dtype="fp8" (NF4 storage, FP8 compute)',
            _sloth_fp8(from_4bit=True),
            packed_batches,
        ),
        "sloth_fp8_exact_accum": SuiteSystem(
            'lightning_sloth, base_dtype="fp8", fp8_fast_accum=False',
            _sloth_fp8(fast_accum=False),
            packed_batches,
        ),
        "sloth_nf4_fp8_exact_accum": SuiteSystem(
            'lightning_sloth, quantize="nf4" + base_dtype="fp8", fp8_fast_accum=False',
            _sloth_fp8(from_4bit=True, fast_accum=False),
            packed_batches,
        ),
    }
)


def resolve(name: str) -> SuiteSystem:
    """A suite system by name, completing loop systems from :func:`resolve_system`
    (so every system of :data:`SYSTEMS` runs in the suite too)."""
    system = SUITE_SYSTEMS.get(name)
    if system is not None and (system.setup is not None or system.trainer is not None):
        return system
    setup, batches = resolve_system(name)
    label = system.label if system is not None else name
    return SuiteSystem(label, setup, batches, preamble=system.preamble if system else "")
