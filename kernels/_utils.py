"""Launch helpers shared by the kernel launchers."""

from __future__ import annotations

import functools

import torch
import triton
from lightning_sloth.kernels.tracing import tracing
from triton.runtime.jit import JITFunction

# Programs per SM for the persistent (grid-stride) kernels: enough to hide latency, few enough that
# the per-program partial sums stay small.
_PROGRAMS_PER_SM = 4


def launchable(kernel):
    """Return ``kernel`` in the form to index with a grid and call.

    While anything traces (``torch.compile``, ``torch.export``, opcheck's fake-tensor passes, any
    dispatch mode) a compiled ``@triton.jit`` kernel goes through ``torch.library.wrap_triton``, so
    that it is traceable inside a ``triton_op``. In plain eager execution the kernel is launched
    directly: ``wrap_triton`` would route every launch through a higher-order op whose dispatch
    (signature binding, pytree walks) costs about half a millisecond of host time per launch.
    Under ``TRITON_INTERPRET=1`` the kernel is an interpreter object, which runs on CPU tensors as
    it is.
    """
    if isinstance(kernel, JITFunction) and tracing():
        return torch.library.wrap_triton(kernel)
    return kernel


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_grid(device: torch.device, work_items: int) -> int:
    """Number of programs for a grid-stride kernel over ``work_items`` blocks (at least 1)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = _PROGRAMS_PER_SM * _multiprocessors(index)
    else:
        cap = 8  # the interpreter on CPU: a few programs exercise the grid-stride loop
    return max(1, min(cap, work_items))


def warps_for(block_elements: int) -> int:
    """Warps for a program holding ``block_elements`` values per tensor (one per 512, 1 to 32)."""
    return min(32, max(1, triton.next_power_of_2(block_elements) // 512))


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, x.shape[-1]]`` view (a copy only if it cannot be viewed so), unit column stride."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def rows_alias(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[rows, x.shape[-1]]`` sharing its memory with unit column stride, or None if that
    needs a copy. Decided from sizes and strides alone, so it also works on fake tensors (tracing)."""
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:  # the leading dimensions cannot be merged without a copy
        return None
    return rows if rows.shape[1] <= 1 or rows.stride(1) == 1 else None
