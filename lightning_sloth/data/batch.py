"""The packed batch: every document of a step laid end to end in one row, with its metadata.

The collator builds a :class:`PackedBatch` once per batch on the host. Attention reads
``cu_seqlens``/``max_seqlen`` from it through the keyword arguments transformers forwards to
the attention function, so no layer rebuilds them and nothing syncs the GPU for them::

    documents   a a a | b b | c c c c | pad pad
    input_ids   [a0 a1 a2 b0 b1 c0 c1 c2 c3 p p]          shape [1, T]
    position_ids[0  1  2  0  1  0  1  2  3  0 1]          restarts per document
    labels      [-100 a1 a2 -100 b1 -100 c1 c2 c3 -100 -100]  (prompt tokens are -100 too)
    cu_seqlens  [0, 3, 5, 9, 11]                          int32, padding is its own segment
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

IGNORE_INDEX = -100

_HOST_BOUNDS = "_sloth_host_cu_seqlens"
"""Attribute of a device ``cu_seqlens`` holding the host tensor it was copied from (:meth:`PackedBatch.to`)."""


def host_cu_seqlens(cu_seqlens: Tensor) -> Tensor | None:
    """The host copy of a batch's ``cu_seqlens``: ``cu_seqlens`` itself on the CPU, the tensor it was
    copied from for one that :meth:`PackedBatch.to` (or :func:`inputs_to_device`) put on a device,
    else None. Per-batch metadata built from the document bounds (e.g. the chunk table of the
    linear-attention kernels) reads it instead of the device tensor: no device-to-host sync."""
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens
    return getattr(cu_seqlens, _HOST_BOUNDS, None)


def _moved(tensor: Tensor, device: torch.device | str, non_blocking: bool) -> Tensor:
    moved = tensor.to(device, non_blocking=non_blocking)
    if moved is not tensor and not tensor.is_floating_point() and tensor.dim() == 1:
        setattr(moved, _HOST_BOUNDS, tensor)  # only cu_seqlens is 1-D among a batch's tensors
    return moved


def inputs_to_device(inputs: dict, device: torch.device | str, non_blocking: bool = True) -> dict:
    """Model inputs (:meth:`PackedBatch.model_inputs`) on ``device``, every tensor moved as
    :meth:`PackedBatch.to` moves it (a device ``cu_seqlens`` keeps its host copy)."""
    return {k: _moved(v, device, non_blocking) if isinstance(v, Tensor) else v for k, v in inputs.items()}


@dataclass
class PackedBatch:
    """One packed training batch.

    Attributes:
        input_ids: ``[1, T]`` int64 token ids of all documents end to end (plus trailing padding).
        labels: ``[1, T]`` int64 targets in transformers' convention (the model shifts them):
            ``-100`` on prompt tokens, on padding and at every document's first position, so no
            target crosses a document boundary.
        position_ids: ``[1, T]`` int64, restarting at 0 for every document.
        cu_seqlens: ``[n + 1]`` int32 cumulative document boundaries (padding is one more segment).
        max_seqlen: longest segment, bucketed up (a Python int, so it never syncs the GPU and
            ``torch.compile`` sees few distinct values).
        num_tokens: real (non-padding) tokens in the batch.
        num_target_tokens: tokens that carry a loss (labels != -100 after the shift).
        capacity: ``T``, the token budget the batch was packed into.
        sum_sq_seqlens: ``Σ len²`` over the real documents (host int), for attention FLOP counts.
        empty_segments: empty segments at the end of ``cu_seqlens`` (``PackedCollator``'s
            ``segments_bucket="pow2"``), which hold no tokens.
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    num_tokens: int
    num_target_tokens: int
    capacity: int
    sum_sq_seqlens: int = 0
    empty_segments: int = 0

    @property
    def num_documents(self) -> int:
        """Number of segments, padding segment included, empty ones not (host-side, no sync)."""
        return self.cu_seqlens.shape[0] - 1 - self.empty_segments

    @property
    def efficiency(self) -> float:
        """Packing efficiency: real tokens / capacity."""
        return self.num_tokens / max(self.capacity, 1)

    def model_inputs(self) -> dict:
        """Keyword arguments for a transformers causal LM forward (without labels).

        ``use_cache=False`` is required: with a cache, transformers ignores the packing metadata.
        """
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
            "use_cache": False,
        }

    def _map_tensors(self, fn) -> PackedBatch:
        return replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )

    def pin_memory(self) -> PackedBatch:
        """Called by ``DataLoader(pin_memory=True)``'s pinning thread."""
        return self._map_tensors(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Move every tensor; integer dtypes are kept (``cu_seqlens`` stays int32). A device
        ``cu_seqlens`` keeps a reference to its host copy (:func:`host_cu_seqlens`)."""
        return self._map_tensors(lambda t: _moved(t, device, non_blocking))
