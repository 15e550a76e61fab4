"""``transform_model``: lightning_sloth's transformations of a transformers model, in place.

The one entry point that applies, in order, what the rooms below provide — and what
``SlothStrategy`` applies at ``setup`` (``lightning_sloth.plugins``); call it directly to train
without Lightning::

    from lightning_sloth import transform_model
    report = transform_model(peft_model, kernels=True, offload="on")

1. Triton kernels as torch.library ops, per model family (:mod:`lightning_sloth.patching`);
2. MoE experts through grouped GEMMs (:mod:`lightning_sloth.moe`);
3. packed attention ("sloth" in transformers' ``AttentionInterface``) and ``use_cache=False``;
4. per-layer activation checkpointing, with the activation offloader's hooks around each
   checkpoint and an optional per-layer memory plan (:mod:`lightning_sloth.offload`);
5. regional ``torch.compile`` of each decoder layer, or CUDA graphs of the checkpointed layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_sloth.attention import enable_packed_attention
from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.offload import ActivationOffloader, apply_checkpointing
from lightning_sloth.patching import KernelSettings, apply_experts, apply_kernels, chunk_mlps, compile_blocks

__all__ = ["SlothReport", "transform_model"]


@dataclass
class SlothReport:
    """What :func:`transform_model` applied (logged once by the strategy)."""

    applied: list[str] = field(default_factory=list)
    kernels: Any = None
    experts: Any = None
    checkpointing: Any = None
    offloader: Any = None


def transform_model(
    model: nn.Module,
    *,
    packed_attention: bool = True,
    gradient_checkpointing: bool = True,
    kernels: Any = None,
    offload: str = "off",
    memory_budget: int | str | None = None,
    compile: bool | dict = False,
    moe: bool | str = True,
    checkpoint_impl: str = "node",
    cuda_graphs: bool = False,
    mlp_chunk_tokens: int | str | None = "auto",
) -> SlothReport:
    """Apply lightning_sloth's transformations to a transformers model, in place.

    Order: kernels (replace module forwards) -> packed attention -> checkpointing with the
    offloader's hooks around it -> regional compile of each decoder layer (inside the checkpoint
    when checkpointing, so the checkpoint and hooks stay eager).

    Args:
        model: a module holding a transformers ``PreTrainedModel`` (plain, PEFT-wrapped, or inside
            a LightningModule); LoRA layers injected by PEFT live inside it and are patched too.
        packed_attention: register and select the "sloth" packed attention.
        gradient_checkpointing: non-reentrant checkpointing of every decoder layer.
        kernels: ``KernelSettings``, a dict of its fields, ``True`` (all kernels) or
            ``None``/``False`` (none).
        offload: ``"off"``, ``"on"`` or ``"auto"``: checkpointed layer inputs to pinned host memory.
        memory_budget: device bytes (or ``"auto"``) for the per-layer keep/recompute/offload plan.
        compile: ``torch.compile`` each decoder layer (``True`` or compile kwargs).
        moe: MoE models (the families of ``lightning_sloth.moe.layouts.LAYOUTS``) run their experts through
            ``lightning_sloth.moe`` (grouped GEMMs, LoRA on experts without delta weights);
            ``False`` keeps transformers' experts implementation; ``"fused"`` reads and writes
            the token rows through the routing permutation inside the grouped GEMMs
            (:mod:`lightning_sloth.moe.fused`), ``"separate"`` gathers and combines them in passes
            of their own; ``True`` leaves that to the process-wide switch (by default fused where
            the rows are on CUDA). Dense models ignore it.
        checkpoint_impl: ``"node"`` (the default: each checkpointed layer one autograd node,
            less host time per layer; see ``lightning_sloth.offload.checkpoint``) or ``"torch"``
            (torch's non-reentrant checkpoint per layer).
        cuda_graphs: replay each checkpointed layer's forward and its recompute + backward as
            CUDA graphs (one device; static shapes: ``PackedCollator(pad_to="max_tokens",
            segments_bucket="pow2")``; no dropout). Needs ``gradient_checkpointing`` and the node.
        mlp_chunk_tokens: run each patched gated MLP over token chunks of this many rows, in the
            forward and the recompute, so its ``[tokens, intermediate]`` tensors never exist whole
            (``"auto"``: chunks of 2 GiB of intermediates, only past that length; ``None``: never;
            see ``lightning_sloth.patching.mlp_chunks``). Needs the GLU kernel (``kernels``).
    """
    report = SlothReport()
    hf_model = find_hf_model(model)
    hf_model.config.use_cache = False
    if kernels:
        if kernels is True:
            kernels = KernelSettings()
        elif isinstance(kernels, Mapping):
            kernels = KernelSettings(**kernels)
        report.kernels = apply_kernels(hf_model, kernels)
        report.applied.append("kernels")
        if chunk_mlps(hf_model, mlp_chunk_tokens) and mlp_chunk_tokens is not None:
            report.applied.append(f"token-chunked MLPs ({mlp_chunk_tokens})")
    report.experts = apply_experts(hf_model, enabled=moe)
    if moe and report.experts.experts:
        report.applied.append(f"moe experts, permutation {report.experts.permutation}")
    if packed_attention:
        enable_packed_attention(hf_model)
        report.applied.append("packed attention")
    compile_kwargs = (compile if isinstance(compile, Mapping) else {}) if compile else None
    if offload not in ("off", "on", "auto"):
        raise ValueError(f"offload must be 'off', 'on' or 'auto', got {offload!r}")
    if cuda_graphs and not gradient_checkpointing:
        raise ValueError("cuda_graphs needs gradient_checkpointing=True (it graphs the checkpointed layers)")
    if offload != "off" and not gradient_checkpointing:
        raise ValueError(
            "offload needs gradient_checkpointing=True (it offloads the checkpointed layer inputs)"
        )
    if gradient_checkpointing:
        if offload != "off":
            report.offloader = ActivationOffloader(offload)
            if report.offloader.enabled:
                report.applied.append(f"activation offload ({offload})")
        report.checkpointing = apply_checkpointing(
            hf_model,
            offloader=report.offloader,
            memory_budget=memory_budget,
            compile_layers=compile_kwargs if compile_kwargs is not None else False,
            checkpoint_impl=checkpoint_impl,
            cuda_graphs=cuda_graphs,
        )
        report.applied.append("activation checkpointing" + (" + memory plan" if memory_budget else ""))
        if cuda_graphs:
            report.applied.append("CUDA graphs")
    elif compile_kwargs is not None:
        compile_blocks(hf_model, **compile_kwargs)
    if compile_kwargs is not None:
        report.applied.append("regional compile")
    return report
