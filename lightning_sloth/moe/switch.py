"""The fused-permutation switch: which MoE experts read and write their token rows through the
routing permutation inside the grouped GEMMs (:mod:`.fused`) instead of separate gather and combine
passes.

An experts module's own choice (``transform_model(moe="fused")`` or ``moe="separate"``, likewise
``SlothStrategy(moe=...)`` and ``sloth.moe=...``) wins; else the process-wide switch
(:func:`set_fused_permutation`, or ``LIGHTNING_SLOTH_MOE_FUSED`` = ``1`` / ``0`` / ``auto`` in the
environment). The default, ``auto``, fuses where the rows are on a CUDA device (the Triton kernels)
and keeps the separate passes elsewhere.
"""

from __future__ import annotations

import os

import torch

__all__ = ["FUSED_ATTR", "fused_permutation_enabled", "fused_permutation_setting", "set_fused_permutation"]


def _from_environment() -> bool | None:
    value = os.environ.get("LIGHTNING_SLOTH_MOE_FUSED", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "1", "false", "true", "off", "on"):
        return value in ("1", "true", "on")
    raise ValueError(f"LIGHTNING_SLOTH_MOE_FUSED must be 1, 0 or auto, got {value!r}")


_ENABLED: list[bool | None] = [_from_environment()]


def set_fused_permutation(enabled: bool | None) -> None:
    """The process-wide switch: the fused-permutation ops (True), the separate passes (False), or
    ``None`` ("auto", the default): fused where the rows are on a CUDA device."""
    if not (enabled is None or isinstance(enabled, bool)):
        raise ValueError(f"the fused-permutation switch takes True, False or None (auto), got {enabled!r}")
    _ENABLED[0] = enabled


def fused_permutation_setting() -> bool | None:
    """The process-wide switch as set: True, False or None (auto); for saving and restoring it."""
    return _ENABLED[0]


FUSED_ATTR = "_sloth_fused_permutation"
"""An experts module's own choice (True/False), set by ``apply_experts(..., enabled="fused"/"separate")``."""


def fused_permutation_enabled(
    experts: object | None = None, device: torch.device | str | None = None
) -> bool:
    """Whether the "sloth" experts (``experts``, else any) run the fused-permutation ops for rows on
    ``device``: the module's own choice where one is set, else the process-wide switch; "auto"
    means a CUDA ``device`` (without one: whether CUDA is available)."""
    own = getattr(experts, FUSED_ATTR, None) if experts is not None else None
    choice = _ENABLED[0] if own is None else bool(own)
    if choice is not None:
        return choice
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
