"""Quantise while loading: the model is built on the meta device and filled layer by layer.

A checkpoint's bf16 weights never all sit on the device: each safetensors shard is read in turn,
each tensor is moved to the device as it arrives, and a linear weight to be quantised becomes a
:class:`~lightning_sloth.quant.linear.Linear4bit` at once (its bf16 copy is dropped before the next
tensor is read). :func:`random_quantized` does the same for a random-weight model (benchmarks):
each module is materialised, initialised and quantised before the next one exists.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
from torch import nn

from lightning_sloth.ops.nf4_formats import BLOCKSIZE, check_quant_type, quantize_4bit
from lightning_sloth.quant.linear import Linear4bit, _is_adapter, _skipped


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _quantisable(name: str, module: nn.Module, skip: tuple[str, ...]) -> bool:
    return type(module) is nn.Linear and not _skipped(name, skip) and not _is_adapter(name)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Rotary tables (non-persistent buffers, computed at construction) are rebuilt on ``device``."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "rope_init_fn") and "Rotary" not in type(module).__name__:
                raise RuntimeError(
                    f"{name} ({type(module).__name__}) has buffers the checkpoint did not fill"
                )
            with torch.device(device):
                _replace(model, name, type(module)(config=module.config))
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"the checkpoint did not fill {len(left)} parameter(s), e.g. {left[:3]}")


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


@torch.no_grad()
def load_quantized(
    path: str | Path,
    quant_type: str = "nf4",
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = ("lm_head",),
) -> nn.Module:
    """A transformers causal LM from a local safetensors checkpoint, its linear layers in 4 bits.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or sharded with an index).
        quant_type: ``"nf4"``, ``"nf4-dq"`` or ``"fp4"``.
        device: where the model is built and quantised.
        dtype: dtype of everything not quantised (embeddings, norms, ``skip`` layers).
        skip: module names (or name parts) kept in ``dtype``.

    Returns:
        The model on ``device``, every base linear a :class:`Linear4bit`; ready for PEFT.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    check_quant_type(quant_type)
    path, device = Path(path), torch.device(device)
    config = AutoConfig.from_pretrained(path)
    model = _meta_model(config, dtype)
    targets = {n for n, m in model.named_modules() if _quantisable(n, m, tuple(skip))}
    pending_bias: dict[str, torch.Tensor] = {}
    for shard in _shards(path):
        with safe_open(str(shard), framework="pt", device="cpu") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                owner, _, leaf = key.rpartition(".")
                tensor = fh.get_tensor(key).to(device=device, dtype=dtype)
                if owner in targets and leaf == "weight":
                    linear = nn.Linear(tensor.shape[1], tensor.shape[0], bias=False, device="meta")
                    linear.weight = nn.Parameter(tensor, requires_grad=False)
                    new = Linear4bit.from_linear(linear, quant_type)
                    if owner in pending_bias:
                        new.bias = nn.Parameter(pending_bias.pop(owner), requires_grad=False)
                    _replace(model, owner, new)
                    del linear, tensor
                elif (
                    owner in targets
                    and leaf == "bias"
                    and not isinstance(model.get_submodule(owner), Linear4bit)
                ):
                    pending_bias[owner] = tensor
                else:
                    module = model.get_submodule(owner)
                    requires_grad = False if isinstance(module, Linear4bit) else None
                    _set_tensor(module, leaf, tensor, requires_grad)
    model.tie_weights()
    _rebuild_meta_buffers(model, device)
    return model


def _set_tensor(module: nn.Module, leaf: str, tensor: torch.Tensor, requires_grad: bool | None) -> None:
    if leaf in module._parameters:
        old = module._parameters[leaf]
        grad = old.requires_grad if requires_grad is None else requires_grad
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        raise KeyError(f"checkpoint tensor {leaf!r} has no place in {type(module).__name__}")


@torch.no_grad()
def random_quantized(
    config,
    quant_type: str = "nf4",
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = ("lm_head",),
    seed: int = 0,
) -> nn.Module:
    """A random-weight transformers causal LM of ``config`` with its linear layers in 4 bits.

    Each module is materialised on ``device``, initialised by the model's own ``_init_weights``
    and, for a base linear, quantised before the next module is touched: the bf16 weights of the
    whole model never exist at once (the 14B shape builds within a few GiB over its 4-bit size).
    """
    check_quant_type(quant_type)
    device = torch.device(device)
    torch.manual_seed(seed)
    model = _meta_model(config, dtype)
    # Names, not modules: a list of modules would keep every replaced bf16 linear alive.
    for name in [name for name, _ in model.named_modules()]:
        module = model.get_submodule(name)
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            continue
        module.to_empty(device=device, recurse=False)
        model._init_weights(module)
        if _quantisable(name, module, tuple(skip)):
            _replace(model, name, Linear4bit.from_linear(module, quant_type))
        del module
    model.tie_weights()
    _rebuild_meta_buffers(model, device)
    return model


