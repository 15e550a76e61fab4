"""FP8 base weights: ``LinearFP8`` (a frozen linear layer in e4m3 with per-output-channel scales),
conversion in place from bf16/float32 or 4-bit layers, the PEFT LoRA forward over it, and full
fine-tuning in FP8 through torchao's float8 training.

The module is an ``nn.Linear`` (PEFT wraps it in its plain ``lora.Linear``) whose ``weight`` holds
the e4m3 codes as ``uint8`` and whose ``weight_scale`` buffer holds the float32 scales as ``int32``
bits: ``model.to(torch.bfloat16)``, which Lightning's half precision applies to every floating-point
tensor (FP8 dtypes included), moves them but can never convert them. Its products run
``sloth::linear_fp8`` (:mod:`lightning_sloth.ops.fp8`); LoRA adapters stay in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_sloth.moe.fp8 import has_fp8_experts, quantize_experts_fp8
from lightning_sloth.moe.layouts import layout_of
from lightning_sloth.moe.quant import expert_storage
from lightning_sloth.ops.fp8 import linear_fp8
from lightning_sloth.ops.fp8_formats import (
    FP8_DTYPES,
    check_fp8_device,
    check_grad_format,
    dequantize_rows,
    quantize_rows,
)
from lightning_sloth.ops.fp8_lora import lora_linear_fp8, plain_fp8
from lightning_sloth.ops.fp8_qlora import lora_linear_4bit_fp8
from lightning_sloth.ops.lora_layers import adapter_in
from lightning_sloth.ops.nf4_formats import dequantize_4bit_reference
from lightning_sloth.quant.linear import (
    Linear4bit,
    _is_adapter,
    _is_expert_container,
    _skipped,
    compute_dtype,
    four_bit_storage,
)

_E4M3 = FP8_DTYPES["e4m3"]

FP8_SKIP = ("k_proj", "v_proj")
"""The layers :class:`~lightning_sloth.plugins.SlothPrecision` keeps out of FP8 by default
(``fp8_skip``): the attention's key and value projections. They are the narrow products (4096 ->
1024 on Llama-3.1-8B), slower in FP8 than in bf16 at every measured token count (the two
quantisations outweigh the GEMM), and the keys the most sensitive to FP8 rounding: an error in a key
moves every query's score for it. Over five seeds of the default task, the final training loss
rose 3.0% with every projection in FP8 and 0.8% with these two kept (``docs/qlora.md``)."""


class LinearFP8(nn.Linear):
    """A frozen ``[out, in]`` linear layer stored in FP8 e4m3 with one float32 scale per output channel.

    Build it with :meth:`from_linear` (a bf16/float32 ``nn.Linear``) or :meth:`from_4bit` (a 4-bit
    layer, ours or bitsandbytes': decoded in float32, then quantised). State-dict keys: ``weight``
    (``uint8`` codes), ``weight_scale`` (``int32`` bits of the float32 scales), ``bias``.

    Attributes:
        grad_format: how the input gradient meets the weight: ``"e4m3"``, ``"e5m2"`` or ``"bf16"``.
        weight_dtype: the dtype the weight had before quantisation.
    """

    codes_per_byte = 1  # one e4m3 value per uint8 (flop_parameters counts 4-bit codes as two)

    def __init__(
        self,
        codes: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        grad_format: str = "e4m3",
        weight_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        nn.Module.__init__(self)
        if codes.dtype != _E4M3 or scale.dtype != torch.float32 or scale.shape != (codes.shape[0], 1):
            raise TypeError(
                f"LinearFP8 takes float8_e4m3fn codes [out, in] and float32 scales [out, 1], got "
                f"{codes.dtype} {tuple(codes.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = codes.shape
        self.grad_format = check_grad_format(grad_format)
        self.weight_dtype = weight_dtype
        self.weight = nn.Parameter(codes.view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale", scale.contiguous().view(torch.int32))
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_weight(
        cls, weight: Tensor, bias: Tensor | None = None, grad_format: str = "e4m3", device=None
    ) -> LinearFP8:
        """Quantise a dense ``[out, in]`` weight (on ``device``, default where it is)."""
        weight = weight.detach() if device is None else weight.detach().to(device)
        codes, scale = quantize_rows(weight, "e4m3")
        bias = bias.detach().to(codes.device) if bias is not None else None
        return cls(codes, scale, bias, grad_format, weight.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, grad_format: str = "e4m3", device=None) -> LinearFP8:
        """Quantise ``linear``'s weight; the bias stays as it is."""
        return cls.from_weight(linear.weight, linear.bias, grad_format, device)

    @classmethod
    def from_4bit(cls, module: nn.Module, grad_format: str = "e4m3", device=None) -> LinearFP8:
        """Requantise a 4-bit layer (:class:`~lightning_sloth.quant.Linear4bit` or bitsandbytes'):
        its weight decoded exactly in float32, then rounded to e4m3 per output channel."""
        storage = four_bit_storage(module)
        if storage is None:
            raise TypeError(f"{type(module).__name__} is not a 4-bit linear layer")
        new = cls.from_weight(
            dequantize_4bit_reference(storage, torch.float32), module.bias, grad_format, device
        )
        new.weight_dtype = storage.dtype
        return new

    def fp8_weight(self) -> tuple[Tensor, Tensor]:
        """``(codes [out, in] float8_e4m3fn, scale [out, 1] float32)``, sharing this module's tensors."""
        return self.weight.view(_E4M3), self.weight_scale.view(torch.float32)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The ``[out, in]`` weight the codes stand for, in ``dtype``."""
        return dequantize_rows(*self.fp8_weight(), dtype)

    def forward(self, x: Tensor) -> Tensor:
        dtype = compute_dtype(x)
        y = linear_fp8(x.to(dtype), *self.fp8_weight(), self.grad_format)
        return y + self.bias.to(dtype) if self.bias is not None else y

    # The forward the ops may stand in for (lightning_sloth.ops.fp8_lora.plain_fp8): a subclass that
    # overrides ``forward`` runs its own.
    fp8_module_forward = forward

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dtype != torch.uint8:
            raise ValueError(
                f"checkpoint holds {prefix}weight as {weight.dtype} {tuple(weight.shape)}, but the model stores "
                "it in FP8 (uint8 codes); load the checkpoint into a model without FP8 bases, or convert "
                "after loading"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8=e4m3, grad_format={self.grad_format}"
        )


FP8_EXPERTS_MIN_WIDTH = 2048
"""The smallest expert width (each expert's intermediate size) whose weights
:func:`fp8_base_model` stores in FP8 by default (``experts=None``). One MoE layer with LoRA on the
experts at 16k tokens on the H200 (``docs/moe.md``): the GPT-OSS-20B shape (width 2,880) took 14%
less time with FP8 experts than the fastest bf16 path (13.24 against 15.40 ms), the Qwen3-30B-A3B
shape (width 768) 11% more (9.49 against 8.57 ms): the per-row quantisations and the separate gather
and combine outweigh a narrow expert's GEMMs. Widths in between are unmeasured."""


def _expert_width(module: nn.Module) -> int:
    """Each expert's intermediate size: the input width of ``down_proj``."""
    down = module.down_proj
    return int(down.shape[1] if layout_of(module).transposed else down.shape[2])


def fp8_base_model(
    model: nn.Module,
    skip: Iterable[str] = ("lm_head",),
    grad_format: str = "e4m3",
    device: torch.device | str | None = None,
    experts: bool | None = None,
) -> list[str]:
    """Replace every frozen base linear layer of ``model`` with a :class:`LinearFP8`, in place.

    Converted: plain ``nn.Linear`` layers (bf16/float32), 4-bit layers (ours and bitsandbytes',
    decoded first: QLoRA with FP8 compute) and, as ``experts`` says, the 16-bit 3-D expert weights
    of the MoE families the "sloth" experts run (:func:`~lightning_sloth.moe.fp8.quantize_experts_fp8`).
    Kept: modules whose name has a ``skip`` entry as a part, PEFT adapters and trained copies, 4-bit
    expert weights, the experts of other families, and layers already in FP8. One layer at a time, so
    the model never sits in both formats at once.

    Args:
        model: any module (a PEFT model, a transformers model, a LightningModule).
        skip: module names (or name parts) kept as they are; ``lm_head`` by default.
        grad_format: the layers' input-gradient format (``"e4m3"``, ``"e5m2"``, ``"bf16"``).
        device: where to quantise (default: where each weight is).
        experts: MoE expert weights in FP8: ``None`` (default) for experts at least
            :data:`FP8_EXPERTS_MIN_WIDTH` wide, ``True`` for every experts module, ``False`` for none.

    Returns:
        The qualified names of the layers converted (expert weights as ``<module>.<weight>``).

    Raises:
        ValueError: if nothing could be converted (and nothing was in FP8 already).
        RuntimeError: for a CUDA device without FP8 tensor cores (below sm89).
    """
    if experts not in (None, True, False):
        raise TypeError(f"fp8_base_model: experts must be None, True or False, got {experts!r}")
    check_grad_format(grad_format)
    check_fp8_device(device if device is not None else next((p.device for p in model.parameters()), None))
    skip = tuple(skip)
    converted: list[str] = []
    already = 0
    for name in [name for name, _ in model.named_modules()]:
        module = model.get_submodule(name)
        if (
            experts is not False
            and _is_expert_container(module)
            and not _skipped(name, skip)
            and _runs_sloth_experts(module)
            and (experts or has_fp8_experts(module) or _expert_width(module) >= FP8_EXPERTS_MIN_WIDTH)
        ):
            already += has_fp8_experts(module)
            converted += [f"{name}.{w}" for w in quantize_experts_fp8(module, grad_format, device)]
            if has_fp8_experts(module) and expert_storage(module, "gate_up_proj") is None:
                module.codes_per_byte = 1  # flop_parameters: one e4m3 value per uint8
        for child_name in [child_name for child_name, _ in module.named_children()]:
            child = module.get_submodule(child_name)
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, LinearFP8):
                already += 1
                continue
            if _skipped(full, skip) or _is_adapter(full) or hasattr(child, "base_layer"):
                continue
            if type(child) is nn.Linear:
                new = LinearFP8.from_linear(child, grad_format, device)
            elif four_bit_storage(child) is not None:
                new = LinearFP8.from_4bit(child, grad_format, device)
            else:
                continue
            setattr(module, child_name, new)
            converted.append(full)
    if not converted and not already:
        raise ValueError(
            f"{type(model).__name__} has no linear layer to store in FP8 (skip={list(skip)}); FP8 base "
            "weights are for the frozen linear layers of a transformer"
        )
    return converted


def _runs_sloth_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of a family the "sloth" experts run."""
    try:
        layout_of(module)
    except (NotImplementedError, ValueError, AttributeError):
        return False
    return True


def add_lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """``y + scale * (x A^T) B^T``, the B product added by one ``addmm`` (no separate scale and sum
    passes); ``y [..., out]``, ``x [..., in]``, ``A [r, in]``, ``B [out, r]``, one dtype."""
    xa = F.linear(x, lora_a)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), lora_b.t(), alpha=scale)
    return out.view(y.shape)


def lora_fp8_forward(
    base: LinearFP8,
    x: Tensor,
    lora_a: nn.Linear,
    lora_b: nn.Linear,
    scale: float,
    unread_sum_with: Tensor | None = None,
    overwrite_input: bool = False,
) -> Tensor:
    """``base(x) + scale * (x A^T) B^T`` for a :class:`LinearFP8` ``base``: the base product in FP8,
    the adapters in the compute dtype (autocast's, else x's; adapters stored otherwise are cast,
    gradients flow through the cast). One op, ``sloth::lora_linear_fp8``, adds the adapter's parts
    into the FP8 GEMMs' outputs; a base with hooks of its own (or another forward) runs through the
    module, with the adapter's product added beside it. ``unread_sum_with``: a residual, for
    ``residual + y`` in a backward only (:class:`~lightning_sloth.ops.fp8_lora.UnreadSumFP8`; a plain
    base without bias). ``overwrite_input``: the op's backward writes x's gradient into x's memory
    (an x nothing reads afterwards; the plain base only)."""
    dtype = compute_dtype(x)
    x = x.to(dtype)
    lora_a, lora_b = adapter_in(lora_a.weight, dtype), adapter_in(lora_b.weight, dtype)
    if plain_fp8(base):
        unread = unread_sum_with if base.bias is None else None
        y = lora_linear_fp8(
            x, *base.fp8_weight(), lora_a, lora_b, scale, base.grad_format, unread, overwrite_input
        )
        if unread is not None:
            return y
        y = y + base.bias.to(dtype) if base.bias is not None else y
    else:
        y = add_lora(base(x), x, lora_a, lora_b, scale)
    return y if unread_sum_with is None else unread_sum_with + y


def lora_4bit_fp8_storage(
    x: Tensor,
    storage,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_format: str,
    unread_sum_with: Tensor | None = None,
    overwrite_input: bool = False,
) -> Tensor:
    """``sloth::lora_linear_4bit_fp8`` on a :class:`~lightning_sloth.quant.linear.Packed4bit`: QLoRA
    with FP8 compute, the adapter's parts added into the FP8 products (x, A and B in one dtype);
    ``unread_sum_with`` and ``overwrite_input`` as :func:`~lightning_sloth.ops.fp8_qlora.lora_linear_4bit_fp8`'s."""
    absmax, blocksize = storage.block_absmax(), storage.blocksize
    return lora_linear_4bit_fp8(
        x,
        storage.packed,
        absmax,
        storage.code,
        blocksize,
        lora_a,
        lora_b,
        scale,
        grad_format,
        unread_sum_with,
        overwrite_input,
    )


def fp8_compute_4bit(model: nn.Module, grad_format: str = "e4m3", skip: Iterable[str] = ()) -> list[str]:
    """QLoRA with FP8 compute: every :class:`~lightning_sloth.quant.Linear4bit` of ``model`` keeps its
    4-bit storage and runs its products on FP8 tensor cores (``sloth::linear_4bit_fp8``), in place.

    Args:
        model: any module holding 4-bit layers.
        grad_format: the layers' input-gradient format (``"e4m3"``, ``"e5m2"``, ``"bf16"``).
        skip: module names (or name parts) whose 4-bit layers keep computing in the compute dtype
            (:data:`FP8_SKIP`: the attention's key and value projections).

    Returns:
        The qualified names of the layers switched.

    Raises:
        ValueError: if ``model`` has no 4-bit layer of ours (bitsandbytes' layers: convert them with
            :func:`fp8_base_model`).
        RuntimeError: for a CUDA device without FP8 tensor cores.
    """
    check_grad_format(grad_format)
    skip = tuple(skip)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear4bit)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no 4-bit layer (lightning_sloth.quant.Linear4bit) to compute in FP8; "
            "quantise it first (quantize_model), or convert its linear layers with fp8_base_model"
        )
    check_fp8_device(layers[0][1].weight.device)
    switched = [(name, module) for name, module in layers if not _skipped(name, skip)]
    for _, module in switched:
        module.fp8_grad = grad_format
    return [name for name, _ in switched]


