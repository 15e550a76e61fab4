"""The reusable pool of (pinned) host blocks that offloaded layer inputs live in."""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

# Host blocks come in size classes of an eighth of a power of two (at least 1 MiB): a block
# wastes at most 1/8 of its size, and a run whose shapes vary still reuses blocks. They are
# page-locked in place (cudaHostRegister) rather than taken from torch's pinned allocator, which
# rounds every request up to a power of two (a 1.06 GiB layer input would pin 2 GiB).
_MIN_BLOCK_BYTES = 1 << 20
_SIZE_CLASSES_PER_OCTAVE = 8


def _available_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _block_bytes(nbytes: int) -> int:
    """Size of the block that holds ``nbytes``: the next multiple of 1/8 of the power of two below."""
    if nbytes <= _MIN_BLOCK_BYTES:
        return _MIN_BLOCK_BYTES
    quantum = 1 << ((nbytes - 1).bit_length() - 1 - (_SIZE_CLASSES_PER_OCTAVE.bit_length() - 1))
    return -(-nbytes // quantum) * quantum


_PAGE_BYTES = 4096


def _page_lock(size: int) -> Tensor | None:
    """``size`` bytes of host memory page-locked in place (``cudaHostRegister``), or None.

    The block is a page-aligned view into a slightly larger allocation, so no page it covers is
    shared with other memory (two registrations must never overlap). None where the CUDA runtime
    bindings are missing, where a failed registration could not be cleared from the runtime's
    last error (torch would report it at its next kernel launch), or where it fails.
    """
    try:
        cudart = torch.cuda.cudart()
    except Exception:  # CPU build, other accelerator
        return None
    clear_error = _cuda_get_last_error()
    if clear_error is None:
        return None
    raw = torch.empty(size + _PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % _PAGE_BYTES
    block = raw[offset : offset + size]
    flags = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
    if cudart.cudaHostRegister(block.data_ptr(), size, flags) == cudart.cudaError.success:
        return block
    clear_error()  # handled here: the caller falls back to torch's pinned allocator
    return None


@cache
def _cuda_get_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the CUDA runtime torch loaded (found in this process's mappings)."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
    return None


def _page_unlock(registered: dict[int, Tensor]) -> None:
    """Unlock page-locked blocks before their memory goes back to the allocator."""
    if registered:
        cudart = torch.cuda.cudart()
        for ptr in registered:
            cudart.cudaHostUnregister(ptr)
        registered.clear()


class HostBufferPool:
    """Reusable host blocks for offloaded tensors: pinned for a CUDA device, pageable otherwise.

    Blocks are flat ``uint8`` tensors in size classes of 1/8 of a power of two (at least 1 MiB).
    ``acquire`` hands out the smallest free block that fits and allocates a new one only when none
    does, so after the first step a run of fixed shapes allocates nothing. The pool grows up to
    ``max_bytes``; at the cap it first frees idle blocks too small for the request (a run whose
    shapes grew), and when that is not enough ``acquire`` returns ``None`` and the caller keeps the
    tensor on the device. Pinned blocks are page-locked in place, so they pin exactly their size;
    where that is not available they come from torch's pinned allocator, and where pinning fails
    the pool warns once and continues with pageable memory.

    Args:
        max_bytes: cap on the pool's total size (``None``: no cap).
        pin: allocate page-locked memory (needs CUDA).
    """

    def __init__(self, max_bytes: int | None, pin: bool) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"HostBufferPool max_bytes must be non-negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.pin = pin
        self.allocations = 0
        self.capacity_bytes = 0
        self.in_use_bytes = 0
        self._free: list[Tensor] = []
        self._lock = threading.Lock()  # blocks come back from autograd's threads and finalizers
        # data_ptr -> block for blocks page-locked in place; the finalizer holds the blocks, so
        # their memory is unlocked before it can be freed, whenever the pool goes.
        self._registered: dict[int, Tensor] = {}
        self._page_lock = True
        self._finalizer = weakref.finalize(self, _page_unlock, self._registered)

    def acquire(self, nbytes: int) -> Tensor | None:
        """A free block of at least ``nbytes`` bytes, or ``None`` when the cap forbids one."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fitting:
                block = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            else:
                block = self._allocate(_block_bytes(nbytes))
                if block is None:
                    return None
            self.in_use_bytes += block.numel()
            return block

    def release(self, block: Tensor) -> None:
        """Return a block; its pending copies must be ordered before any later use of it."""
        with self._lock:
            self.in_use_bytes -= block.numel()
            self._free.append(block)

    def close(self) -> None:
        """Free every block (all must have been released) and unlock the pinned ones."""
        with self._lock:
            if self.in_use_bytes:
                raise RuntimeError(f"HostBufferPool.close: {self.in_use_bytes} bytes still in use")
            while self._free:
                self._drop(self._free.pop())

    def _drop(self, block: Tensor) -> None:
        registered = self._registered.pop(block.data_ptr(), None)
        if registered is not None:
            torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
        self.capacity_bytes -= block.numel()

    def _allocate(self, size: int) -> Tensor | None:
        if self.max_bytes is not None and self.capacity_bytes + size > self.max_bytes:
            # Every idle block is smaller than this request (else acquire had taken it): free
            # the smallest ones until the new block fits under the cap.
            self._free.sort(key=Tensor.numel)
            while self._free and self.capacity_bytes + size > self.max_bytes:
                self._drop(self._free.pop(0))
            if self.capacity_bytes + size > self.max_bytes:
                return None
        try:
            block = _page_lock(size) if self.pin and self._page_lock else None
            if block is not None:
                self._registered[block.data_ptr()] = block
            elif self.pin:
                self._page_lock = False  # torch's pinned allocator from now on
                block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            else:
                block = torch.empty(size, dtype=torch.uint8)
        except RuntimeError as err:
            if not self.pin:
                warnings.warn(
                    f"activation offload: host allocation of {size} bytes failed ({err})", stacklevel=3
                )
                return None
            warnings.warn(
                f"activation offload: pinning {size} bytes failed ({err}); using pageable host memory, "
                "whose copies do not overlap with compute",
                stacklevel=3,
            )
            self.pin = False
            return self._allocate(size)
        self.allocations += 1
        self.capacity_bytes += size
        return block
