"""Quantise while loading: the model is built on the meta device and filled layer by layer.

A checkpoint's bf16 weights never all sit on the device: each safetensors shard is read in turn,
each tensor is moved to the device as it arrives, and a linear weight to be quantised becomes a
:class:`~lightning_sloth.quant.linear.Linear4bit` at once (its bf16 copy is dropped before the next
tensor is read). :func:`random_quantized` does the same for a random-weight model (benchmarks):
each module is materialised, initialised and quantised before the next one exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lightning_sloth.ops.nf4_formats import check_quant_type
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
