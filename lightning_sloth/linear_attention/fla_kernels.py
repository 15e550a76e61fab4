"""The CUDA path: flash-linear-attention's Triton kernels (``fla-core``, the optional extra
``lightning-sloth[linear]``) over the packed row, with the batch's chunk table built once.

Both kernels take the packed row as ``B == 1`` with ``cu_seqlens`` and keep every segment's state to
itself: ``fla.modules.causal_conv1d.causal_conv1d`` (the short convolution, activation fused) and
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (L2 norm of q/k fused). Their grids run over a
table of ``(segment, chunk)`` pairs of 64 positions (``chunk_indices`` ``[NT, 2]``), whose length
depends on the segment lengths. :class:`_ChunkTable` builds it once per batch — keyed, like the
attention masks, by the identity of the batch's ``cu_seqlens`` tensor, which transformers hands to
every layer and to the recompute of a checkpointed layer — and every linear-attention layer, forward
and backward, reuses it. It is built from the batch's host copy of the bounds, which
:meth:`~lightning_sloth.data.PackedBatch.to` keeps beside the device tensor: no device-to-host copy
(a ``cu_seqlens`` that came some other way is read once per batch, at the first linear-attention
layer). Without the table, each call into the library would read the bounds again. For the same reason a CUDA graph cannot capture these layers (refused).

The library is imported on first use only, so the package imports and its CPU path runs without it.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import Tensor

from lightning_sloth.data.batch import host_cu_seqlens
from lightning_sloth.kernels.tracing import tensor_version
from lightning_sloth.linear_attention.fla_hopper import register_hopper_backend
from lightning_sloth.linear_attention.reference import CHUNK_SIZE

__all__ = ["EXTRA", "MISSING", "causal_conv1d_fla", "fla_available", "gated_delta_rule_fla"]

EXTRA = "lightning-sloth[linear]"
MISSING = (
    "packed linear attention on CUDA runs flash-linear-attention's kernels, which are not installed: "
    f"pip install '{EXTRA}' (fla-core). "
    'lightning_sloth.linear_attention.set_linear_attention_backend("reference") runs the slow '
    "plain-torch path instead."
)


def fla_available() -> bool:
    """Whether flash-linear-attention (``fla-core``) is importable."""
    return importlib.util.find_spec("fla") is not None


class _ChunkTable:
    """The ``(segment, chunk)`` table of the current batch, keyed by its ``cu_seqlens`` tensor.

    Holding a reference keeps that tensor, hence its identity, alive until the next batch's arrives;
    in-place edits are caught by its version counter.
    """

    def __init__(self) -> None:
        self._cu_seqlens: Tensor | None = None
        self._version = -1
        self._table: Tensor | None = None

    @torch.compiler.disable
    def get(self, cu_seqlens: Tensor) -> Tensor:
        if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
            # A graph would replay this batch's table (its length is the kernels' grid) for every
            # later batch: refused rather than silently wrong.
            raise NotImplementedError(
                "packed linear attention cannot be captured in a CUDA graph: its chunk table follows "
                "the batch's document lengths; train hybrid linear-attention models with cuda_graphs=False"
            )
        version = tensor_version(cu_seqlens)  # validation's batches are inference tensors
        if cu_seqlens is not self._cu_seqlens or version != self._version:
            self._cu_seqlens, self._version = cu_seqlens, version
            host = host_cu_seqlens(cu_seqlens)  # the batch's host copy: no device read
            bounds = (host if host is not None else cu_seqlens).tolist()
            self._table = chunk_table(bounds, cu_seqlens.device, cu_seqlens.dtype)
        return self._table

    def clear(self) -> None:
        self._cu_seqlens, self._version, self._table = None, -1, None


def chunk_table(bounds: list[int], device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[NT, 2]`` rows ``(segment, chunk)`` for every chunk of ``CHUNK_SIZE`` positions of every segment.

    Args:
        bounds: the segment bounds ``cu_seqlens`` as host ints.
        device: where the table goes.
        dtype: its integer dtype (that of ``cu_seqlens``).
    """
    rows = [
        (segment, chunk)
        for segment, (start, end) in enumerate(zip(bounds, bounds[1:]))
        for chunk in range(-(-(end - start) // CHUNK_SIZE))
    ]
    table = torch.tensor(rows, dtype=dtype).reshape(-1, 2)
    if device.type == "cuda":
        table = table.pin_memory()  # an asynchronous copy: the host runs on
    return table.to(device, non_blocking=True)


_TABLE = _ChunkTable()


def _fla(module: str):
    if not fla_available():
        raise ImportError(MISSING)
    loaded = importlib.import_module(module)
    register_hopper_backend()  # the gated backward on Hopper with Triton 3.4-3.7.0 (see fla_hopper)
    return loaded


def causal_conv1d_fla(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None
) -> Tensor:
    """``fla``'s short convolution over the packed row (shapes as
    :func:`~lightning_sloth.linear_attention.reference.causal_conv1d_reference`)."""
    conv = _fla("fla.modules.causal_conv1d").causal_conv1d
    table = None if cu_seqlens is None else _TABLE.get(cu_seqlens)
    out, _ = conv(
        x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens, chunk_indices=table
    )
    return out


def gated_delta_rule_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> Tensor:
    """``fla``'s chunked gated delta rule over the packed row (shapes as
    :func:`~lightning_sloth.linear_attention.reference.gated_delta_rule_reference`)."""
    rule = _fla("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    table = None if cu_seqlens is None else _TABLE.get(cu_seqlens)
    out, _ = rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        chunk_indices=table,
    )
    return out
