"""``SlothPrecision``: numerics only — the compute dtype, honoured exactly (float32 included).

It resolves to a subclass of Lightning's own precision plugin for the chosen mode, so everything
Lightning knows about its stock plugins (throughput dtype, AMP scaler state in checkpoints) keeps
working::

    "bf16-mixed", "16-mixed"  -> MixedPrecision  (autocast; fp16 uses a GradScaler)
    "bf16-true",  "16-true"   -> HalfPrecision   (weights and float inputs cast in place)
    "32-true"                 -> Precision       (no casting at all)

Integer inputs (``input_ids``, ``cu_seqlens``) are never cast: Lightning's input conversion only
touches floating-point tensors, and ``PackedBatch`` keeps its int32/int64 dtypes.

With ``quantize="nf4" | "nf4-dq" | "fp4"`` the frozen base linear layers are stored in 4 bits
(QLoRA), converted in place by ``convert_module`` (``lightning_sloth.quant`` holds the formats,
the 4-bit layer and its ops); they compute in the mode's dtype, float32 included.

With ``base_dtype="fp8"`` the frozen base linear layers are stored in FP8 e4m3 with one scale per
output channel (with ``quantize`` too they stay in 4 bits and each product decodes them to FP8:
QLoRA with FP8 compute, memory unchanged) and their products run ``torch._scaled_mm`` with
activations quantised per row; LoRA, norms, attention and the loss stay in the compute dtype.
``fp8_training=True`` is full fine-tuning in FP8 through torchao's float8 training (row-wise
recipe). Both need FP8 tensor cores on CUDA (sm89+); on CPU they run the plain-torch emulation
(tests).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from lightning_sloth.moe.fp8 import has_fp8_experts
from lightning_sloth.ops import fp8 as fp8_ops
from lightning_sloth.ops.fp8_formats import check_fp8_device, check_grad_format
from lightning_sloth.plugins.local_shards import (
    clip_sharded_grads_,
    stepping_local_shards,
    steps_on_local_shards,
)
from lightning_sloth.quant.fp8 import FP8_SKIP, LinearFP8, float8_training, fp8_base_model, fp8_compute_4bit

log = logging.getLogger(__name__)

PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true")


def resolve_precision(precision: str) -> str:
    """Map ``"auto"`` to the best precision for this machine and validate explicit choices.

    ``auto`` is ``bf16-mixed`` on a CUDA GPU with bfloat16 support, otherwise ``32-true``.
    """
    if precision == "auto":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed"
        return "32-true"
    if precision not in PRECISIONS:
        raise ValueError(
            f"SlothPrecision: unknown precision {precision!r}; choose one of {('auto',) + PRECISIONS}"
        )
    return precision


class SlothPrecision(Precision):
    """The precision plugin of lightning_sloth: ``Trainer(plugins=[SlothPrecision("bf16-true")])``.

    Args:
        precision: ``"auto"`` or one of ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ``"16-true"``, ``"32-true"``. Do not also pass ``Trainer(precision=...)``: Lightning
            rejects a precision plugin together with a precision flag.
        device: device type for autocast in the mixed modes (default: ``"cuda"`` when available).
        quantize: ``None``, or ``"nf4"``, ``"nf4-dq"`` (NF4 with 8-bit block scales) or ``"fp4"``:
            store the frozen base linear layers in 4 bits (bitsandbytes layout), converted in place
            when Lightning calls ``convert_module``. ``SlothPrecision("nf4")`` means
            ``SlothPrecision("auto", quantize="nf4")``.
        quantize_skip: module names (or name parts) kept in the compute dtype (``lm_head``).
        compute_dtype: optional check: the dtype the mode computes in (e.g. ``torch.bfloat16``);
            a mismatch with ``precision`` raises.
        base_dtype: ``None`` (base weights in the compute dtype, or ``quantize``'s 4 bits) or
            ``"fp8"``: frozen base linear layers in FP8 e4m3 with per-output-channel scales, their
            products in FP8 (LoRA; with ``quantize`` the weights stay in 4 bits and each product
            decodes them to FP8: QLoRA with FP8 compute).
        fp8_grad: with ``base_dtype="fp8"``, the incoming gradient's format in the input-gradient
            product: ``"e4m3"`` (default), ``"e5m2"`` or ``"bf16"``.
        fp8_skip: with ``base_dtype="fp8"``, module names (or name parts) whose products stay in
            the compute dtype (stored as ``quantize`` says): ``("k_proj", "v_proj")`` by default
            (:data:`~lightning_sloth.quant.fp8.FP8_SKIP`: narrow, slower in FP8, and the keys the
            most sensitive to its rounding); ``()`` puts every base layer but ``quantize_skip`` in FP8.
        fp8_fast_accum: with ``base_dtype="fp8"``, whether the FP8 products accumulate in the tensor
            cores' fast mode (``torch._scaled_mm(use_fast_accum=True)``, the default: 6-21% faster on
            Hopper, 2-3e-3 relative error beside e4m3's 0.037) or promote to float32 as they go.
            It holds for the whole process (:data:`lightning_sloth.ops.fp8.FAST_ACCUM`), set when
            the module is converted.
        fp8_experts: with ``base_dtype="fp8"``, MoE expert weights in FP8 too
            (:mod:`lightning_sloth.moe.fp8`): ``None`` (default) for experts at least
            :data:`~lightning_sloth.quant.fp8.FP8_EXPERTS_MIN_WIDTH` wide (GPT-OSS-20B's 2,880 gains,
            Qwen3-30B-A3B's 768 loses), ``True`` for all, ``False`` for none. FP8 experts take the
            separate gather and combine passes.
        fp8_training: full fine-tuning with torchao's float8 training (row-wise recipe) on every
            linear layer but ``quantize_skip``; needs the ``fp8`` extra (torchao).

    ``SlothPrecision(...)`` returns an instance of the matching subclass; ``isinstance(p,
    SlothPrecision)`` holds for all of them, and ``p.precision`` is the resolved mode.
    """

    def __new__(cls, precision: str = "auto", device: str | None = None, **quantization: Any):
        if cls is SlothPrecision:
            resolved = resolve_precision(_precision_and_quantize(precision, quantization.get("quantize"))[0])
            if resolved.endswith("-mixed"):
                cls = SlothMixedPrecision
            elif resolved == "32-true":
                cls = SlothFullPrecision
            else:
                cls = SlothHalfPrecision
        return super().__new__(cls)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix multiplications run in."""
        return {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}[
            self.precision.split("-")[0]
        ]

    def _set_quantization(
        self,
        quantize: str | None = None,
        quantize_skip: Sequence[str] = ("lm_head",),
        compute_dtype: torch.dtype | str | None = None,
        base_dtype: str | None = None,
        fp8_grad: str = "e4m3",
        fp8_training: bool = False,
        fp8_skip: Sequence[str] = FP8_SKIP,
        fp8_fast_accum: bool = True,
        fp8_experts: bool | None = None,
    ) -> None:
        self.quantize = quantize
        if fp8_experts not in (None, True, False):
            raise TypeError(f"SlothPrecision: fp8_experts must be None, True or False, got {fp8_experts!r}")
        self.fp8_experts = fp8_experts
        if not isinstance(fp8_fast_accum, bool):
            raise TypeError(f"SlothPrecision: fp8_fast_accum must be True or False, got {fp8_fast_accum!r}")
        self.fp8_fast_accum = fp8_fast_accum
        self._set_fp8(base_dtype, fp8_grad, fp8_training)
        self.fp8_skip = (fp8_skip,) if isinstance(fp8_skip, str) else tuple(fp8_skip)
        if quantize is not None:
            from lightning_sloth.ops.nf4_formats import check_quant_type

            check_quant_type(quantize)
        if isinstance(quantize_skip, str):
            quantize_skip = [quantize_skip]
        self.quantize_skip = tuple(quantize_skip)
        if compute_dtype is not None:
            wanted = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
            if wanted != self.compute_dtype:
                raise ValueError(
                    f"SlothPrecision: compute_dtype={compute_dtype} contradicts precision={self.precision!r}, "
                    f"which computes in {self.compute_dtype}"
                )

    def _set_fp8(self, base_dtype: str | None, fp8_grad: str, fp8_training: bool) -> None:
        if base_dtype not in (None, "fp8"):
            raise ValueError(f"SlothPrecision: base_dtype must be None or 'fp8', got {base_dtype!r}")
        self.base_dtype, self.fp8_grad, self.fp8_training = (
            base_dtype,
            check_grad_format(fp8_grad),
            fp8_training,
        )
        if base_dtype is None and not fp8_training:
            return
        if base_dtype is not None and fp8_training:
            raise ValueError(
                "SlothPrecision: base_dtype='fp8' (frozen FP8 bases for LoRA/QLoRA) and fp8_training=True "
                "(full fine-tuning in FP8) exclude each other; choose one"
            )
        if fp8_training and self.quantize is not None:
            raise ValueError(
                f"SlothPrecision: fp8_training=True trains every weight; it cannot train 4-bit weights "
                f"(quantize={self.quantize!r}); use base_dtype='fp8' with LoRA for FP8 compute over NF4"
            )
        if self.compute_dtype == torch.float16:
            raise ValueError(
                f"SlothPrecision: FP8 products write bfloat16 (or float32 on CPU), not float16 "
                f"(precision={self.precision!r}); use bf16-mixed or bf16-true"
            )
        check_fp8_device()

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        """Lightning's step (the closure: forward, backward, the hooks before the step, clipping;
        then the optimizer); an elementwise optimizer over FSDP2's sharded parameters steps their
        local shards as plain tensors (:func:`~lightning_sloth.plugins.local_shards.stepping_local_shards`),
        without ``DTensor`` dispatch per tensor. A loss scaler (``16-mixed``) keeps Lightning's own."""
        if getattr(self, "scaler", None) is not None or not steps_on_local_shards(optimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = self._wrap_closure(model, optimizer, closure)
        with stepping_local_shards(optimizer):
            optimizer.step(**kwargs)
        return closure_result

    def clip_grad_by_norm(self, optimizer, clip_val: int | float) -> None:
        """Lightning's norm clipping; FSDP2's sharded gradients are clipped on their local shards
        with one ``all_reduce`` of the squared norm (:mod:`~lightning_sloth.plugins.local_shards`)
        instead of torch's ``DTensor`` path, host time a LoRA step of small adapters would pay."""
        if clip_sharded_grads_(self.main_params(optimizer), clip_val) is None:
            super().clip_grad_by_norm(optimizer, clip_val)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Quantise the frozen base layers in place (``quantize``, then ``base_dtype="fp8"``), or
        convert the linear layers to float8 training (``fp8_training``); then the mode's conversion."""
        if self.quantize is not None:
            from lightning_sloth.quant import quantize_model

            quantize_model(module, self.quantize, self.quantize_skip)
        if self.base_dtype == "fp8":
            fp8_ops.FAST_ACCUM = self.fp8_fast_accum
        if self.base_dtype == "fp8" and self.quantize is not None:
            fp8_compute_4bit(module, self.fp8_grad, self.fp8_skip)  # 4-bit storage, FP8 products
        elif self.base_dtype == "fp8":
            fp8_base_model(
                module, self.quantize_skip + self.fp8_skip, self.fp8_grad, experts=self.fp8_experts
            )
            experts = sum(has_fp8_experts(m) for m in module.modules())
            log.info(
                "SlothPrecision: base weights in FP8 e4m3: %d linear layers, %d MoE experts modules%s",
                sum(isinstance(m, LinearFP8) for m in module.modules()),
                experts,
                " (their token permutation in separate passes)" if experts else "",
            )
        if self.fp8_training:
            float8_training(module, self.quantize_skip)
        return super().convert_module(module)


def _precision_and_quantize(precision: str, quantize: str | None) -> tuple[str, str | None]:
    """``("auto", "nf4")`` for ``precision="nf4"``; raises when both name a quantisation."""
    from lightning_sloth.ops.nf4_formats import QUANT_TYPES

    if precision in QUANT_TYPES:
        if quantize is not None:
            raise ValueError(
                f"SlothPrecision: quantisation given twice (precision={precision!r} and quantize={quantize!r}); "
                "pass a compute precision and quantize=..."
            )
        return "auto", precision
    return precision, quantize


class SlothMixedPrecision(SlothPrecision, MixedPrecision):
    """Autocast mixed precision (weights stay float32)."""

    def __init__(self, precision: str = "bf16-mixed", device: str | None = None, **quantization: Any) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        precision, quantization["quantize"] = _precision_and_quantize(precision, quantization.get("quantize"))
        MixedPrecision.__init__(self, resolve_precision(precision), device)
        self._set_quantization(**quantization)

    def clip_gradients(
        self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM
    ) -> None:
        if self.scaler is None:
            # bf16 autocast has no loss scale, so there is nothing to unscale before clipping. Lightning
            # refuses to clip for optimizers that unscale inside their step (fused AdamW) under any
            # AMP; that only matters with fp16's scaler.
            return Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


class SlothHalfPrecision(SlothPrecision, HalfPrecision):
    """Pure half precision: weights, activations and float inputs in bf16/fp16."""

    def __init__(self, precision: str = "bf16-true", device: str | None = None, **quantization: Any) -> None:
        precision, quantization["quantize"] = _precision_and_quantize(precision, quantization.get("quantize"))
        HalfPrecision.__init__(self, resolve_precision(precision))
        self._set_quantization(**quantization)


class SlothFullPrecision(SlothPrecision):
    """float32 everywhere, exactly."""

    def __init__(self, precision: str = "32-true", device: str | None = None, **quantization: Any) -> None:
        precision, quantization["quantize"] = _precision_and_quantize(precision, quantization.get("quantize"))
        Precision.__init__(self)
        self.precision = resolve_precision(precision)
        self._set_quantization(**quantization)
