"""What one decoder layer's backward makes beyond the activations it saved, measured on the device.

The memory plan (:mod:`lightning_sloth.offload.planner`) counts the bytes each layer saves in its
forward. Its backward makes more while it runs: the incoming gradient, the gradients of its
intermediates (an MLP's three ``[tokens, intermediate]`` ones at once), its kernels' scratch (a
wide-head attention backward's float32 accumulators). :func:`backward_transient_bytes` runs the
layer's backward once, on the output of the plan's measuring forward, and returns the device's
peak above what was allocated before it. It computes gradients of the layer's trainable
parameters and of its inputs through ``torch.autograd.grad``, which accumulates into no ``.grad``.

On CUDA it resets the device's peak-memory counter (``torch.cuda.reset_peak_memory_stats``): a
peak read later counts from the plan's first step. Elsewhere it returns 0: there is no peak counter
to read, and the plan is made on CUDA only unless a byte budget is given. It also returns 0 in a
process group of more than one rank: there a layer's backward may run the data-parallel engine's
hooks (FSDP2's gathers, its end-of-backward callback) in the middle of the forward, so the
measurement is not made and the plan counts the saved activations alone, as before.

:func:`note_fragmentation`: a plan for the whole card (``memory_budget="auto"``) warns once where
the caching allocator runs without expandable segments, whose fragmentation can outgrow the slack
the plan leaves.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves


def _first_with_grad(output: Any) -> Tensor | None:
    return next((t for t in tree_leaves(output) if isinstance(t, Tensor) and t.grad_fn is not None), None)


def _several_ranks() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def backward_transient_bytes(output: Any, layer: nn.Module, args: tuple, device: torch.device) -> int:
    """Peak device bytes the backward of ``output`` (a layer's forward on ``args``) allocates."""
    if device.type != "cuda" or _several_ranks():
        return 0
    out = _first_with_grad(output)
    if out is None:
        return 0
    wanted = [t for t in tree_leaves(args) if isinstance(t, Tensor) and t.requires_grad]
    wanted += [p for p in layer.parameters() if p.requires_grad]
    if not wanted:
        return 0
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def expandable_segments() -> bool:
    """Whether the caching allocator maps memory in expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, or set at run time)."""
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    text = settings() if settings is not None else ""
    if not text:
        text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in text.replace(" ", "").lower()


_FRAGMENTATION_NOTED: list[bool] = []


def note_fragmentation() -> None:
    """Warn once per process that a plan for the whole card (``memory_budget="auto"``) leaves a tenth
    of the device for the loss and the allocator's slack, which the caching allocator's fragmentation
    can exceed without expandable segments (measured: Gemma 4's 31B layers at 18 layers, 16k tokens,
    H100, ran out of memory with 4.5 GiB reserved but unallocated, and fit at 70.4 GiB with them)."""
    if _FRAGMENTATION_NOTED or expandable_segments():
        return
    _FRAGMENTATION_NOTED.append(True)
    warnings.warn(
        'memory_budget="auto" plans the layers to fill the device; without expandable segments the '
        "caching allocator's fragmentation can take more than the slack the plan leaves. Start the "
        "process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA is initialised).",
        stacklevel=3,
    )