def float8_training(model: nn.Module, skip: Iterable[str] = ("lm_head",)) -> list[str]:
    """Full fine-tuning in FP8: torchao's float8 training (row-wise recipe) on ``model``'s linear
    layers, in place (``torchao.float8.convert_to_float8_training``).

    Layers whose name has a ``skip`` entry as a part, PEFT adapters, and layers whose sides are not
    multiples of 16 (``torch._scaled_mm``'s rule) stay as they are.

    Returns:
        The qualified names of the layers converted.

    Raises:
        ImportError: naming the ``fp8`` extra, where torchao is not installed.
        ValueError: for a model with PEFT adapters (float8 training is full fine-tuning).
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise ImportError(
            "FP8 full fine-tuning runs torchao's float8 training, and torchao is not installed: "
            "pip install 'lightning-sloth[fp8]' (or pip install torchao)"
        ) from error
    adapters = [name for name, _ in model.named_modules() if _is_adapter(name)]
    if adapters:
        raise ValueError(
            f"float8 training is full fine-tuning, but {type(model).__name__} has LoRA adapters (e.g. "
            f"{adapters[0]}); for LoRA over FP8 base weights use SlothPrecision(base_dtype='fp8') "
            "(precision=fp8_lora), or disable LoRA (lora.enabled=false)"
        )
    skip = tuple(skip)
    converted: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        ok = (
            isinstance(module, nn.Linear)
            and not _skipped(name, skip)
            and not _is_adapter(name)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name("rowwise"), module_filter_fn=keep
    )
    if not converted:
        raise ValueError(
            f"{type(model).__name__} has no linear layer for float8 training (skip={list(skip)})"
        )
    return converted
