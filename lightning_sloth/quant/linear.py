"""``Linear4bit``: a frozen linear layer whose weight lives in 4-bit storage, and the in-place conversion.

The module is an ``nn.Linear`` (PEFT wraps it in its plain ``lora.Linear``, and ``in_features`` /
``out_features`` mean what they always do) whose ``weight`` parameter holds the packed ``uint8``
codes. The float32 parts of the storage (block scales, code books, offset) are kept as ``int32``
buffers holding the same bits, so ``model.to(torch.bfloat16)`` (which Lightning's half precision
applies to every floating-point tensor) moves them but can never round them.

Its own forward (used where no LoRA adapter sits on it) runs ``sloth::lora_linear_4bit`` with a
rank-0 adapter: the weight is dequantised into a reusable buffer, never kept for the backward. With
``fp8_grad`` set (``SlothPrecision(quantize=..., base_dtype="fp8")``) its products run on FP8
tensor cores instead (``sloth::linear_4bit_fp8``), the storage unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sloth.moe.fp8 import dequantize_experts_fp8
from lightning_sloth.moe.layouts import LAYOUTS
from lightning_sloth.moe.quant import (
    EXPERT_WEIGHTS,
    dequantize_experts,
    expert_formats,
    model_expert_formats,
    quantize_experts,
)
from lightning_sloth.ops.fp8 import linear_4bit_fp8
from lightning_sloth.ops.nf4 import lora_linear_4bit
from lightning_sloth.ops.nf4_formats import (
    Packed4bit,
    check_quant_type,
    dequantize_4bit_reference,
    from_bnb,
    quantize_4bit,
    to_bnb,
)

_FLOAT_PARTS = ("code", "nested_absmax", "nested_code", "offset")


def _bits(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.int32) if t.dtype == torch.float32 else t.reshape(-1)


class Linear4bit(nn.Linear):
    """A frozen ``[out, in]`` linear layer stored in NF4 / NF4-DQ / FP4 (the bitsandbytes layout).

    Build it with :meth:`from_linear` (quantises) or :meth:`from_storage` (adopts existing storage,
    e.g. a bitsandbytes ``Params4bit``). State-dict keys: ``weight`` (packed codes), ``absmax``,
    ``code`` (and ``nested_absmax``, ``nested_code``, ``offset`` for ``nf4-dq``), ``bias``, plus an
    extra state recording the format, which loading checks.

    Attributes:
        quant_type: ``"nf4"``, ``"nf4-dq"`` or ``"fp4"``.
        blocksize: elements per block scale.
        weight_dtype: the dtype the weight had before quantisation.
        fp8_grad: None (products in the compute dtype), or the input-gradient format of FP8
            compute over the 4-bit storage (``"e4m3"``, ``"e5m2"``, ``"bf16"``).
    """

    fp8_grad: str | None = None

    def __init__(self, storage: Packed4bit, bias: Tensor | None = None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = storage.shape
        self.quant_type, self.blocksize, self.weight_dtype = (
            storage.quant_type,
            storage.blocksize,
            storage.dtype,
        )
        self.weight = nn.Parameter(storage.packed, requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        absmax = storage.absmax
        self.register_buffer("absmax", _bits(absmax))
        self._absmax_float = absmax.dtype == torch.float32
        for name in _FLOAT_PARTS:
            part = getattr(storage, name)
            if part is not None:
                self.register_buffer(name, _bits(part))
            else:
                setattr(self, name, None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, quant_type: str = "nf4", device: torch.device | str | None = None
    ) -> Linear4bit:
        """Quantise ``linear``'s weight (on ``device``, default where it is); the bias stays as it is."""
        weight = linear.weight.detach()
        if device is not None:
            weight = weight.to(device)
        storage = quantize_4bit(weight, check_quant_type(quant_type))
        bias = linear.bias.detach().to(storage.packed.device) if linear.bias is not None else None
        return cls(storage, bias)

    @classmethod
    def from_storage(cls, storage: Packed4bit, bias: Tensor | None = None) -> Linear4bit:
        """Adopt existing 4-bit storage (nothing is re-quantised)."""
        return cls(storage, bias)

    def storage(self) -> Packed4bit:
        """The weight's :class:`Packed4bit` (sharing this module's tensors)."""

        def f32(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.view(torch.float32)

        offset = f32(self.offset)
        return Packed4bit(
            packed=self.weight,
            absmax=self.absmax.view(torch.float32) if self._absmax_float else self.absmax,
            code=f32(self.code),
            shape=(self.out_features, self.in_features),
            dtype=self.weight_dtype,
            quant_type=self.quant_type,
            blocksize=self.blocksize,
            nested_absmax=f32(self.nested_absmax),
            nested_code=f32(self.nested_code),
            offset=offset.reshape(()) if offset is not None else None,
        )

    def forward(self, x: Tensor) -> Tensor:
        dtype = compute_dtype(x)
        x = x.to(dtype)
        if self.fp8_grad is not None:
            y = linear_4bit_fp8_storage(x, self.storage(), self.fp8_grad)
            return y + self.bias.to(dtype) if self.bias is not None else y
        empty = x.new_empty(0, self.in_features)
        y = linear_4bit(x, self.storage(), empty, x.new_empty(self.out_features, 0), 0.0)
        return y + self.bias.to(dtype) if self.bias is not None else y

    def to_bnb_module(self, compute_dtype: torch.dtype | None = None) -> nn.Module:
        """A bitsandbytes ``Linear4bit`` over the same storage (nothing is re-quantised or copied)."""
        import bitsandbytes as bnb

        packed, state = to_bnb(self.storage())
        module = bnb.nn.Linear4bit(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=state.nested,
            quant_type=state.quant_type,
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(
            packed,
            requires_grad=False,
            quant_state=state,
            blocksize=self.blocksize,
            compress_statistics=state.nested,
            quant_type=state.quant_type,
            module=module,
            bnb_quantized=True,
        )
        module.quant_state = state
        if self.bias is not None:
            module.bias = nn.Parameter(self.bias.detach(), requires_grad=False)
        return module

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "shape": [self.out_features, self.in_features],
        }

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if state != mine:
            raise ValueError(
                f"checkpoint quantisation {state} does not match the model's 4-bit layer {mine}; "
                "load it into a model quantised the same way"
            )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dtype != torch.uint8:
            raise ValueError(
                f"checkpoint holds {prefix}weight as {weight.dtype} {tuple(weight.shape)}, but the model stores "
                f"it in 4 bits ({self.quant_type}); load the checkpoint into an unquantised model, or quantise "
                "after loading"
            )
        if weight is not None and prefix + "_extra_state" not in state_dict:
            raise ValueError(
                f"checkpoint has 4-bit {prefix}weight without its quantisation record (_extra_state)"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, quant_type={self.quant_type}"


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a layer computes in: the autocast dtype under autocast, else x's dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def linear_4bit(
    x: Tensor,
    storage: Packed4bit,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    overwrite_input: bool = False,
    unread_sum_with: Tensor | None = None,
) -> Tensor:
    """``sloth::lora_linear_4bit`` on a :class:`Packed4bit` (double-quantised scales decoded first);
    ``overwrite_input`` and ``unread_sum_with`` as :func:`~lightning_sloth.ops.nf4.lora_linear_4bit`'s."""
    return lora_linear_4bit(
        x,
        storage.packed,
        storage.block_absmax(),
        storage.code,
        storage.blocksize,
        lora_a,
        lora_b,
        scale,
        overwrite_input=overwrite_input,
        unread_sum_with=unread_sum_with,
    )


def linear_4bit_fp8_storage(x: Tensor, storage: Packed4bit, grad_format: str) -> Tensor:
    """``sloth::linear_4bit_fp8`` on a :class:`Packed4bit`: the 4-bit weight's product in FP8."""
    return linear_4bit_fp8(
        x,
        storage.packed,
        storage.block_absmax(),
        storage.code,
        storage.blocksize,
        storage.shape[0],
        grad_format,
    )


def four_bit_storage(module: nn.Module) -> Packed4bit | None:
    """The 4-bit storage of a :class:`Linear4bit` or a bitsandbytes ``Linear4bit``, else None."""
    if isinstance(module, Linear4bit):
        return module.storage()
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    if type(weight).__name__ == "Params4bit" and state is not None:
        return from_bnb(weight.data, state)
    return None


def _is_expert_container(module: nn.Module) -> bool:
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def quantize_model(
    model: nn.Module,
    quant_type: str = "nf4",
    skip: Iterable[str] = ("lm_head",),
    device: torch.device | str | None = None,
) -> list[str]:
    """Replace every frozen base ``nn.Linear`` of ``model`` with a :class:`Linear4bit`, in place.

    Modules whose qualified name has a ``skip`` entry as one of its dot-separated parts (or equals it)
    stay as they are; so do PEFT adapters (``lora_A``/``lora_B`` and the like, which train) and
    trained copies (``modules_to_save``), and layers already in 4 bits (ours or bitsandbytes', which
    train through the 4-bit path as they are). Quantised weights are frozen. Each weight is
    quantised where it lives (or on ``device``) as it is reached, one layer at a time.

    Args:
        model: any module (a LightningModule, a PEFT model, a transformers model).
        quant_type: ``"nf4"``, ``"nf4-dq"`` or ``"fp4"``.
        skip: module names (or name parts) to keep in the compute dtype; ``lm_head`` by default.
        device: where to quantise (default: where each weight is).

    Returns:
        The qualified names of the layers converted.

    Raises:
        NotImplementedError: for 3-D expert weights of a MoE family or layout the "sloth" experts
            do not store in 4 bits (every family of ``lightning_sloth.moe.layouts.LAYOUTS`` but
            Llama 4 is).
        ValueError: if nothing could be quantised (and nothing was in 4 bits already).
    """
    check_quant_type(quant_type)
    skip = tuple(skip)
    converted: list[str] = []
    already = 0
    # Names, not modules: a list of modules would keep every replaced linear (and its 16-bit
    # weight) alive until the end, and the whole model would sit in both formats at once.
    for name in [name for name, _ in model.named_modules()]:
        module = model.get_submodule(name)
        if four_bit_storage(module) is not None:
            already += name not in converted
            continue
        if _is_expert_container(module) and not _skipped(name, skip):
            converted += [f"{name}.{p}" for p in _quantize_experts(name, module, quant_type, device)]
        for child_name in [child_name for child_name, _ in module.named_children()]:
            child = module.get_submodule(child_name)
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or _skipped(full, skip) or _is_adapter(full):
                continue
            setattr(module, child_name, Linear4bit.from_linear(child, quant_type, device))
            converted.append(full)
    if not converted and not already:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layer to quantise to {quant_type} (skip={list(skip)}); "
            "4-bit storage is for the frozen linear layers of a transformer"
        )
    return converted


