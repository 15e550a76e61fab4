"""``SlothPrecision``: numerics only — the compute dtype, honoured exactly (float32 included).

It resolves to a subclass of Lightning's own precision plugin for the chosen mode, so everything
Lightning knows about its stock plugins (throughput dtype, AMP scaler state in checkpoints) keeps
working::

    "bf16-mixed", "16-mixed"  -> MixedPrecision  (autocast; fp16 uses a GradScaler)
    "bf16-true",  "16-true"   -> HalfPrecision   (weights and float inputs cast in place)
    "32-true"                 -> Precision       (no casting at all)

Integer inputs (``input_ids``, ``cu_seqlens``) are never cast: Lightning's input conversion only
touches floating-point tensors, and ``PackedBatch`` keeps its int32/int64 dtypes.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

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

    ``SlothPrecision(...)`` returns an instance of the matching subclass; ``isinstance(p,
    SlothPrecision)`` holds for all of them, and ``p.precision`` is the resolved mode.
    """

    def __new__(cls, precision: str = "auto", device: str | None = None):
        if cls is SlothPrecision:
            resolved = resolve_precision(precision)
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


class SlothMixedPrecision(SlothPrecision, MixedPrecision):
    """Autocast mixed precision (weights stay float32)."""

    def __init__(self, precision: str = "bf16-mixed", device: str | None = None) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        MixedPrecision.__init__(self, resolve_precision(precision), device)

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

    def __init__(self, precision: str = "bf16-true", device: str | None = None) -> None:
        HalfPrecision.__init__(self, resolve_precision(precision))


class SlothFullPrecision(SlothPrecision):
    """float32 everywhere, exactly."""

    def __init__(self, precision: str = "32-true", device: str | None = None) -> None:
        Precision.__init__(self)
        self.precision = resolve_precision(precision)
