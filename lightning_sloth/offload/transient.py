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
"""

from __future__ import annotations

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