def _quantize_experts(name: str, module: nn.Module, quant_type: str, device) -> list[str]:
    """4-bit storage for a MoE layer's 3-D expert weights (the families of :data:`~lightning_sloth.moe.layouts.LAYOUTS`)."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    dense = {p for p, v in module.named_parameters(recurse=False) if v.dim() == 3}
    if model_type not in LAYOUTS or not dense <= set(EXPERT_WEIGHTS):
        raise NotImplementedError(
            f"{name} holds 3-D expert weights {sorted(dense)} ({type(module).__name__}, family {model_type!r}); "
            f"4-bit experts are supported for {sorted(LAYOUTS)} (gate_up_proj, down_proj): add the experts "
            "module to quantize_skip to keep them in the compute dtype"
        )
    return quantize_experts(module, quant_type, device)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts or name.endswith("." + s) for s in skip)


def _is_adapter(name: str) -> bool:
    """Whether ``name`` is inside a PEFT adapter or a trained copy (those stay in the compute dtype)."""
    return any(
        part.startswith(("lora_", "lokr_", "loha_", "ia3_")) or part in ("modules_to_save", "original_module")
        for part in name.split(".")
    )


def check_checkpoint_quantization(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Raise a ``ValueError`` if ``state_dict`` stores weights in 4 bits that ``model`` does not, or the reverse.

    Compares the checkpoint's 4-bit linear layers (their quantisation records,
    ``<layer>._extra_state``) and 4-bit MoE expert weights (``uint8`` beside ``<weight>_absmax``)
    with the :class:`Linear4bit` layers and 4-bit experts of ``model``, format included; a
    checkpoint written by a run with another ``quantize`` setting would otherwise fail with a list
    of shape mismatches, or (same shapes, e.g. nf4 against fp4 experts) load silently.
    """
    saved = {
        key.removesuffix("._extra_state"): value["quant_type"]
        for key, value in state_dict.items()
        if key.endswith("._extra_state") and isinstance(value, dict) and "quant_type" in value
    }
    saved |= expert_formats(state_dict)
    mine = {name: m.quant_type for name, m in model.named_modules() if isinstance(m, Linear4bit)}
    mine |= model_expert_formats(model)
    if saved == mine:
        return
    if not mine:
        raise ValueError(
            f"the checkpoint stores {len(saved)} weights in 4 bits ({sorted(set(saved.values()))}, e.g. "
            f"{next(iter(saved))}) but the model has none: resume with the same quantize setting "
            "(SlothPrecision(quantize=...), precision.quantize)"
        )
    if not saved:
        raise ValueError(
            f"the model stores {len(mine)} weights in 4 bits ({sorted(set(mine.values()))}) but the checkpoint "
            "has none: it was written without quantisation; resume without quantize, or load its weights "
            "into an unquantised model and quantise after loading"
        )
    differ = sorted(set(saved.items()) ^ set(mine.items()))
    raise ValueError(
        f"the checkpoint's 4-bit layers do not match the model's: {len(differ)} differ, e.g. {differ[:2]} "
        f"(checkpoint {sorted(set(saved.values()))}, model {sorted(set(mine.values()))})"
    )


