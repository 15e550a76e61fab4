"""A model built on the meta device, sharded by ``fully_shard``, then filled shard by shard on each rank.

A model too large for one device (Qwen3-30B-A3B at full depth, 61 GB of bf16 weights; a 70B in
NF4) is never built whole anywhere. ``SlothFSDPStrategy(meta_weights=...)`` takes a model whose
parameters are on the meta device and, after the transformations and ``fully_shard``::

    meta model ── transform (kernels, experts, checkpointing), 4-bit skeletons ── fully_shard
        └─ to_empty(device): each rank allocates its own shards only (DTensor local tensors)
        └─ materialize_shards: for every parameter, the rows of dim 0 this rank holds are read
           from the source (a checkpoint's rows, or seeded random values); a 4-bit weight's rows
           of packed codes and block scales are quantised from just the elements they cover;
           code books and rotary tables are rebuilt

so a rank holds at most its shards plus one row range of one weight in transit. The sources
(:class:`~lightning_sloth.quant.loading.RandomWeights`,
:class:`~lightning_sloth.quant.loading.CheckpointWeights`) give the same values for a row range
whichever rank asks, so the sharded model is the one a single process would build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.moe.quant import EXPERT_WEIGHTS, expert_storage
from lightning_sloth.ops.nf4_formats import code_book
from lightning_sloth.quant import Linear4bit
from lightning_sloth.quant.loading import (
    CheckpointWeights,
    RandomWeights,
    WeightSource,
    checkpoint_name,
    quantize_rows,
)

__all__ = ["ShardStats", "local_rows", "materialize_shards", "weight_source"]


def weight_source(meta_weights, model: nn.Module) -> WeightSource:
    """The source of ``SlothFSDPStrategy(meta_weights=...)``: ``"random"`` (seeded, with the model
    config's ``initializer_range``), a checkpoint directory, or a source object as it is."""
    if isinstance(meta_weights, (RandomWeights, CheckpointWeights)):
        return meta_weights
    if meta_weights == "random":
        std = getattr(getattr(find_hf_model(model), "config", None), "initializer_range", 0.02)
        return RandomWeights(std=std)
    if isinstance(meta_weights, str):
        return CheckpointWeights(meta_weights)
    raise ValueError(
        f"meta_weights must be 'random', a checkpoint directory or a RandomWeights/CheckpointWeights, "
        f"got {meta_weights!r}"
    )


def local_rows(param: Tensor) -> tuple[int, int]:
    """``(first, stop)``: the rows of dim 0 this rank holds of ``param``.

    A ``DTensor`` sharded on dim 0 over a 1-D mesh (FSDP2) holds chunk ``rank`` of
    ``torch.chunk(rows, world)``: ``ceil(rows / world)`` rows each, the last ranks fewer or none.
    A plain tensor holds every row.
    """
    from torch.distributed.tensor import DTensor, Shard

    rows = param.shape[0] if param.dim() else 1
    if not isinstance(param, DTensor):
        return 0, rows
    if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
        raise ValueError(
            f"materialize_shards reads FSDP2's sharding (Shard(0) over a 1-D mesh), got "
            f"{param.placements} over a {param.device_mesh.ndim}-D mesh"
        )
    per_rank = -(-rows // param.device_mesh.size())
    first = min(param.device_mesh.get_local_rank() * per_rank, rows)
    stop = min(first + per_rank, rows)
    if param.to_local().shape[0] != stop - first:
        raise ValueError(
            f"local shard of {tuple(param.shape)} has {param.to_local().shape[0]} rows, not {stop - first}"
        )
    return first, stop


@dataclass
class ShardStats:
    """What :func:`materialize_shards` made on this rank.

    Attributes:
        parameters: parameters filled (a 4-bit weight counts once, codes and scales together).
        weights_4bit: 4-bit weights among them.
        local_bytes: bytes of this rank's shards of every parameter.
        local_4bit_bytes: bytes of this rank's packed codes and block scales.
        total_4bit_bytes: bytes of the whole model's packed codes and block scales.
        largest_quantized: the most elements quantised at once (one weight's row range).
    """

    parameters: int = 0
    weights_4bit: int = 0
    local_bytes: int = 0
    local_4bit_bytes: int = 0
    total_4bit_bytes: int = 0
    largest_quantized: int = 0


def _local(param: Tensor) -> Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class _FourBitWeight(NamedTuple):
    """One 4-bit weight of a model: the module holding it and how it is stored."""

    module: nn.Module
    codes: str  # attribute of the packed uint8 codes
    scales: str  # attribute of the block scales
    code_book: str  # buffer of the code book
    name: str  # checkpoint name of the dense weight
    shape: tuple[int, ...]
    dtype: torch.dtype  # before quantisation
    quant_type: str
    blocksize: int


def _four_bit_weights(model: nn.Module) -> list[_FourBitWeight]:
    """Every 4-bit weight of ``model``: :class:`Linear4bit` layers and 4-bit expert weights."""
    found = []
    for prefix, module in model.named_modules():
        if isinstance(module, Linear4bit):
            shape = (module.out_features, module.in_features)
            name = checkpoint_name(f"{prefix}.weight" if prefix else "weight")
            found.append(_FourBitWeight(module, "weight", "absmax", "code", name, shape, module.weight_dtype,
                                        module.quant_type, module.blocksize))  # fmt: skip
        for weight in EXPERT_WEIGHTS:
            storage = expert_storage(module, weight) if hasattr(module, weight) else None
            if storage is not None:
                name = checkpoint_name(f"{prefix}.{weight}" if prefix else weight)
                found.append(_FourBitWeight(module, weight, f"{weight}_absmax", f"{weight}_code", name,
                                            storage.shape, storage.dtype, storage.quant_type,
                                            storage.blocksize))  # fmt: skip
    return found


def _meta_buffer_owners(model: nn.Module, code_books: set[tuple[int, str]]) -> list[str]:
    """Modules with meta buffers that are rebuilt from their config (rotary tables); any other meta
    buffer but the 4-bit code books raises."""
    rebuilt = []
    for name, module in model.named_modules():
        meta = [
            b
            for b, t in module.named_buffers(recurse=False)
            if t.is_meta and (id(module), b) not in code_books
        ]
        if not meta:
            continue
        if not hasattr(module, "rope_init_fn") and "Rotary" not in type(module).__name__:
            raise ValueError(
                f"{name} ({type(module).__name__}) has meta buffers {meta} that no source fills; "
                "materialize_shards rebuilds rotary tables and 4-bit code books only"
            )
        rebuilt.append(name)
    return rebuilt


@torch.no_grad()
def materialize_shards(model: nn.Module, source: WeightSource, device: torch.device | str) -> ShardStats:
    """Allocate this rank's shards of a meta-device model on ``device`` and fill them from ``source``; in place.

    Call it on every rank after ``fully_shard`` (the decoder layers and the root), before the
    first forward. Parameters are named as in a transformers checkpoint
    (:func:`~lightning_sloth.quant.loading.checkpoint_name`: PEFT's ``base_layer`` levels removed).
    Dense parameters get the rows of dim 0 the rank holds; a 4-bit weight's packed codes and block
    scales get their rows from :func:`~lightning_sloth.quant.loading.quantize_rows`, which
    quantises only the elements those rows cover (the weight's ``nf4``/``fp4`` format).

    Args:
        model: the sharded model (a LightningModule, PEFT model or transformers model); only its
            transformers model is materialised.
        source: where the values come from.
        device: where the shards live (the rank's GPU; the host under CPU offload).

    Returns:
        :class:`ShardStats` of this rank.
    """
    hf_model = find_hf_model(model)
    device = torch.device(device)
    four_bit = _four_bit_weights(hf_model)
    rotary = _meta_buffer_owners(hf_model, {(id(w.module), w.code_book) for w in four_bit})
    hf_model.to_empty(device=device)
    stats = ShardStats()
    done: set[int] = set()
    for weight in four_bit:
        done.update(_fill_4bit(weight, source, device, stats))
    names = {id(p): n for n, p in hf_model.named_parameters()}
    for param in hf_model.parameters():
        stats.local_bytes += _nbytes(_local(param))
        if id(param) not in done:
            first, stop = local_rows(param)
            row = math.prod(param.shape[1:])
            name, shape = checkpoint_name(names[id(param)]), tuple(param.shape)
            local = _local(param)
            local.copy_(
                source.values(name, shape, param.dtype, first * row, stop * row, device).view_as(local)
            )
            stats.parameters += 1
    for name in rotary:  # computed on the device from the config, kept in the same module object
        module = hf_model.get_submodule(name)  # (patched forwards may hold it)
        with torch.device(device):
            rebuilt = type(module)(config=module.config)
        for buffer, value in rebuilt.named_buffers(recurse=False):
            setattr(module, buffer, value)
    return stats


def _fill_4bit(
    weight: _FourBitWeight, source: WeightSource, device: torch.device, stats: ShardStats
) -> tuple[int, int]:
    """This rank's rows of one 4-bit weight's codes and scales, and its code book; returns the ids
    of the two parameters."""
    codes, scales = getattr(weight.module, weight.codes), getattr(weight.module, weight.scales)
    spans = []

    def values(start: int, stop: int) -> Tensor:
        spans.append(stop - start)  # the dense weight's elements in transit
        return source.values(weight.name, weight.shape, weight.dtype, start, stop, device)

    numel = math.prod(weight.shape)
    packed, absmax = quantize_rows(
        values, numel, weight.quant_type, local_rows(codes), local_rows(scales), weight.blocksize, device
    )
    _local(codes).copy_(packed)
    _local(scales).copy_(absmax.view(torch.int32) if scales.dtype == torch.int32 else absmax)
    getattr(weight.module, weight.code_book).copy_(code_book(weight.quant_type, device).view(torch.int32))
    stats.parameters += 1
    stats.weights_4bit += 1
    stats.largest_quantized = max([stats.largest_quantized, *spans])
    stats.local_4bit_bytes += _nbytes(_local(codes)) + _nbytes(_local(scales))
    stats.total_4bit_bytes += codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    return id(codes), id(scales)
