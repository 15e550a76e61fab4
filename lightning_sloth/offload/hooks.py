"""The saved-tensor hooks that move checkpointed layer inputs to host memory and back.

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
"""

from __future__ import annotations

import weakref
from collections import deque
from functools import partial
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from lightning_sloth.offload.host_pool import HostBufferPool, _available_host_bytes

OffloadPolicy = Literal["auto", "on", "off"]

# At most this many device-to-host copies in flight: a forward that outruns the copy engine
# would otherwise hold every copied input (record_stream delays reuse until its copy ends).
# The throttle is a wait of the compute stream on the oldest copy, not of the host: the host
# keeps queueing work ahead of the GPU, and the GPU only stalls if the copies really fall behind.
_MAX_INFLIGHT_COPIES = 2
# Auto double buffering needs room for the prefetched input plus the activations the current
# layer recomputes; without a measurement, assume a decoder layer saves 16x its input.
_DEFAULT_ACTIVATION_RATIO = 16


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
