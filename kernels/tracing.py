"""Host-side facts the ops read on any machine (no Triton import): whether anything traces or
intercepts ops right now, and a tensor's version for the caches keyed on a tensor."""

from __future__ import annotations

import torch

INFERENCE_VERSION = -2
""":func:`tensor_version` of an inference tensor (it keeps no version counter)."""


def tracing() -> bool:
    """Whether ops are being traced or intercepted now: ``torch.compile``/``torch.export``, or a
    dispatch mode (fake tensors, ``make_fx``, ``FlopCounterMode``) is active."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``, or :data:`INFERENCE_VERSION` for a tensor made under ``torch.inference_mode``
    (Lightning's validation and prediction loops; reading its ``_version`` raises). A cache keyed on
    such a tensor goes by its identity alone: it can only change in place inside inference mode."""
    return INFERENCE_VERSION if t.is_inference() else t._version
