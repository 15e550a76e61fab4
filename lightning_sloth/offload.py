"""Activation offloading around per-layer checkpointing, and the per-layer memory plan.

Every decoder layer runs under non-reentrant activation checkpointing. The offloader's
saved-tensor hooks wrap the checkpoint call, so they see only what the checkpoint keeps for the
backward: the layer's input. (Inside a checkpoint the innermost hooks win, so hooks installed
there would silently turn recomputation off; they are never installed there.) The input goes to
a reusable pool of pinned host blocks on a side stream and comes back one layer ahead of the
backward::

    forward   compute  | L0      | L1      | L2      | L3      |   L3 is the last layer: its
              copy     |   x0->host  x1->host  x2->host         |   input stays on the device
    backward  compute  | L3'     | L2'     | L1'     | L0'     |   ' = recompute + backward
              copy     | x2->dev | x1->dev | x0->dev |         |   prefetch of layer k-1 runs
                                                                    while layer k computes

Ordering and lifetimes (CUDA):

- the copy stream waits for the compute stream before reading a layer input, and the input is
  ``record_stream``-ed on the copy stream so the caching allocator does not hand its memory out
  before the copy has read it;
- a prefetched tensor is allocated on the compute stream, the copy stream waits for the compute
  stream before writing it, and the compute stream waits on the copy's event before using it;
- a host block returns to the pool once its host-to-device copy is queued: the next copy into
  it is queued on the same copy stream, hence after it.

On a CPU "device" (tests) the same bookkeeping runs with synchronous copies and no streams.

Per-layer plan (:func:`plan_layers` picks one from measured bytes and a memory budget):

- ``keep``: no checkpoint, the layer's activations stay on the device (fastest);
- ``recompute``: checkpoint, the input stays on the device;
- ``offload``: checkpoint, the input lives in host memory until the backward needs it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import cache, partial
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

LayerMode = Literal["keep", "recompute", "offload"]
OffloadPolicy = Literal["auto", "on", "off"]

# Host blocks come in size classes of an eighth of a power of two (at least 1 MiB): a block
# wastes at most 1/8 of its size, and a run whose shapes vary still reuses blocks. They are
# page-locked in place (cudaHostRegister) rather than taken from torch's pinned allocator, which
# rounds every request up to a power of two (a 1.06 GiB layer input would pin 2 GiB).
_MIN_BLOCK_BYTES = 1 << 20
_SIZE_CLASSES_PER_OCTAVE = 8
# At most this many device-to-host copies in flight: a forward that outruns the copy engine
# would otherwise hold every copied input (record_stream delays reuse until its copy ends).
# The throttle is a wait of the compute stream on the oldest copy, not of the host: the host
# keeps queueing work ahead of the GPU, and the GPU only stalls if the copies really fall behind.
_MAX_INFLIGHT_COPIES = 2
# Auto double buffering needs room for the prefetched input plus the activations the current
# layer recomputes; without a measurement, assume a decoder layer saves 16x its input.
_DEFAULT_ACTIVATION_RATIO = 16


# --------------------------------------------------------------------------------------- planner
def _per_layer(name: str, value: int | Sequence[int], num_layers: int) -> list[int]:
    values = [int(value)] * num_layers if isinstance(value, int) else [int(v) for v in value]
    if len(values) != num_layers:
        raise ValueError(f"{name} has {len(values)} entries for {num_layers} layers")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} must be non-negative, got {values}")
    return values


def plan_peak_bytes(
    plan: Sequence[LayerMode], act_bytes_per_layer: Sequence[int], input_bytes_per_layer: Sequence[int]
) -> int:
    """Peak device bytes the layers' activations take under ``plan`` (the planner's memory model).

    Resident after the forward: ``keep`` layers hold their activations, ``recompute`` layers
    their input, ``offload`` layers nothing. The backward of a checkpointed layer ``i`` holds the
    resident bytes of layers below it, its own recomputed activations and, when layer ``i - 1``
    is offloaded, that layer's prefetched input::

        peak = max(sum(resident), max_i(sum(resident[:i]) + act[i] + prefetch[i - 1]))

    Args:
        plan: one mode per layer, in forward order.
        act_bytes_per_layer: bytes one layer saves for its backward without checkpointing
            (its input included).
        input_bytes_per_layer: bytes of one layer's input (what a checkpoint keeps).

    Returns:
        The peak in bytes.
    """
    resident = [
        act if mode == "keep" else inp if mode == "recompute" else 0
        for mode, act, inp in zip(plan, act_bytes_per_layer, input_bytes_per_layer)
    ]
    peak, below = sum(resident), 0
    for i, mode in enumerate(plan):
        if mode != "keep":
            prefetch = input_bytes_per_layer[i - 1] if i > 0 and plan[i - 1] == "offload" else 0
            peak = max(peak, below + act_bytes_per_layer[i] + prefetch)
        below += resident[i]
    return peak


def _last_checkpointed_is_offloaded(plan: Sequence[LayerMode]) -> bool:
    checkpointed = [mode for mode in plan if mode != "keep"]
    return bool(checkpointed) and checkpointed[-1] == "offload"


def plan_layers(
    num_layers: int,
    act_bytes_per_layer: int | Sequence[int],
    input_bytes_per_layer: int | Sequence[int],
    budget_bytes: int,
    *,
    offload: bool = True,
) -> list[LayerMode]:
    """Choose keep / recompute / offload per layer so the activations fit ``budget_bytes``.

    Starts from the leanest plan (every layer offloaded but the last, whose input the backward
    needs first; all recompute without ``offload``) and spends the budget, last layer first:
    first turning offloads into recomputes (each costs one layer input and saves its copies),
    then recomputes into keeps (each costs the layer's activations and saves its recompute). A
    layer is upgraded only while :func:`plan_peak_bytes` stays within the budget. If even the
    leanest plan does not fit, it is returned anyway: it is the least the layers can take.

    Args:
        num_layers: number of decoder layers (>= 1).
        act_bytes_per_layer: bytes each layer saves for the backward without checkpointing
            (one value for all layers, or one per layer).
        input_bytes_per_layer: bytes of each layer's input (one value, or one per layer).
        budget_bytes: device bytes the layers' activations may take.
        offload: allow ``"offload"`` (an offloader is available).

    Returns:
        One of ``"keep"``, ``"recompute"``, ``"offload"`` per layer, in forward order.
    """
    if num_layers < 1:
        raise ValueError(f"plan_layers needs at least one layer, got num_layers={num_layers}")
    act = _per_layer("act_bytes_per_layer", act_bytes_per_layer, num_layers)
    inp = _per_layer("input_bytes_per_layer", input_bytes_per_layer, num_layers)
    plan: list[LayerMode] = ["offload" if offload else "recompute"] * (num_layers - 1) + ["recompute"]

    def upgrade(i: int, mode: LayerMode) -> None:
        previous, plan[i] = plan[i], mode
        if plan_peak_bytes(plan, act, inp) > budget_bytes or _last_checkpointed_is_offloaded(plan):
            plan[i] = previous

    for i in reversed(range(num_layers - 1)):
        upgrade(i, "recompute")
    for i in reversed(range(num_layers)):
        if plan[i] == "recompute":
            upgrade(i, "keep")
    return plan


# ------------------------------------------------------------------------------------ host pool
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


# ------------------------------------------------------------------------------------ offloader
class _Kept:
    """A saved tensor left on the device; unpacking it still drives the prefetch."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class _HostCopy:
    """A saved tensor living in a host block until the backward brings it back."""

    __slots__ = ("__weakref__", "block", "device", "device_tensor", "host", "nbytes", "pool", "ready")

    def __init__(self, pool: HostBufferPool, block: Tensor, host: Tensor, device: torch.device) -> None:
        self.pool, self.block, self.host, self.device = pool, block, host, device
        self.nbytes = host.numel() * host.element_size()
        self.device_tensor: Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def release(self) -> None:
        if self.block is not None:
            self.pool.release(self.block)
            self.block = self.host = None

    def __del__(self) -> None:
        # A forward whose graph is dropped without a backward still returns its blocks. A fetched
        # tensor never unpacked must not go back to the allocator while its copy still writes it.
        if self.device_tensor is not None and self.ready is not None:
            self.ready.synchronize()
        self.release()


class ActivationOffloader:
    """Moves checkpointed layer inputs to host memory in the forward and back in the backward.

    Use it through :func:`apply_checkpointing`, which wraps each layer's checkpoint call in
    :meth:`saved_tensors_hooks`. Tensors smaller than ``min_offload_bytes``, non-contiguous ones,
    parameters, tensor subclasses and tensors on another device stay where they are.

    Policies:

    - ``"off"``: the offloader does nothing (plain checkpointing).
    - ``"on"``: offload, prefetching one layer ahead when ``double_buffer`` (forced: no
      free-memory check). Works on a CPU "device" too, which is what the CPU tests use.
    - ``"auto"``: off on CPU. On CUDA, a prefetch is issued only when the device has room for
      the second buffer next to the recomputing layer's activations, otherwise the input is
      fetched when the backward asks (single-buffered); when the host pool is at its cap or host
      memory cannot be had, tensors stay on the device (off).

    Args:
        policy: ``"auto"``, ``"on"`` or ``"off"``.
        device: device whose tensors are offloaded (default: ``"cuda"`` when available).
        min_offload_bytes: smaller tensors stay on the device.
        max_host_bytes: cap on the host pool (default: half the host memory available now).
        double_buffer: prefetch the next layer's input during the backward.
    """

    def __init__(
        self,
        policy: OffloadPolicy = "auto",
        *,
        device: torch.device | str | None = None,
        min_offload_bytes: int = 1 << 20,
        max_host_bytes: int | None = None,
        double_buffer: bool = True,
    ) -> None:
        if policy not in get_args(OffloadPolicy):
            raise ValueError(f"offload policy must be one of {get_args(OffloadPolicy)}, got {policy!r}")
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be non-negative, got {min_offload_bytes}")
        self.device_type = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("ActivationOffloader: device 'cuda' requested but CUDA is not available")
        self.policy = policy
        self.enabled = policy == "on" or (policy == "auto" and self.device_type == "cuda")
        self.min_offload_bytes = min_offload_bytes
        self.double_buffer = double_buffer
        self.activation_bytes_hint: int | None = None
        if max_host_bytes is None:
            available = _available_host_bytes()
            max_host_bytes = available // 2 if available is not None else None
        self.pool = HostBufferPool(max_host_bytes, pin=self.device_type == "cuda")
        self._cuda = self.device_type == "cuda"
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[weakref.ref[_HostCopy]] = []  # offloaded, not yet fetched; pack order
        self._prefetched: weakref.ref[_HostCopy] | None = None
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
        self._copies: deque[torch.cuda.Event] = deque()
        self._in_backward = True
        self._counters = dict.fromkeys(_COUNTERS, 0.0)

    def __getstate__(self) -> dict[str, Any]:
        # Streams, events and host blocks belong to this process: a copy (a spawned DDP worker)
        # starts with the same settings and nothing else.
        return {
            "policy": self.policy,
            "device": self.device_type,
            "min_offload_bytes": self.min_offload_bytes,
            "max_host_bytes": self.pool.max_bytes,
            "double_buffer": self.double_buffer,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (
            f"ActivationOffloader(policy={self.policy!r}, device_type={self.device_type!r}, "
            f"enabled={self.enabled}, double_buffer={self.double_buffer})"
        )

    def saved_tensors_hooks(self, offload: bool = True) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks to wrap around (never inside) one layer's checkpoint call.

        Args:
            offload: move eligible tensors to host memory; ``False`` keeps them on the device
                (a ``recompute`` layer) while still driving the prefetch of the layer below.
        """
        return torch.autograd.graph.saved_tensors_hooks(partial(self._pack, offload), self._unpack)

    # ---- forward
    def _pack(self, offload: bool, tensor: Tensor) -> _Kept | _HostCopy:
        if self._in_backward:
            self._in_backward = False
            self._counters["steps"] += 1
        if offload and self._eligible(tensor):
            handle = self._offload(tensor)
            if handle is not None:
                return handle
        return _Kept(tensor)

    def _eligible(self, tensor: Tensor) -> bool:
        return (
            type(tensor) is Tensor  # no Parameter, FakeTensor or other subclass
            and tensor.device.type == self.device_type
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() >= max(self.min_offload_bytes, 1)
        )

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _offload(self, tensor: Tensor) -> _HostCopy | None:
        nbytes = tensor.numel() * tensor.element_size()
        block = self.pool.acquire(nbytes)
        if block is None:
            self._counters["kept_on_device_bytes"] += nbytes
            return None
        host = block[:nbytes].view(tensor.dtype).view(tensor.shape)
        if self._cuda:
            stream = self._stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event(enable_timing=True)
                copied.record(stream)
                self._copies.append(copied)
            tensor.record_stream(stream)
            self._throttle(tensor.device)
        else:
            host.copy_(tensor)
        handle = _HostCopy(self.pool, block, host, tensor.device)
        self._pending = [ref for ref in self._pending if ref() is not None]
        self._pending.append(weakref.ref(handle))
        self._counters["offloaded_bytes"] += nbytes
        return handle

    def _throttle(self, device: torch.device) -> None:
        while len(self._copies) > _MAX_INFLIGHT_COPIES:
            self._stream_wait(device, self._copies.popleft(), "forward_wait_ms")

    def _stream_wait(self, device: torch.device, ready: torch.cuda.Event, counter: str) -> None:
        """Make the compute stream wait for ``ready``; the stall is timed (folded in later, no sync)."""
        compute = torch.cuda.current_stream(device)
        waited = torch.cuda.Event(enable_timing=True)
        waited.record(compute)
        compute.wait_event(ready)
        self._waits.append((waited, ready, counter))
        self._fold_waits()

    # ---- backward
    def _unpack(self, packed: _Kept | _HostCopy) -> Tensor:
        self._in_backward = True
        if isinstance(packed, _Kept):
            self._prefetch_next()
            return packed.tensor
        if packed.device_tensor is None:
            if packed.host is None:
                raise RuntimeError(
                    "activation offload: an offloaded tensor was unpacked twice (a second backward "
                    "through the same graph, retain_graph=True); use offload='off' for that"
                )
            self._fetch(packed)
            self._counters["fetched_on_demand"] += 1
        else:
            self._counters["prefetched"] += 1
        tensor, packed.device_tensor = packed.device_tensor, None
        if self._cuda:
            self._stream_wait(tensor.device, packed.ready, "backward_wait_ms")
        packed.release()
        self._prefetch_next()
        return tensor

    def _fetch(self, handle: _HostCopy) -> None:
        if self._cuda:
            # Allocated for the compute stream, written by the copy stream after everything the
            # compute stream queued so far (so a reused block is no longer read), and read by the
            # compute stream only after `ready`. No record_stream: the block is freed the moment
            # the backward drops it, instead of after the copy stream's next sync point (which
            # kept a third layer input alive at the backward's peak).
            stream = self._stream(handle.device)
            tensor = torch.empty(handle.host.shape, dtype=handle.host.dtype, device=handle.device)
            stream.wait_stream(torch.cuda.current_stream(handle.device))
            with torch.cuda.stream(stream):
                tensor.copy_(handle.host, non_blocking=True)
                handle.ready = torch.cuda.Event(enable_timing=True)
                handle.ready.record(stream)
        else:
            tensor = torch.empty_like(handle.host, device=handle.device)
            tensor.copy_(handle.host)
        handle.device_tensor = tensor
        for i in reversed(range(len(self._pending))):
            if self._pending[i]() is handle:
                del self._pending[i]
                break

    def _prefetch_next(self) -> None:
        if not self.double_buffer:
            return
        outstanding = self._prefetched() if self._prefetched is not None else None
        if outstanding is not None and outstanding.device_tensor is not None:
            return  # the second buffer is taken
        while self._pending and self._pending[-1]() is None:
            self._pending.pop()
        if not self._pending:
            return
        handle = self._pending[-1]()
        if self.policy == "auto" and not self._has_room(handle):
            self._counters["prefetch_skipped"] += 1
            return
        self._fetch(handle)
        self._prefetched = weakref.ref(handle)

    def _has_room(self, handle: _HostCopy) -> bool:
        if not self._cuda:
            return True
        free, _ = torch.cuda.mem_get_info(handle.device)
        cached = torch.cuda.memory_reserved(handle.device) - torch.cuda.memory_allocated(handle.device)
        recompute = self.activation_bytes_hint or _DEFAULT_ACTIVATION_RATIO * handle.nbytes
        return free + cached >= handle.nbytes + recompute

    def _fold_waits(self) -> None:
        pending = []
        for waited, ready, counter in self._waits:
            if waited.query() and ready.query():
                self._counters[counter] += max(0.0, waited.elapsed_time(ready))
            else:
                pending.append((waited, ready, counter))
        self._waits = pending

    # ---- statistics
    def stats(self, reset: bool = False) -> dict[str, float]:
        """Counters since the last reset, per forward pass where it says so (no device sync).

        Keys: ``enabled``, ``steps`` (forward passes seen), ``offloaded_bytes_per_step``,
        ``kept_on_device_bytes_per_step`` (eligible but the pool was at its cap),
        ``backward_wait_ms_per_step`` (time the compute stream waited on host-to-device copies;
        copies still in flight are counted at the next call), ``forward_wait_ms_per_step`` (time the
        compute stream waited in the forward for device-to-host copies to drain, likewise), ``prefetched``,
        ``fetched_on_demand``, ``prefetch_skipped`` (prefetch attempts declined by the auto policy
        for lack of free memory; one layer may be declined more than once),
        ``host_pool_bytes``, ``host_pool_in_use_bytes``, ``host_pool_allocations``
        (cumulative), ``host_pinned``.

        Args:
            reset: start a new window after reading.
        """
        if self._cuda:
            self._fold_waits()
        c = self._counters
        steps = max(c["steps"], 1.0)
        out = {
            "enabled": float(self.enabled),
            "steps": c["steps"],
            "offloaded_bytes_per_step": c["offloaded_bytes"] / steps,
            "kept_on_device_bytes_per_step": c["kept_on_device_bytes"] / steps,
            "backward_wait_ms_per_step": c["backward_wait_ms"] / steps,
            "forward_wait_ms_per_step": c["forward_wait_ms"] / steps,
            "prefetched": c["prefetched"],
            "fetched_on_demand": c["fetched_on_demand"],
            "prefetch_skipped": c["prefetch_skipped"],
            "host_pool_bytes": float(self.pool.capacity_bytes),
            "host_pool_in_use_bytes": float(self.pool.in_use_bytes),
            "host_pool_allocations": float(self.pool.allocations),
            "host_pinned": float(self.pool.pin),
        }
        if reset:
            self._counters = dict.fromkeys(_COUNTERS, 0.0)
        return out


_COUNTERS = (
    "steps",
    "offloaded_bytes",
    "kept_on_device_bytes",
    "backward_wait_ms",
    "forward_wait_ms",
    "prefetched",
    "fetched_on_demand",
    "prefetch_skipped",
)


# ------------------------------------------------------------------------ layers and integration
def _unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, "_orig_mod", module)  # torch.compile(layer) wraps it


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers model, plain or PEFT-wrapped.

    Looks for ``nn.ModuleList`` s of ``GradientCheckpointingLayer`` s (entries wrapped by
    ``torch.compile`` count): the one under ``model.get_decoder()`` when there are several,
    else the longest.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    def stacks(root: nn.Module) -> list[nn.ModuleList]:
        return [
            m
            for m in root.modules()
            if isinstance(m, nn.ModuleList)
            and len(m) > 0
            and all(isinstance(_unwrap(layer), GradientCheckpointingLayer) for layer in m)
        ]

    found = stacks(model)
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no nn.ModuleList of transformers GradientCheckpointingLayer "
            "modules; apply_checkpointing supports transformers decoder models"
        )
    if len(found) > 1 and hasattr(model, "get_decoder"):
        decoder = stacks(model.get_decoder())
        found = decoder or found
    return max(found, key=len)


class CheckpointedLayers:
    """The decoder layers under lightning_sloth's checkpointing, with their plan and offloader.

    Made by :func:`apply_checkpointing`; each layer's ``_gradient_checkpointing_func`` calls
    :meth:`run_layer` with its index. With a ``memory_budget``, the first training forward also
    measures each layer (one extra forward per layer, its graph dropped at once) and installs
    :func:`plan_layers`'s plan for the following steps.

    Attributes:
        layers: the decoder layers, in forward order.
        plan: the mode of each layer.
        offloader: the active offloader, or ``None``.
        activation_bytes: measured bytes each layer saves without checkpointing (or ``None``).
        input_bytes: measured bytes of each layer's input (or ``None``).
        budget_bytes: the budget the plan was made for (or ``None``).
    """

    def __init__(
        self,
        model: nn.Module,
        offloader: ActivationOffloader | None,
        plan: Sequence[LayerMode] | None,
        memory_budget: int | Literal["auto"] | None,
        compile_layers: bool | dict[str, Any] = False,
    ) -> None:
        self.model = model
        self.layers = list(find_decoder_layers(model))
        self.offloader = offloader if offloader is not None and offloader.enabled else None
        if plan is not None and memory_budget is not None:
            raise ValueError("apply_checkpointing takes a plan or a memory_budget, not both")
        if memory_budget is not None and memory_budget != "auto" and memory_budget < 0:
            raise ValueError(f"memory_budget must be 'auto' or non-negative bytes, got {memory_budget}")
        self.memory_budget = memory_budget
        self.plan = self._check_plan(plan) if plan is not None else self._leanest_plan()
        self.activation_bytes: list[int] | None = None
        self.input_bytes: list[int] | None = None
        self.budget_bytes: int | None = None
        self._measured: list[tuple[int, int]] = []
        # One compiled entry shared by all layers: they run the same code, so Dynamo builds one
        # graph (module parameters are graph inputs), and the checkpoint and hooks stay eager.
        options = compile_layers if isinstance(compile_layers, dict) else {}
        self._compiled = torch.compile(_call_layer, **options) if compile_layers else None

    def _leanest_plan(self) -> list[LayerMode]:
        if self.offloader is None:
            return ["recompute"] * len(self.layers)
        return ["offload"] * (len(self.layers) - 1) + ["recompute"]

    def _check_plan(self, plan: Sequence[LayerMode]) -> list[LayerMode]:
        plan = list(plan)
        if len(plan) != len(self.layers):
            raise ValueError(f"plan has {len(plan)} entries for {len(self.layers)} decoder layers")
        unknown = sorted({m for m in plan if m not in get_args(LayerMode)})
        if unknown:
            raise ValueError(f"unknown layer modes {unknown}; use {get_args(LayerMode)}")
        if "offload" in plan and self.offloader is None:
            raise ValueError("the plan offloads layers but no enabled ActivationOffloader was given")
        if plan[-1] == "offload":
            raise ValueError(
                "the last layer's input is needed first in the backward: plan it 'recompute' or 'keep'"
            )
        return plan

    @torch.compiler.disable  # an outer torch.compile stops here instead of tracing the hooks
    def run_layer(self, index: int, forward, *args: Any) -> Any:
        """Run layer ``index`` (``forward`` bound to its keyword arguments) under its mode."""
        if torch.is_grad_enabled() and self.memory_budget is not None and self.activation_bytes is None:
            self._measure(index, forward, args)
        if self._compiled is not None:
            forward = partial(self._compiled, forward)
        mode = self.plan[index] if torch.is_grad_enabled() else "keep"
        if mode == "keep":
            return forward(*args)
        if self.offloader is None:
            return checkpoint(forward, *args, use_reentrant=False)
        with self.offloader.saved_tensors_hooks(offload=mode == "offload"):
            return checkpoint(forward, *args, use_reentrant=False)

    def _measure(self, index: int, forward, args: tuple) -> None:
        if index == 0:
            self._measured = []
            self.budget_bytes = self._budget(args)
        # Parameters and the keyword tensors (rotary tables, packing metadata) are shared, not
        # activations of this layer.
        shared = {p.untyped_storage().data_ptr() for p in self.layers[index].parameters()}
        keywords = forward.keywords.values() if isinstance(forward, partial) else ()
        shared |= {t.untyped_storage().data_ptr() for t in _tensors(keywords)}
        if self._compiled is not None:
            forward = partial(self._compiled, forward)
        saved: dict[int, int] = {}

        def count(tensor: Tensor) -> Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in shared:
                saved[storage.data_ptr()] = storage.nbytes()
            # Detached: a saved *output* of a node packed as itself would reference its own
            # grad_fn, a cycle in C++ that no collector breaks: the measuring forward's whole graph
            # (every layer's activations) would stay alive for the rest of the run.
            return tensor.detach()

        device = next((t.device for t in _tensors(args)), torch.device("cpu"))
        rng_devices = [device] if device.type == "cuda" else []
        # The measuring forward must not shift the random streams the real forward sees.
        with (
            torch.random.fork_rng(devices=rng_devices),
            torch.autograd.graph.saved_tensors_hooks(count, _same),
        ):
            forward(*args)
        inputs = sum(t.numel() * t.element_size() for t in _tensors(args))
        self._measured.append((sum(saved.values()), inputs))
        if index == len(self.layers) - 1 and len(self._measured) == len(self.layers):
            self.activation_bytes = [a for a, _ in self._measured]
            self.input_bytes = [i for _, i in self._measured]
            self.replan(self.budget_bytes)

    def _budget(self, args: tuple) -> int | None:
        if self.memory_budget != "auto":
            return self.memory_budget
        device = next((t.device for t in _tensors(args)), None)
        if device is None or device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # Still to come after the first forward: gradients and two fp32 optimizer states of the
        # trainable parameters (Adam-type), plus a tenth of the device for the loss and allocator slack.
        later = sum(
            p.numel() * (p.element_size() + 8)
            for p in self.model.parameters()
            if p.requires_grad and p.grad is None
        )
        return max(0, free + cached - later - total // 10)

    def replan(self, budget_bytes: int | None) -> list[LayerMode]:
        """Re-plan from the measured bytes for ``budget_bytes`` (``None``: keep the leanest plan)."""
        if self.activation_bytes is None or self.input_bytes is None:
            raise RuntimeError("replan needs measured layers: pass memory_budget and run one training step")
        self.budget_bytes = budget_bytes
        if budget_bytes is None:
            self.plan = self._leanest_plan()
        else:
            self.plan = plan_layers(
                len(self.layers),
                self.activation_bytes,
                self.input_bytes,
                budget_bytes,
                offload=self.offloader is not None,
            )
        if self.offloader is not None:
            self.offloader.activation_bytes_hint = max(self.activation_bytes)
        peak = plan_peak_bytes(self.plan, self.activation_bytes, self.input_bytes)
        log.info(
            "layer plan for a %s-byte budget: %s (estimated activation peak %d bytes)",
            budget_bytes,
            {mode: self.plan.count(mode) for mode in get_args(LayerMode)},
            peak,
        )
        if budget_bytes is not None and peak > budget_bytes:
            warnings.warn(
                f"the leanest layer plan needs about {peak} bytes of activations, over the {budget_bytes}-byte budget",
                stacklevel=2,
            )
        return self.plan

    def remove(self) -> None:
        """Turn checkpointing off on every layer (the layers run plainly again)."""
        for layer in self.layers:
            layer = _unwrap(layer)
            layer.gradient_checkpointing = False
            layer.__dict__.pop("_gradient_checkpointing_func", None)


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _call_layer(forward, *args: Any) -> Any:
    return forward(*args)


def _tensors(values) -> list[Tensor]:
    out = []
    for value in values:
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(_tensors(value))
    return out


def apply_checkpointing(
    model: nn.Module,
    *,
    offloader: ActivationOffloader | None = None,
    plan: Sequence[LayerMode] | None = None,
    memory_budget: int | Literal["auto"] | None = None,
    compile_layers: bool | dict[str, Any] = False,
) -> CheckpointedLayers:
    """Checkpoint every decoder layer of a transformers model, wrapped by the offloader's hooks.

    Sets each layer's ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` (the hook
    transformers' ``GradientCheckpointingLayer`` calls in training), so the model's forward is
    untouched. Call it after PEFT wrapping and instead of ``gradient_checkpointing_enable``.

    Regional compilation goes through ``compile_layers``: the compiled layer computation runs
    inside the checkpoint, the checkpoint and the offloader's hooks stay eager around it (Dynamo
    cannot trace saved-tensor hooks; with transformers >= 5.23 a ``layer.compile()`` would compile
    nothing, because the checkpoint call sits inside the layer's own ``forward``).

    Args:
        model: a transformers model, plain or PEFT-wrapped.
        offloader: moves checkpointed inputs to host memory (``None`` or disabled: plain
            non-reentrant checkpointing).
        plan: one mode per layer (``"keep"``, ``"recompute"``, ``"offload"``). Default: every
            layer offloaded but the last (``"recompute"``); all ``"recompute"`` without an
            offloader.
        memory_budget: device bytes for the layers' activations, or ``"auto"`` (the device's free
            memory at the first layer of the first step, less the gradients and Adam states of the
            trainable parameters and a tenth of the device). The first training step measures
            every layer and then :func:`plan_layers` decides per layer. Excludes ``plan``.
        compile_layers: compile each layer's computation with ``torch.compile`` (``True``, or
            a dict of ``torch.compile`` keyword arguments).

    Returns:
        The :class:`CheckpointedLayers` controller (plan, measurements, ``remove()``).
    """
    controller = CheckpointedLayers(model, offloader, plan, memory_budget, compile_layers)
    for index, layer in enumerate(controller.layers):
        layer = _unwrap(layer)
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(controller.run_layer, index)
    return controller


# ----------------------------------------------------------------------------------- callback
class OffloadStatsCallback(Callback):
    """Logs :meth:`ActivationOffloader.stats` as ``offload/<key>`` every ``log_every_n_steps``.

    Args:
        offloader: the offloader to watch (default: ``trainer.strategy.offloader``).
    """

    def __init__(self, offloader: ActivationOffloader | None = None) -> None:
        self.offloader = offloader
        self._logged_step = -1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        offloader = self.offloader or getattr(trainer.strategy, "offloader", None)
        step = trainer.global_step
        if (
            offloader is None
            or not offloader.enabled
            or step % trainer.log_every_n_steps
            or step == self._logged_step
        ):
            return
        self._logged_step = step  # once per optimizer step, however many micro-batches it took
        stats = offloader.stats(reset=True)
        pl_module.log_dict({f"offload/{k}": v for k, v in stats.items()}, on_step=True, batch_size=1)
