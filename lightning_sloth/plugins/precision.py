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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

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
    ) -> None:
        self.quantize = quantize
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

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Quantise the frozen base layers in place (with ``quantize``), then the mode's conversion."""
        if self.quantize is not None:
            from lightning_sloth.quant import quantize_model

            quantize_model(module, self.quantize, self.quantize_skip)
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