@torch.no_grad()
def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[str]:
    """Undo the 4-bit (or FP8) storage of ``model`` in place: dense frozen weights for merging and
    export.

    Every :class:`Linear4bit`, bitsandbytes ``Linear4bit`` and FP8 ``LinearFP8`` (codes times
    scales) becomes an ``nn.Linear`` and every 4-bit or FP8 MoE expert weight a dense 3-D parameter.
    Weights are decoded exactly as training decoded them, ``code[q] * absmax`` in float32
    (double-quantised scales first), then rounded once to ``dtype``: in float32 that is the exact
    value whose rounding the 16-bit compute used. PEFT wrappers stay around the new layers, so
    ``merge_and_unload`` then merges LoRA into them.

    Returns:
        The qualified names converted (experts as ``<module>.<weight>``); empty for a dense model.
    """
    converted: list[str] = []
    for name in [name for name, _ in model.named_modules()]:
        module = model.get_submodule(name)
        converted += [f"{name}.{w}" for w in dequantize_experts(module, dtype)]
        converted += [f"{name}.{w}" for w in dequantize_experts_fp8(module, dtype)]
        # A PEFT wrapper shows its base's weight as its own: only the base layer itself is replaced.
        if not name or hasattr(module, "base_layer"):
            continue
        storage = four_bit_storage(module)
        if storage is not None:
            weight = dequantize_4bit_reference(storage, dtype)
        elif isinstance(module, nn.Linear) and callable(getattr(module, "dequantized", None)):
            weight = module.dequantized(dtype)  # an FP8 base layer (quant.fp8.LinearFP8)
        else:
            continue
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
        converted.append(name)
    return converted
