"""LoRA layers that read one input (q/k/v, gate/up) as one autograd node: x read once for all their
``x A^T`` and ``dA``, ``dx`` accumulated in the products' epilogues, and — where the group is large —
the ``B`` products folded into the base products (:class:`_SharedInputLora`).

The checkpointed layer node switches a decoder layer's groups on for one pass
(:func:`grouped_projections`); the patched forwards then take their outputs from the group
(:func:`group_output`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn

from lightning_sloth.kernels.tracing import tensor_version
from lightning_sloth.ops import lora_layers
from lightning_sloth.ops.fp8_lora import shared_input_fp8
from lightning_sloth.ops.lora import exact_alpha, scaled_mm

__all__ = ["group_output", "grouped_projections", "shared_input_groups"]

WIDE_ROWS_PER_INPUT = 4
""":class:`_SharedInputLora` folds the adapters' ``B`` products into the base products (one
``[x | x A^T] [W | s B]^T`` per layer instead of ``x W^T`` then ``+= s (x A^T) B^T``) when x has at
least this many rows per input feature: the extended weights cost a copy of ``W`` (``[out, in]``)
per pass, the second product a read and a write of the output (``[rows, out]``)."""


WIDE_OUTPUTS_PER_INPUT = 2
"""... and the group's outputs together have at least this many features per input feature: the
wide rows cost a copy of x (``[rows, in]``), which the saved passes over the outputs must outweigh
(gate/up of a Llama-3.2-1B shape: 8 per input; its q/k/v: 1.5, which stay as they are)."""


def _wide_products(rows: Tensor, weights: Sequence[Tensor], scales: Sequence[float]) -> bool:
    """Whether :class:`_SharedInputLora` computes ``[x | x A^T] [W | s B]^T``: many rows and
    outputs per input feature (:data:`WIDE_ROWS_PER_INPUT`, :data:`WIDE_OUTPUTS_PER_INPUT`), and
    every scale a power of two, so that ``s B`` is exact and the products' values are those of
    ``alpha = s`` in the epilogue."""
    inputs = rows.shape[1]
    return (
        rows.shape[0] >= WIDE_ROWS_PER_INPUT * inputs
        and sum(w.shape[0] for w in weights) >= WIDE_OUTPUTS_PER_INPUT * inputs
        and all(exact_alpha(s) for s in scales)
    )


def _extended_weight(weight: Tensor, lora_b: Tensor, scale: float, start: int, total: int) -> Tensor:
    """``[W | 0 .. s B .. 0]`` (``[out, in + total]``): ``s B`` in columns ``in + start ..`` of the
    adapters' ``total`` columns, the other layers' columns zero."""
    out_features, inputs = weight.shape
    extended = weight.new_empty(out_features, inputs + total)
    extended[:, :inputs].copy_(weight)
    tail = extended[:, inputs:]
    if lora_b.shape[1] < total:
        tail.zero_()
    torch.mul(lora_b, scale, out=tail[:, start : start + lora_b.shape[1]])
    return extended


class _SharedInputLora(torch.autograd.Function):
    """LoRA layers that read one input x (q/k/v, gate/up) as one node:
    ``y_i = x W_i^T + s_i (x A_i^T) B_i^T``.

    The forward reads x once for all ``x A_i^T`` (one product with the stacked A's); the backward
    reads it once for all ``dA_i`` and accumulates ``dx = sum_i dy_i W_i + sum_i s_i (dy_i B_i) A_i``
    in the products' epilogues (``addmm_``) instead of adding separate ``[N, in]`` gradients. The
    per-layer products are those of :func:`lora_linear`; ``dx`` is summed in the products'
    float32 accumulators rather than rounded per layer first.

    Where the group is large (:func:`_wide_products`: gate/up of a 1B shape on a 16k-token row),
    the forward folds each ``B`` product into its base product: ``y_i = [x | x A^T] [W_i | s_i B_i]^T``
    (one product with ``in + sum r`` inputs, ``B_i`` in its own columns, zeros in the others')
    instead of ``x W_i^T`` followed by ``+= s_i (x A^T) B_i^T``, which reads and writes the whole
    ``[N, out]`` output a second time. The sum is rounded once instead of twice. The wide rows
    replace x among the saved tensors (x is a view of them): only ``x A^T``'s few columns are kept
    twice.
    """

    @staticmethod
    def forward(ctx, x, scales, *tensors):
        n = len(scales)
        weights, adapters_a, adapters_b = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        rows = x.reshape(-1, x.shape[-1])
        xa = rows @ torch.cat(adapters_a).t()  # [N, sum r]
        # [x | x A^T] once, then y_i = [x | x A^T] [W_i | s_i B_i]^T: one product per layer.
        wide = torch.cat([rows, xa], dim=1) if _wide_products(rows, weights, scales) else None
        outputs, start = [], 0
        for w, a, b, scale in zip(weights, adapters_a, adapters_b, scales):
            r = a.shape[0]
            if wide is not None:
                y = wide @ _extended_weight(w, b, scale, start, xa.shape[1]).t()
            else:
                y = (rows @ w.t()).addmm_(xa[:, start : start + r], b.t(), alpha=scale)
            start += r
            outputs.append(y.view(*x.shape[:-1], w.shape[0]))
        # Folded, x is kept as a view of the wide rows (not a second copy); x A^T is kept apart,
        # contiguous, for the backward's dB products, which read its narrow columns.
        ctx.save_for_backward(rows if wide is None else wide, xa, *tensors)
        ctx.x_shape = x.shape
        ctx.scales = scales
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        rows, xa, *tensors = ctx.saved_tensors
        rows = rows[:, : ctx.x_shape[-1]]  # folded: x's columns of [x | x A^T], read in place
        scales = ctx.scales
        n = len(scales)
        weights, adapters_a, adapters_b = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        needs = ctx.needs_input_grad
        need_x = needs[0]
        d_a: list[Tensor | None] = [None] * n
        d_b: list[Tensor | None] = [None] * n
        dx = None
        # One power-of-two scale for all (PEFT's usual case): applied as the products' alpha.
        uniform = all(exact_alpha(scale) and scale == scales[0] for scale in scales)
        gs, a_rows, offsets, start = [], [], [], 0
        for i, (w, a, b, scale) in enumerate(zip(weights, adapters_a, adapters_b, scales)):
            r = a.shape[0]
            part = xa[:, start : start + r]
            start += r
            if grads[i] is None:
                continue
            dy = grads[i].reshape(-1, grads[i].shape[-1])
            if needs[2 + 2 * n + i]:
                d_b[i] = scaled_mm(dy.t(), part, scale, b) if exact_alpha(scale) else dy.t() @ (part * scale)
            if need_x or needs[2 + n + i]:
                g = dy @ b
                gs.append(g if uniform else g * scale)
                a_rows.append(a)
                offsets.append(i)
            if need_x:
                dx = dy @ w if dx is None else dx.addmm_(dy, w)
        if gs:
            alpha = scales[0] if uniform else 1.0
            g_all = torch.cat(gs, dim=1) if len(gs) > 1 else gs[0]
            a_all = torch.cat(a_rows) if len(a_rows) > 1 else a_rows[0]
            if any(needs[2 + n + i] for i in offsets):
                d_a_all = scaled_mm(g_all.t(), rows, alpha, a_all)
                for i, part in zip(offsets, d_a_all.split([adapters_a[i].shape[0] for i in offsets])):
                    if needs[2 + n + i]:
                        d_a[i] = part
            if need_x:
                dx.addmm_(g_all, a_all, alpha=alpha)
        return (dx.view(ctx.x_shape) if dx is not None else None, None, *([None] * n), *d_a, *d_b)


_GROUPS = threading.local()  # .members: id(LoRA layer) -> its _Group while a block runs


_OWN = object()
"""A group member's pending entry when it computes on its own (in no node of its group)."""


class _Group:
    """LoRA layers that read one input in a block: the first to run computes all their outputs
    (:class:`_SharedInputLora` for 16-bit bases, :class:`~lightning_sloth.ops.fp8_lora.SharedInputLoraFP8`
    for FP8 ones) and keeps the others' for their own calls with the same x. A group of both
    kinds (FP8 bases with ``k_proj``/``v_proj`` kept in 16 bits) computes each kind's layers as one
    node where there are two or more of them; a layer left alone runs its own op."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.pending: dict[int, object] = {}
        self.source: tuple[Tensor, int] | None = None

    def output(self, module: nn.Module, x: Tensor) -> Tensor | None:
        if self.source is not None and self.source[0] is x and self.source[1] == tensor_version(x):
            out = self.pending.pop(id(module), None)
            if not self.pending:
                self.source = None
            if out is _OWN:
                return None
            if out is not None:
                return out
        self.pending, self.source = {}, None
        if module not in self.modules:
            return None
        plain, other = [], []
        for m in self.modules:
            parts = lora_layers.plain_parts(m)
            found = None if parts is None else lora_layers.compute_parts(m, parts, x)
            if found is None:
                other.append(m)
            else:
                plain.append((m, found))
        outputs: dict[nn.Module, Tensor] = {}
        if len(plain) > 1 and len({found[0] for _, found in plain}) == 1:
            outputs.update(zip([m for m, _ in plain], self._plain_outputs(x, [found for _, found in plain])))
        if len(other) > 1:
            fp8 = shared_input_fp8(other, x)  # None: not every one of them a plain FP8 layer
            if fp8 is not None:
                outputs.update(zip(other, fp8))
        if not outputs:
            return None
        return self._keep(module, x, outputs)

    @staticmethod
    def _plain_outputs(x: Tensor, resolved: list[tuple]) -> tuple[Tensor, ...]:
        dtype = resolved[0][0]
        casts = getattr(lora_layers.ADAPTER_CASTS, "copies", None)
        x_c = x if x.dtype == dtype else x.to(dtype)
        weights = [
            w if w.dtype == dtype else lora_layers.cast_adapter(w, dtype, casts) for _, w, _, _, _ in resolved
        ]
        adapters_a = [
            a if a.dtype == dtype else lora_layers.cast_adapter(a, dtype, casts) for _, _, a, _, _ in resolved
        ]
        adapters_b = [
            b if b.dtype == dtype else lora_layers.cast_adapter(b, dtype, casts) for _, _, _, b, _ in resolved
        ]
        scales = tuple(float(r[4]) for r in resolved)
        return _SharedInputLora.apply(x_c, scales, *weights, *adapters_a, *adapters_b)

    def _keep(self, module: nn.Module, x: Tensor, outputs: dict[nn.Module, Tensor]) -> Tensor | None:
        """Keep the other layers' outputs (or that they run on their own) for their calls with this
        x; return ``module``'s (None: it runs on its own)."""
        self.pending = {id(m): outputs.get(m, _OWN) for m in self.modules if m is not module}
        self.source = (x, tensor_version(x))
        return outputs.get(module)


def shared_input_groups(layer: nn.Module) -> list[list[nn.Module]]:
    """The LoRA layers of a decoder layer that read one input: ``q_proj, k_proj, v_proj`` of each
    attention and ``gate_proj, up_proj`` of each gated MLP, where all are PEFT LoRA layers."""
    groups = []
    for module in layer.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(m, LoraLinear) for m in members):
                groups.append(members)
    return groups


@contextlib.contextmanager
def grouped_projections(groups: Sequence[Sequence[nn.Module]]) -> Iterator[None]:
    """Within the block, the fused LoRA layers of each group (:func:`shared_input_groups`) compute
    as one :class:`_SharedInputLora` node when called with one input (see
    :func:`group_output`)."""
    previous = getattr(_GROUPS, "members", None)
    members = dict(previous or {})
    for group in groups:
        shared = _Group(group)
        members.update({id(m): shared for m in group})
    _GROUPS.members = members
    try:
        yield
    finally:
        _GROUPS.members = previous


def group_output(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module(x)`` through its group (inside :func:`grouped_projections`), or None."""
    members = getattr(_GROUPS, "members", None)
    group = members.get(id(module)) if members else None
    return None if group is None else group.output(module, x)
