"""Mixture-of-experts kernels: token gather/combine in expert order and a grouped GEMM.

Rows are "slots": token ``t``'s ``j``-th expert choice is flat slot ``t * k + j``; sorting slots by
expert id gives ``perm`` (sorted position -> slot) and its inverse ``inv`` (slot -> sorted position).
Every kernel reads through these indices, so nothing needs atomics and every sum has a fixed order:

- ``gather_rows``: ``out[s] = src[perm[s] // div] * scale[perm[s]]`` (the tokens in expert order, and
  the routing-weighted gradient of the combine);
- ``gather_sum``: ``out[t] = sum_j w[t, j] * src[inv[t * k + j]]`` in fp32 (the combine, and the
  gradient of the gather with ``w = 1``);
- ``combine_weight_grad``: ``dw[t, j] = <dout[t], y[inv[t * k + j]]>`` in fp32;
- ``grouped_mm``: ``out[rows of e] = x[rows of e] @ W_e`` with ``W_e`` addressed by strides (so
  ``[E, N, K]`` and ``[E, K, N]`` layouts both work), one M tile never spanning two experts;
- ``grouped_mm_weight_grad``: ``dW[e] = a[rows of e]^T @ b[rows of e]``;
- ``add_group_bias``: ``out[s] += bias[expert_of[s]]`` in place;
- ``clamped_swiglu`` (GPT-OSS): interleaved gate/up, ``(clamp(up) + 1) * g * sigmoid(alpha g)``.

Everything accumulates in fp32 and rounds once. Group boundaries are device tensors (int32
cumulative ends); the tile -> expert table of ``grouped_mm`` is built with device ops, so nothing
here reads a count on the host.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable
from lightning_sloth.kernels.tracing import tensor_version, tracing

_ROW_BLOCK = 1024


@triton.jit
def _gather_rows_kernel(
    SRC, IDX, SCALE, OUT, n_cols, div, stride_src, stride_out, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(IDX + row).to(tl.int64)
    src_row = slot // div
    if HAS_SCALE:
        scale = tl.load(SCALE + slot).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        values = tl.load(SRC + src_row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            values = values * scale
        tl.store(OUT + row * stride_out + cols, values.to(OUT.dtype.element_ty), mask=mask)


def gather_rows(
    src: torch.Tensor, idx: torch.Tensor, div: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[s] = src[idx[s] // div] (* scale[idx[s]])``; src ``[T, H]`` unit column stride, idx ``[S]``."""
    out = src.new_empty((idx.shape[0], src.shape[1]))
    if idx.shape[0] == 0 or src.shape[1] == 0:
        return out
    block = min(_ROW_BLOCK, triton.next_power_of_2(src.shape[1]))
    launchable(_gather_rows_kernel)[(idx.shape[0],)](
        src, idx, scale if scale is not None else src, out, src.shape[1], div, src.stride(0), out.stride(0),
        HAS_SCALE=scale is not None, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _gather_sum_kernel(
    SRC, INV, W, OUT, n_cols, top_k, stride_src, stride_out, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(0, top_k):
            pos = tl.load(INV + token * top_k + j).to(tl.int64)
            values = tl.load(SRC + pos * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                values = values * tl.load(W + token * top_k + j).to(tl.float32)
            acc += values
        tl.store(OUT + token * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def gather_sum(
    src: torch.Tensor, inv: torch.Tensor, top_k: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = sum_j (w[t, j] *) src[inv[t * k + j]]`` in fp32, rounded to src's dtype; ``[T, H]``."""
    tokens = inv.shape[0] // top_k
    out = src.new_empty((tokens, src.shape[1]))
    if tokens == 0 or src.shape[1] == 0:
        return out
    block = min(_ROW_BLOCK, triton.next_power_of_2(src.shape[1]))
    launchable(_gather_sum_kernel)[(tokens,)](
        src, inv, weights if weights is not None else src, out, src.shape[1], top_k, src.stride(0),
        out.stride(0), HAS_W=weights is not None, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _combine_weight_grad_kernel(DOUT, Y, INV, DW, n_cols, top_k, stride_dout, stride_y, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    for j in range(0, top_k):
        pos = tl.load(INV + token * top_k + j).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            dout = tl.load(DOUT + token * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + pos * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
            acc += dout * y
        tl.store(DW + token * top_k + j, tl.sum(acc, axis=0))


def combine_weight_grad(dout: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, top_k: int) -> torch.Tensor:
    """``dw[t, j] = <dout[t], y[inv[t * k + j]]>`` as float32 ``[T, k]``."""
    tokens = dout.shape[0]
    dw = torch.zeros((tokens, top_k), dtype=torch.float32, device=dout.device)
    if tokens == 0 or dout.shape[1] == 0:
        return dw
    block = min(_ROW_BLOCK, triton.next_power_of_2(dout.shape[1]))
    launchable(_combine_weight_grad_kernel)[(tokens,)](
        dout, y, inv, dw, dout.shape[1], top_k, dout.stride(0), y.stride(0), BLOCK=block
    )
    return dw


@triton.jit
def _add_group_bias_kernel(OUT, BIAS, EXPERT, n_cols, stride_out, stride_bias, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    expert = tl.load(EXPERT + row).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        out = tl.load(OUT + row * stride_out + cols, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(BIAS + expert * stride_bias + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_out + cols, (out + bias).to(OUT.dtype.element_ty), mask=mask)


def add_group_bias(out: torch.Tensor, bias: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """In place: ``out[s] += bias[expert_of_row[s]]`` (fp32 sum, one rounding); returns out."""
    if out.shape[0] == 0 or out.shape[1] == 0:
        return out
    block = min(_ROW_BLOCK, triton.next_power_of_2(out.shape[1]))
    launchable(_add_group_bias_kernel)[(out.shape[0],)](
        out, bias, expert_of_row, out.shape[1], out.stride(0), bias.stride(0), BLOCK=block
    )
    return out


@triton.jit
def _gate_up_pairs(H, row, stride_h, start, n_cols, BLOCK: tl.constexpr):
    """Columns ``start .. start + BLOCK`` of an interleaved gate/up row as fp32 ``(gate, up)``: one
    contiguous load of the ``2 BLOCK`` values, split in registers (two stride-2 loads would each
    touch every line of the row, one element in two)."""
    pairs = 2 * start + tl.arange(0, 2 * BLOCK)
    both = tl.load(H + row * stride_h + pairs, mask=pairs < 2 * n_cols, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(both, (BLOCK, 2)))


@triton.jit
def _clamped_swiglu_forward_kernel(H, OUT, n_cols, stride_h, stride_out, alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate, up = _gate_up_pairs(H, row, stride_h, start, n_cols, BLOCK)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_backward_kernel(
    DOUT, H, DH, n_cols, stride_dout, stride_h, stride_dh, alpha, limit, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dout = tl.load(DOUT + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
        gate_in, up_in = _gate_up_pairs(H, row, stride_h, start, n_cols, BLOCK)
        gate = tl.minimum(gate_in, limit)
        up = tl.minimum(tl.maximum(up_in, -limit), limit)
        s = tl.sigmoid(gate * alpha)
        glu = gate * s
        d_gate = dout * (up + 1.0) * (s + glu * alpha * (1.0 - s))
        d_up = dout * glu
        # clamp passes the gradient where the input lies inside its bounds (bounds included)
        d_gate = tl.where(gate_in <= limit, d_gate, 0.0)
        d_up = tl.where((up_in >= -limit) & (up_in <= limit), d_up, 0.0)
        pairs = 2 * start + tl.arange(0, 2 * BLOCK)  # interleaved again: one contiguous store
        both = tl.reshape(tl.join(d_gate, d_up), (2 * BLOCK,))
        tl.store(DH + row * stride_dh + pairs, both.to(DH.dtype.element_ty), mask=pairs < 2 * n_cols)


def clamped_swiglu_forward(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS activation of an interleaved ``[S, 2I]`` gate/up tensor -> ``[S, I]``."""
    out = h.new_empty((h.shape[0], h.shape[1] // 2))
    if out.numel() == 0:
        return out
    block = min(_ROW_BLOCK, triton.next_power_of_2(out.shape[1]))
    launchable(_clamped_swiglu_forward_kernel)[(h.shape[0],)](
        h, out, out.shape[1], h.stride(0), out.stride(0), float(alpha), float(limit), BLOCK=block
    )
    return out


def clamped_swiglu_backward(dout: torch.Tensor, h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Gradient of :func:`clamped_swiglu_forward` with respect to h, ``[S, 2I]`` interleaved."""
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    if dh.numel() == 0:
        return dh
    block = min(_ROW_BLOCK, triton.next_power_of_2(dout.shape[1]))
    launchable(_clamped_swiglu_backward_kernel)[(h.shape[0],)](
        dout, h, dh, dout.shape[1], dout.stride(0), h.stride(0), dh.stride(0), float(alpha), float(limit),
        BLOCK=block,
    )  # fmt: skip
    return dh


@triton.jit
def _weighted_swiglu_forward_kernel(H, W, PERM, OUT, n_cols, stride_h, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(W + tl.load(PERM + row)).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(H + row * stride_h + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up * scale
        tl.store(OUT + row * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_swiglu_backward_kernel(
    DOUT, H, W, PERM, DH, DW, n_cols, stride_dout, stride_h, stride_dh, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(PERM + row)
    scale = tl.load(W + slot).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dout = tl.load(DOUT + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(H + row * stride_h + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        act = gate * s
        dot += dout * act * up
        d_gate = dout * scale * up * (s + act * (1.0 - s))
        d_up = dout * scale * act
        tl.store(DH + row * stride_dh + cols, d_gate.to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + row * stride_dh + n_cols + cols, d_up.to(DH.dtype.element_ty), mask=mask)
    tl.store(DW + slot, tl.sum(dot, axis=0))


def weighted_swiglu_forward(h: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * w[perm[s]]`` of a concatenated ``[S, 2I]`` gate|up tensor -> ``[S, I]``."""
    n_cols = h.shape[1] // 2
    out = h.new_empty((h.shape[0], n_cols))
    if out.numel() == 0:
        return out
    block = min(_ROW_BLOCK, triton.next_power_of_2(n_cols))
    launchable(_weighted_swiglu_forward_kernel)[(h.shape[0],)](
        h, weights, perm, out, n_cols, h.stride(0), out.stride(0), BLOCK=block
    )
    return out


def weighted_swiglu_backward(
    dout: torch.Tensor, h: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh [S, 2I], dw)``: dw float32 shaped like the flat weights, ``dw[perm[s]] = <dout_s, act_s>``."""
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    dw = torch.zeros(weights.shape, dtype=torch.float32, device=h.device)
    if dh.numel() == 0:
        return dh, dw
    n_cols = h.shape[1] // 2
    block = min(_ROW_BLOCK, triton.next_power_of_2(n_cols))
    launchable(_weighted_swiglu_backward_kernel)[(h.shape[0],)](
        dout, h, weights, perm, dh, dw, n_cols, dout.stride(0), h.stride(0), dh.stride(0), BLOCK=block
    )
    return dh, dw


@triton.jit
def _dot(a, b, acc):
    """``acc + a @ b``: float32 operands in IEEE precision (no TF32), 16-bit ones in a's dtype."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b.to(a.dtype), acc)
    return acc


@triton.jit
def _grouped_mm_kernel(
    X, W, OUT, BIAS, TILE_EXPERT, TILE_ROW, ENDS, n_out, n_in,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile).to(tl.int64)
    if expert >= 0:
        row0 = tl.load(TILE_ROW + tile).to(tl.int64)
        end = tl.load(ENDS + expert).to(tl.int64)
        rows = row0 + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        row_mask = rows < end
        col_mask = cols < n_out
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, n_in, BK):
            ks = k0 + tl.arange(0, BK)
            k_mask = ks < n_in
            x = tl.load(
                X + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                W + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc = _dot(x, w, acc)
        out_ptrs = OUT + rows[:, None] * stride_om + cols[None, :] * stride_on
        out_mask = row_mask[:, None] & col_mask[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + expert * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=out_mask)


def _tile_table_reference(
    ends: torch.Tensor, block_m: int, max_tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tile_table` in torch ops (a dozen launches; the oracle of the kernel)."""
    ends64 = ends.to(torch.int64)
    starts = torch.cat((ends64.new_zeros(1), ends64[:-1]))
    tiles = (ends64 - starts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    ids = torch.arange(max_tiles, device=ends.device)
    expert = torch.searchsorted(tile_ends, ids, right=True)
    valid = expert < ends.shape[0]
    expert = expert.clamp(max=ends.shape[0] - 1)
    first_tile = tile_ends[expert] - tiles[expert]
    rows = starts[expert] + (ids - first_tile) * block_m
    return torch.where(valid, expert, -1).to(torch.int32), rows.to(torch.int32)


@triton.jit
def _tile_table_kernel(
    ENDS, EXPERT, ROW, n_experts, max_tiles, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr
):
    e = tl.arange(0, BLOCK_E)
    e_mask = e < n_experts
    ends = tl.load(ENDS + e, mask=e_mask, other=0)
    starts = tl.load(ENDS + e - 1, mask=e_mask & (e > 0), other=0)
    tiles = tl.where(e_mask, (ends - starts + BM - 1) // BM, 0)
    tile_ends = tl.cumsum(tiles, 0)
    first_tiles = tile_ends - tiles
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # this program's tiles
    passed = (tile_ends[None, :] <= t[:, None]) & e_mask[None, :]
    expert = tl.sum(passed.to(tl.int32), 1)  # searchsorted(tile_ends, t, right=True)
    clamped = tl.minimum(expert, n_experts - 1)
    pick = e[None, :] == clamped[:, None]
    first = tl.sum(tl.where(pick, first_tiles[None, :], 0), 1)
    start = tl.sum(tl.where(pick, starts[None, :], 0), 1)
    t_mask = t < max_tiles
    tl.store(EXPERT + t, tl.where(expert < n_experts, expert, -1), mask=t_mask)
    tl.store(ROW + t, start + (t - first) * BM, mask=t_mask)


_TILE_TABLE_CELLS = 8192
"""Most comparisons in one program of the tile table kernel (``BLOCK_T`` tiles against ``BLOCK_E``
experts); each program recomputes the per-expert tile counts and takes ``BLOCK_T`` tiles."""


_TILE_TABLES: dict[tuple[int, int, int], tuple] = {}
"""``(id(ends), block_m, max_tiles) -> (weakref to ends, its version, expert, row)`` for every live
grouping: the four expert GEMMs of a layer call (two forward, two backward, however many layers run
in between) build their table once, and an entry goes when its ``ends`` tensor is freed."""


def _tile_table(ends: torch.Tensor, block_m: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per M tile: its expert (-1 past the last tile) and first row (int32), from the int32
    cumulative row ends on the device: one kernel launch (the same table as
    :func:`_tile_table_reference`'s dozen torch ops, which serve int64 ends and very many experts).

    The table of the same ``ends`` tensor (same object, unmodified) and tiling is reused: a layer's
    grouping feeds its forward and backward GEMMs. Nothing is cached while tracing."""
    if tracing():
        return _build_tile_table(ends, block_m, max_tiles)
    key = (id(ends), block_m, max_tiles)
    entry = _TILE_TABLES.get(key)
    if entry is not None and entry[0]() is ends and entry[1] == tensor_version(ends):
        return entry[2], entry[3]
    expert, row = _build_tile_table(ends, block_m, max_tiles)
    _TILE_TABLES[key] = (
        weakref.ref(ends, lambda _ref: _TILE_TABLES.pop(key, None)),
        tensor_version(ends),
        expert,
        row,
    )
    return expert, row


def _build_tile_table(ends: torch.Tensor, block_m: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    experts = ends.shape[0]
    block_e = max(16, triton.next_power_of_2(experts))
    if ends.dtype != torch.int32 or block_e > _TILE_TABLE_CELLS // 16 or not ends.is_contiguous():
        return _tile_table_reference(ends, block_m, max_tiles)
    expert = torch.empty(max_tiles, dtype=torch.int32, device=ends.device)
    row = torch.empty(max_tiles, dtype=torch.int32, device=ends.device)
    block_t = min(128, _TILE_TABLE_CELLS // block_e)
    launchable(_tile_table_kernel)[(triton.cdiv(max_tiles, block_t),)](
        ends, expert, row, experts, max_tiles, BM=block_m, BLOCK_E=block_e, BLOCK_T=block_t
    )
    return expert, row


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    ends: torch.Tensor,
    w_is_kn: bool,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ W_e (+ b_e)``; ``W_e = w[e]`` if ``w_is_kn`` (``[E, K, N]``) else
    ``w[e].T`` (``[E, N, K]``). x ``[S, K]``, ends int32 ``[E]`` cumulative row ends; rows past the
    last end are zero. With ``out`` given, the product (and the ``[E, N]`` bias) is added to it in place
    (fp32 sum, one rounding) and out is returned."""
    n_rows, n_in = x.shape
    experts = w.shape[0]
    n_out = w.shape[2] if w_is_kn else w.shape[1]
    accumulate = out is not None
    if out is None:
        out = x.new_zeros((n_rows, n_out))
    if n_rows == 0 or n_out == 0:
        return out
    block_m, block_n, block_k = 64, 64, (16 if n_in <= 16 else 32)
    max_tiles = triton.cdiv(n_rows, block_m) + experts
    tile_expert, tile_row = _tile_table(ends, block_m, max_tiles)
    # (stride over K, stride over N) of W_e
    stride_wk, stride_wn = (w.stride(1), w.stride(2)) if w_is_kn else (w.stride(2), w.stride(1))
    grid = (max_tiles, triton.cdiv(n_out, block_n))
    launchable(_grouped_mm_kernel)[grid](
        x, w, out, bias if bias is not None else out, tile_expert, tile_row, ends, n_out, n_in,
        x.stride(0), x.stride(1), w.stride(0), stride_wk, stride_wn, out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0,
        BM=block_m, BN=block_n, BK=block_k, ACCUMULATE=accumulate, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return out


@triton.jit
def _grouped_mm_weight_grad_kernel(
    A, B, OUT, ENDS, n_a, n_b,
    stride_am, stride_an, stride_bm, stride_bn, stride_oe, stride_oa, stride_ob,
    BA: tl.constexpr, BB: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0).to(tl.int64)
    tiles_b = tl.cdiv(n_b, BB)
    ia = tl.program_id(1) // tiles_b
    ib = tl.program_id(1) % tiles_b
    start = tl.load(ENDS + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(ENDS + expert).to(tl.int64)
    cols_a = ia * BA + tl.arange(0, BA)
    cols_b = ib * BB + tl.arange(0, BB)
    mask_a = cols_a < n_a
    mask_b = cols_b < n_b
    acc = tl.zeros((BA, BB), dtype=tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        row_mask = rows < end
        a = tl.load(
            A + rows[None, :] * stride_am + cols_a[:, None] * stride_an,
            mask=mask_a[:, None] & row_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            B + rows[:, None] * stride_bm + cols_b[None, :] * stride_bn,
            mask=row_mask[:, None] & mask_b[None, :],
            other=0.0,
        )
        acc = _dot(a, b, acc)
    tl.store(
        OUT + expert * stride_oe + cols_a[:, None] * stride_oa + cols_b[None, :] * stride_ob,
        acc.to(OUT.dtype.element_ty),
        mask=mask_a[:, None] & mask_b[None, :],
    )


def grouped_mm_weight_grad(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out[e] = a[rows of e]^T @ b[rows of e]``: a ``[S, A]``, b ``[S, B]`` -> ``[E, A, B]`` (zero
    for an expert without rows)."""
    experts = ends.shape[0]
    n_a, n_b = a.shape[1], b.shape[1]
    out = a.new_empty((experts, n_a, n_b))
    if out.numel() == 0:
        return out
    block_a, block_b, block_r = 64, 64, 32
    grid = (experts, triton.cdiv(n_a, block_a) * triton.cdiv(n_b, block_b))
    launchable(_grouped_mm_weight_grad_kernel)[grid](
        a, b, out, ends, n_a, n_b,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BA=block_a, BB=block_b, BR=block_r,
    )  # fmt: skip
    return out