# ------------------------------------------------------------------- weights for a model's shards
def checkpoint_name(name: str) -> str:
    """The checkpoint key of a parameter named inside a PEFT-wrapped model: PEFT's ``base_layer``
    levels removed (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``; an experts module under
    two ``target_parameters`` wrappers, ``...experts.base_layer.base_layer.gate_up_proj`` ->
    ``...experts.gate_up_proj``). Adapter names keep their ``lora_A.default`` parts."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a PEFT adapter's parameter (new weights, never in a base checkpoint)."""
    return _is_adapter(name)


class RandomWeights:
    """Seeded random weights that any rank can draw a piece of without drawing the rest.

    The flattened tensor is cut into chunks of ``chunk`` elements; chunk ``k`` of parameter ``name``
    comes from its own generator, seeded by ``(seed, name, k)``. Elements ``[start, stop)`` are the
    same numbers whichever process asks for them and whatever else it asks for: a model sharded over
    any number of ranks gets the weights one process gets (on the same device type). The values
    follow the usual initialisation of a transformers decoder with PEFT LoRA:

    ==========================================  ===========================================
    ``lora_B`` (PEFT's B factors)               zeros (the adapter starts as the identity)
    ``lora_A``                                  uniform in ``+-1/sqrt(fan_in)`` (PEFT's kaiming)
    biases; other 1-D parameters                zeros; ones for norms (``...norm.weight``)
    everything else (linear, experts, embedding) normal(0, ``std``)
    ==========================================  ===========================================

    Args:
        seed: the base seed.
        std: standard deviation of the normal weights (transformers' ``initializer_range``).
        chunk: elements per generator.
    """

    def __init__(self, seed: int = 0, std: float = 0.02, chunk: int = 1 << 20) -> None:
        self.seed, self.std, self.chunk = seed, std, chunk

    def _generator_seed(self, name: str, k: int) -> int:
        return (self.seed * 1_000_003 + zlib.crc32(name.encode()) * 65_537 + k) % (1 << 62)

    @torch.no_grad()
    def values(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int, device
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened ``shape`` tensor ``name``: 1-D, ``dtype``, ``device``."""
        device = torch.device(device)
        count = max(stop - start, 0)
        last = name.rsplit(".", 1)[-1]
        if "lora_B" in name or last == "bias" or (len(shape) == 1 and "norm" not in name):
            return torch.zeros(count, dtype=dtype, device=device)
        if len(shape) == 1:
            return torch.ones(count, dtype=dtype, device=device)
        out = torch.empty(count, dtype=torch.float32, device=device)
        numel, size = math.prod(shape), self.chunk
        bound = 1.0 / math.sqrt(shape[-1])
        for k in range(start // size, -(-stop // size)):
            lo, hi = max(start, k * size), min(stop, (k + 1) * size)
            generator = torch.Generator(device).manual_seed(self._generator_seed(name, k))
            piece = torch.empty(min(size, numel - k * size), dtype=torch.float32, device=device)
            if "lora_A" in name:
                piece.uniform_(-bound, bound, generator=generator)
            else:
                piece.normal_(0.0, self.std, generator=generator)
            out[lo - start : hi - start] = piece[lo - k * size : hi - k * size]
        return out.to(dtype)


# Per-expert checkpoint keys of a fused 3-D expert weight (transformers 5 fuses them when loading):
# qwen3_moe/qwen2_moe name the projections gate/up/down_proj, mixtral w1/w3/w2.
_EXPERT_KEYS = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


class CheckpointWeights:
    """The weights of a local safetensors checkpoint, read a few rows at a time.

    :meth:`values` opens the file holding the key and reads only the rows of dim 0 that cover the
    requested elements (``safe_open(...).get_slice``): a rank of a sharded model reads its own
    shard's rows and nothing else. A fused 3-D expert weight (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``) missing from the checkpoint is assembled from the per-expert
    keys checkpoints store (``experts.<e>.gate_proj.weight`` and ``up_proj``, or Mixtral's ``w1``,
    ``w3``, ``w2``), reading only the experts asked for. PEFT adapters (``lora_*``), which no base
    checkpoint holds, come from ``adapters``.

    Args:
        path: directory with ``model.safetensors`` or ``model.safetensors.index.json``.
        adapters: the source of adapter weights (default ``RandomWeights()``: B zero, A uniform).
    """

    def __init__(self, path: str | Path, adapters: RandomWeights | None = None) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self.adapters = adapters or RandomWeights()
        self.files: dict[str, Path] = {}
        for shard in _shards(self.path):
            with safe_open(str(shard), framework="pt", device="cpu") as fh:
                self.files.update(dict.fromkeys(fh.keys(), shard))  # noqa: SIM118 (not a dict)

    def _rows(self, key: str, first: int, last: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt", device="cpu") as fh:
            return fh.get_slice(key)[first:last]

    def _expert_rows(self, name: str, shape: tuple[int, ...], first: int, last: int) -> torch.Tensor:
        owner, _, weight = name.rpartition(".")
        for parts in _EXPERT_KEYS.get(weight, ()):
            keys = [[f"{owner}.{e}.{p}.weight" for p in parts] for e in range(first, last)]
            if all(k in self.files for row in keys for k in row):
                experts = [torch.cat([self._rows(k, 0, None) for k in row]) for row in keys]
                stacked = torch.stack(experts) if experts else torch.empty(0, *shape[1:])
                if tuple(stacked.shape[1:]) != tuple(shape[1:]):
                    raise ValueError(
                        f"{self.path}: experts of {name} are {tuple(stacked.shape[1:])} per expert, "
                        f"the model's are {tuple(shape[1:])}"
                    )
                return stacked
        raise KeyError(
            f"{self.path} holds no {name!r} (nor its per-expert keys); the checkpoint must hold the "
            "model's base weights under transformers' names"
        )

    @torch.no_grad()
    def values(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int, device
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened checkpoint tensor ``name`` (of the model's
        ``shape``): 1-D, ``dtype``, ``device``. Only the covering rows of dim 0 are read."""
        if is_adapter_name(name):
            return self.adapters.values(name, shape, dtype, start, stop, device)
        row = math.prod(shape[1:])
        first, last = start // row, -(-stop // row)
        if name in self.files:
            rows = self._rows(name, first, last)
            if first == 0 and last >= shape[0] and tuple(rows.shape) != tuple(shape):
                raise ValueError(f"{self.path}: {name} is {tuple(rows.shape)}, the model's is {tuple(shape)}")
        else:
            rows = self._expert_rows(name, shape, first, last)
        flat = rows.reshape(-1)[start - first * row : stop - first * row]
        return flat.to(device=device, dtype=dtype)


WeightSource = RandomWeights | CheckpointWeights


@torch.no_grad()
def quantize_rows(
    values,
    numel: int,
    quant_type: str,
    packed_rows: tuple[int, int],
    absmax_rows: tuple[int, int],
    blocksize: int = BLOCKSIZE,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``packed_rows`` of a weight's packed codes and rows ``absmax_rows`` of its block scales,
    quantising only the elements they cover.

    A weight of ``numel`` elements in 4 bits is ``packed uint8 [ceil(numel / 2), 1]`` and
    ``absmax float32 [ceil(numel / blocksize)]`` (:mod:`lightning_sloth.ops.nf4_formats`). Blocks are
    independent, so the codes and scales of a block-aligned range of elements are exactly those
    rows of the whole weight's: one rank of a sharded model makes its own rows from its own elements.

    Args:
        values: ``values(start, stop) -> Tensor``: elements ``[start, stop)`` of the flattened weight.
        numel: the weight's number of elements.
        quant_type: ``"nf4"`` or ``"fp4"`` (``"nf4-dq"``'s scale offset is the mean over the whole
            weight: not made per rank).
        packed_rows, absmax_rows: ``(first, stop)`` row ranges (either may be empty).

    Returns:
        ``(packed uint8 [b - a, 1], absmax float32 [d - c])``.
    """
    check_quant_type(quant_type)
    if quant_type.endswith("-dq"):
        raise NotImplementedError(
            f"{quant_type}: the double-quantised scales' offset is the mean over the whole weight, so its "
            "shards cannot be made per rank; use nf4 or fp4 for a model materialised shard by shard"
        )
    (a, b), (c, d) = packed_rows, absmax_rows
    spans = []  # the elements each non-empty row range covers
    if b > a:
        spans.append((2 * a, min(2 * b, numel)))
    if d > c:
        spans.append((c * blocksize, min(d * blocksize, numel)))
    packed = torch.empty(max(b - a, 0), 1, dtype=torch.uint8, device=device)
    absmax = torch.empty(max(d - c, 0), dtype=torch.float32, device=device)
    if not spans:
        return packed, absmax
    lo = min(s for s, _ in spans) // blocksize * blocksize
    hi = min(-(-max(e for _, e in spans) // blocksize) * blocksize, numel)
    storage = quantize_4bit(values(lo, hi), quant_type, blocksize)
    packed.copy_(storage.packed[a - lo // 2 : b - lo // 2])
    absmax.copy_(storage.absmax[c - lo // blocksize : d - lo // blocksize])
    return packed, absmax
