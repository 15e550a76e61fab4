"""Whether anything traces or intercepts ops right now (no Triton import: the ops read it on any machine)."""

from __future__ import annotations

import torch


def tracing() -> bool:
    """Whether ops are being traced or intercepted now: ``torch.compile``/``torch.export``, or a
    dispatch mode (fake tensors, ``make_fx``, ``FlopCounterMode``) is active."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
