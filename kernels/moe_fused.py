"""Grouped GEMMs that read and write their rows through the routing permutation.

Rows are in expert order (sorted position ``s``, see :mod:`lightning_sloth.kernels.moe`); ``perm[s]`` is
the slot ``t * k + j`` of that row. These kernels take the permutation as an operand instead of a
gathered copy:

- ``grouped_mm``: ``out[oidx(s)] (+)= scale(s) * (x[aidx(s)] @ W_e) (+ b_e)`` where ``aidx(s)`` is
  ``s`` or ``idx[s] // div`` (the token of row s: the first MoE GEMM reads the token rows in place,
  the backward of the second reads the combine's gradient in place), ``scale(s)`` is 1 or
  ``scale[idx[s]]`` (the routing weight, applied to the fp32 accumulator), and ``oidx(s)`` is ``s`` or
  ``out_idx[s]`` (the second GEMM writes slot order, so the combine is a contiguous sum of k rows,
  and the first GEMM's input gradient lands in slot order the same way);
- ``grouped_mm_weight_grad``: ``dW[e] = A_e^T B_e`` where either operand's rows may be read
  through an index (``// div``) and scaled per row;
- ``slot_sum``: ``out[t] = sum_j (w[t, j] *) src[t * k + j]`` in fp32, j in order (the combine over
  rows already in slot order, and the first GEMM's input gradient);
- ``slot_dot``: ``dw[t, j] = <dout[t], src[t * k + j]>`` in fp32 (the routing weights' gradient).

Each output element is written by exactly one program and every sum has a fixed order: no atomics,
the same bits on every run. The tile table is built from the int32 ``ends`` by device ops
(``_tile_table`` of :mod:`.moe`); the grid is sized from static bounds (rows / BM + experts tiles),
so nothing reads a count on the host.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable
from lightning_sloth.kernels.moe import _ROW_BLOCK, _dot, _tile_table
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "TILES",
    "TILES_BY_DEPTH",
    "WEIGHT_LOADS",
    "WEIGHT_LOAD_CHOICES",
    "WGRAD_TILES",
    "OutOfResources",
    "grouped_mm",
    "grouped_mm_weight_grad",
    "slot_dot",
    "slot_sum",
]

TILES: tuple[int, int, int, int, int] | None = None
"""``(BM, BN, BK, num_warps, num_stages)`` for 16-bit CUDA operands instead of the built-in choice
(a benchmark's sweep sets it; None keeps the default)."""

TILES_BY_DEPTH: tuple[tuple[int, tuple[int, int, int, int, int]], ...] = ()
"""``(max_in, (BM, BN, BK, num_warps, num_stages))`` pairs: a GEMM with at most ``max_in`` inputs takes
the first pair's tiles that fits it instead of the built-in choice (a benchmark's sweep sets it, to
try tiles on one GEMM of a block, such as the Qwen3-30B-A3B second GEMM's 768; :data:`TILES` wins)."""

GROUP_M = 8
"""M tiles per group of the program order (1: N tiles fastest, one M tile at a time)."""

SHALLOW_K_MAX_IN = 2048
"""Up to this many inputs the built-in tiles are 32 deep in K with 5 stages (64 x 4 above it)."""

WEIGHT_LOAD_CHOICES = ("auto", "pointer", "tma", "tma_ws", "tma_rows")
WEIGHT_LOADS = "auto"
"""How ``grouped_mm`` loads its weight tiles: ``pointer`` (masked loads), ``tma`` (a TMA tensor
descriptor over the weight, zero-filled past its edges), ``tma_ws`` (that, in a warp-specialised K
loop, the producer warps loading while the consumers multiply; not with the one-pass rank-r side),
``tma_rows`` (the weight tiles as ``tma``, and where the rows are already in expert order, not read
through the permutation, their tiles through a second descriptor too), ``auto`` (the default:
``tma_rows`` on a CUDA device with TMA, compute capability 9.0 and above, ``pointer`` elsewhere).
The GEMM alone gained up to 19-27% with descriptors on the H200 on ``[E, N, K]`` weights and lost on
others (``benchmarks/results/moe_gemm_variants_ws_h200.json``); on the whole block, each step also
replayed as one CUDA graph (``moe_bench.py --graphs --weight-loads``), ``tma`` ran faster than the
pointer loads on both shapes (``moe_fused_graphs_weight_loads_h200.json``) and ``tma_rows`` faster
than ``tma`` in each of five interleaved rounds, as graphs and back to back, on both shapes
(``moe_fused_graphs_tma_rows_h200.json``). Rows or a weight a descriptor cannot address (no
unit-stride dimension, strides or base not 16-byte aligned) keep the pointer loads."""


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _weight_loads(device: torch.device) -> str:
    """The weight loads :data:`WEIGHT_LOADS` gives on ``device`` (``auto`` resolved)."""
    if WEIGHT_LOADS not in WEIGHT_LOAD_CHOICES:
        raise ValueError(f"moe_fused.WEIGHT_LOADS must be one of {WEIGHT_LOAD_CHOICES}, got {WEIGHT_LOADS!r}")
    if WEIGHT_LOADS == "auto":
        return "tma_rows" if _has_tma(device) else "pointer"
    return WEIGHT_LOADS


WGRAD_TILES: tuple[int, int, int, int, int] | None = None
"""``(BA, BB, BR, num_warps, num_stages)`` of the weight-gradient kernel for 16-bit CUDA operands
(a benchmark's sweep sets it; None keeps the default). BA and BB shrink to a rank-r side."""


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may opt into (Hopper's 227 KiB, Ampere's 163)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _tiles(
    device: torch.device, dtype: torch.dtype, n_out: int, n_in: int, side: int = 0
) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, num_warps, num_stages)``: Hopper-sized tiles for 16-bit CUDA operands, small ones
    elsewhere (float32, the interpreter); N and K tiles shrink to the (power-of-two) size of a rank-r side.
    Traced sizes (``SymInt`` under dynamic shapes) give plain ints, specialised: a TMA descriptor's
    block shape, like the kernel's constexprs, must be a number.

    The built-in choice is the H100 sweep's best (``benchmarks/results/moe_fused_sweep2_h100.json``),
    64-deep K tiles in 4 stages; up to 2,048 inputs 32-deep ones in 5 stages, which won every
    interleaved round on the Qwen3-30B-A3B block (K 2,048 and 768) and lost on GPT-OSS-20B's 2,880
    (``moe_fused_grouped_mm_rounds_h200.json``). As many of the stages as the device's shared memory
    holds: a stage is an X and a W tile, plus a ``[BK, side]`` tile of the LoRA down factor when the
    kernel makes the rank-r side (all of them on Hopper, 3 of 4 on Ampere)."""
    big = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    shallow = n_in <= SHALLOW_K_MAX_IN
    built_in = (128, 256, 32, 8, 5) if shallow else (128, 256, 64, 8, 4)
    if big and TILES is None and TILES_BY_DEPTH:  # a sweep's knob: nothing to search per call otherwise
        built_in = next((tiles for max_in, tiles in TILES_BY_DEPTH if n_in <= max_in), built_in)
    bm, bn, bk, warps, stages = (TILES or built_in) if big else (64, 64, 32, 4, 2)
    bn = max(16, min(bn, triton.next_power_of_2(max(n_out, 1))))
    bk = max(16, min(bk, triton.next_power_of_2(max(n_in, 1))))
    if big and TILES is None:
        per_stage = (bm * bk + bk * bn + bk * side) * dtype.itemsize
        while stages > 2 and stages * per_stage > _shared_memory(device) - 8192:
            stages -= 1
    return int(bm), int(bn), int(bk), warps, stages  # plain ints where the sizes are traced (SymInt)


@triton.jit
def _indexed_grouped_mm_kernel(
    X, W, OUT, BIAS, TILE_EXPERT, TILE_ROW, ENDS, A_IDX, SCALE, OUT_IDX, X2, W2, DOWN, R_OUT, WD, XD,
    n_out, n_in, n_in2, div, lora_scale, max_tiles,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
    stride_x2m, stride_x2k, stride_w2e, stride_w2k, stride_w2n, stride_de, stride_dk, stride_dr,
    stride_rm, stride_rr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LOAD_SLOTS: tl.constexpr, A_INDEXED: tl.constexpr,
    SCALED: tl.constexpr, OUT_INDEXED: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    HAS_X2: tl.constexpr, BK2: tl.constexpr, DOWN_IN_KERNEL: tl.constexpr, KEEP_SCALED: tl.constexpr,
    EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, W_DESC: tl.constexpr, W_DESC_KN: tl.constexpr,
    WS: tl.constexpr, X_DESC: tl.constexpr,
):  # fmt: skip
    # Programs walk groups of GROUP_M M tiles, M fastest inside a group: the CTAs running together share
    # a few M tiles' (gathered) rows and a band of one expert's weight columns in L2.
    tiles_n = tl.cdiv(n_out, BN)
    in_group = GROUP_M * tiles_n
    first = (tl.program_id(0) // in_group) * GROUP_M
    size = min(max_tiles - first, GROUP_M)
    tile = first + (tl.program_id(0) % in_group) % size
    pid_n = (tl.program_id(0) % in_group) // size
    expert = tl.load(TILE_EXPERT + tile).to(tl.int64)
    if expert >= 0:
        row0 = tl.load(TILE_ROW + tile).to(tl.int64)
        end = tl.load(ENDS + expert).to(tl.int64)
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_mask = rows < end
        col_mask = cols < n_out
        if LOAD_SLOTS:
            slots = tl.load(A_IDX + rows, mask=row_mask, other=0).to(tl.int64)
        if A_INDEXED:
            a_rows = slots // div
        else:
            a_rows = rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if DOWN_IN_KERNEL:  # the rank-r side x @ D_e from the same row tiles (BK2: the rank's block)
            rs = tl.arange(0, BK2)
            r_mask = rs < n_in2
            acc_r = tl.zeros((BM, BK2), dtype=tl.float32)
        for k0 in tl.range(0, n_in, BK, warp_specialize=WS):
            ks = k0 + tl.arange(0, BK)
            if EVEN_K:  # K a multiple of BK: no mask over K (the H200's loads run ~10% faster)
                x_mask = row_mask[:, None]
                w_mask = col_mask[None, :]
            else:
                k_mask = ks < n_in
                x_mask = row_mask[:, None] & k_mask[None, :]
                w_mask = k_mask[:, None] & col_mask[None, :]
            if X_DESC:  # rows in expert order through a descriptor: the rows past the expert's end
                # (the next expert's, or zeros past the last row) give output rows never stored
                x = XD.load([row0.to(tl.int32), k0])
            else:
                x = tl.load(X + a_rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
            if W_DESC:  # the tile through the descriptor: zeros past K and N, no mask
                if W_DESC_KN:
                    w = WD.load([expert.to(tl.int32), k0, pid_n * BN]).reshape(BK, BN)
                else:
                    w = tl.trans(WD.load([expert.to(tl.int32), pid_n * BN, k0]).reshape(BN, BK))
            else:
                w = tl.load(
                    W + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=w_mask,
                    other=0.0,
                )
            acc = _dot(x, w, acc)
            if DOWN_IN_KERNEL:
                d = tl.load(
                    DOWN + expert * stride_de + ks[:, None] * stride_dk + rs[None, :] * stride_dr,
                    mask=r_mask[None, :] if EVEN_K else k_mask[:, None] & r_mask[None, :],
                    other=0.0,
                )
                acc_r = _dot(x, d, acc_r)
        if SCALED:
            row_scale = tl.load(SCALE + slots, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            acc = acc * row_scale
            if DOWN_IN_KERNEL:
                acc_r = acc_r * row_scale
        if DOWN_IN_KERNEL:
            # The roundings of the separate passes: x @ D_e to x's dtype, then times the LoRA scale.
            side = acc_r.to(X.dtype.element_ty)
            x2 = (side.to(tl.float32) * lora_scale).to(X.dtype.element_ty)
            if pid_n == 0:  # one column tile writes the rank-r rows the backward reads
                kept = x2 if KEEP_SCALED else side
                tl.store(
                    R_OUT + rows[:, None] * stride_rm + rs[None, :] * stride_rr,
                    kept,
                    mask=row_mask[:, None] & r_mask[None, :],
                )
            w2 = tl.load(
                W2 + expert * stride_w2e + rs[:, None] * stride_w2k + cols[None, :] * stride_w2n,
                mask=r_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc = _dot(x2, w2, acc)
        if HAS_X2:  # the rank-r LoRA term into the same accumulator: no second pass over the output
            for k0 in range(0, n_in2, BK2):
                ks = k0 + tl.arange(0, BK2)
                k_mask = ks < n_in2
                x2 = tl.load(
                    X2 + rows[:, None] * stride_x2m + ks[None, :] * stride_x2k,
                    mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                w2 = tl.load(
                    W2 + expert * stride_w2e + ks[:, None] * stride_w2k + cols[None, :] * stride_w2n,
                    mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )
                acc = _dot(x2, w2, acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + expert * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if OUT_INDEXED:
            o_rows = tl.load(OUT_IDX + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            o_rows = rows
        out_ptrs = OUT + o_rows[:, None] * stride_om + cols[None, :] * stride_on
        out_mask = row_mask[:, None] & col_mask[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=out_mask)


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    ends: torch.Tensor,
    w_is_kn: bool,
    *,
    rows: int | None = None,
    a_idx: torch.Tensor | None = None,
    div: int = 1,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_idx: torch.Tensor | None = None,
    x2: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    w2_is_kn: bool = False,
    covered: bool = False,
    down: torch.Tensor | None = None,
    down_is_kn: bool = False,
    lora_scale: float = 1.0,
    r_out: torch.Tensor | None = None,
    keep_scaled: bool = False,
) -> torch.Tensor:
    """Grouped GEMM over ``S`` rows in expert order, operand rows and output rows through indices.

    ``out[oidx(s)] (+)= scale(s) * x[aidx(s)] @ W_e + x2[s] @ W2_e + b_e``, one fp32 accumulator and
    one rounding.

    Args:
        x: ``[S, K]`` (``a_idx`` None) or ``[T, K]`` rows read as ``x[a_idx[s] // div]``.
        w: ``[E, K, N]`` (``w_is_kn``) or ``[E, N, K]``; any strides.
        ends: int32 ``[E]`` cumulative row ends (``ends[-1] <= S``).
        rows: S (default ``x.shape[0]``, or ``a_idx.shape[0]`` when indexed).
        a_idx: int64 ``[S]``; with ``scale``, also the index of the scale.
        div: the divisor of ``a_idx`` (top_k to go from a slot to its token).
        scale: optional float ``[S]`` in slot order: row s's product is multiplied by ``scale[a_idx[s]]``.
        bias: optional ``[E, N]`` added per row's expert (fp32, one rounding).
        out: optional ``[S, N]`` to add into (fp32 sum, one rounding); else a zeroed one is made.
        out_idx: optional int64 ``[S]``: row s is written to ``out[out_idx[s]]`` (a permutation).
        x2: optional ``[S, r]`` rows in expert order (the LoRA side: ``s * x A^T`` or its gradient).
        w2: ``[E, r, N]`` (``w2_is_kn``) or ``[E, N, r]``, with x2.
        covered: ``ends[-1] == S``, so every output row is written and a new output needs no zeroing
            (without it, rows past the last end are zero).
        down: instead of x2, the LoRA side is computed in the same pass from the rows it reads:
            ``side = scale(s) * x[aidx(s)] @ D_e`` rounded to x's dtype, ``x2 = side * lora_scale``
            rounded again (the separate passes' roundings), for ``down`` ``[E, K, r]``
            (``down_is_kn``) or ``[E, r, K]``, r <= 64; w2 is the up factor. No second pass over the
            ``[S, K]`` rows.
        r_out: ``[S, r]`` that receives ``x2`` (``keep_scaled``) or ``side``, with ``down``.

    Returns:
        out, ``[S, N]`` in x's dtype.
    """
    n_rows = rows if rows is not None else (a_idx.shape[0] if a_idx is not None else x.shape[0])
    experts, n_in = w.shape[0], x.shape[1]
    n_out = w.shape[2] if w_is_kn else w.shape[1]
    accumulate = out is not None
    if out is None:
        out = x.new_empty((n_rows, n_out)) if covered else x.new_zeros((n_rows, n_out))
    if n_rows == 0 or n_out == 0:
        return out
    if scale is not None and a_idx is None:
        raise ValueError("grouped_mm: a per-row scale is read through a_idx")
    if down is not None:
        if x2 is not None or w2 is None or r_out is None:
            raise ValueError("grouped_mm: down goes with w2 and r_out, not x2")
        n_in2 = down.shape[2] if down_is_kn else down.shape[1]
        if not 0 < n_in2 <= 64 or r_out.shape != (n_rows, n_in2):
            raise ValueError(f"grouped_mm: down's rank {n_in2} must be 1..64, r_out [S, r]")
        stride_dk, stride_dr = (
            (down.stride(1), down.stride(2)) if down_is_kn else (down.stride(2), down.stride(1))
        )
        down_strides = (down.stride(0), stride_dk, stride_dr, r_out.stride(0), r_out.stride(1))
    else:
        n_in2 = x2.shape[1] if x2 is not None else 0
        down_strides = (0, 0, 0, 0, 0)
    bk2 = max(16, triton.next_power_of_2(max(n_in2, 1))) if n_in2 <= 64 else 64
    bm, bn, bk, warps, stages = _tiles(x.device, x.dtype, n_out, n_in, bk2 if down is not None else 0)
    if w2 is not None:
        stride_w2k, stride_w2n = (w2.stride(1), w2.stride(2)) if w2_is_kn else (w2.stride(2), w2.stride(1))
        x2_strides = (
            x2.stride(0) if x2 is not None else 0, x2.stride(1) if x2 is not None else 0,
            w2.stride(0), stride_w2k, stride_w2n,
        )  # fmt: skip
    else:
        x2_strides = (0, 0, 0, 0, 0)
    max_tiles = triton.cdiv(n_rows, bm) + experts
    tile_expert, tile_row = _tile_table(ends, bm, max_tiles)
    stride_wk, stride_wn = (w.stride(1), w.stride(2)) if w_is_kn else (w.stride(2), w.stride(1))
    loads = _weight_loads(x.device)
    descriptor = _weight_descriptor(w, w_is_kn, bk, bn) if loads != "pointer" else None
    rows_descriptor = _rows_descriptor(x, bm, bk) if loads == "tma_rows" and a_idx is None else None
    grid = (max_tiles * triton.cdiv(n_out, bn),)
    launchable(_indexed_grouped_mm_kernel)[grid](
        x, w, out, bias if bias is not None else out, tile_expert, tile_row, ends,
        a_idx if a_idx is not None else ends, scale if scale is not None else out,
        out_idx if out_idx is not None else ends, x2 if x2 is not None else x, w2 if w2 is not None else w,
        down if down is not None else w, r_out if r_out is not None else out,
        descriptor[0] if descriptor is not None else w, rows_descriptor if rows_descriptor is not None else x,
        n_out, n_in, n_in2, div, float(lora_scale), max_tiles,
        x.stride(0), x.stride(1), w.stride(0), stride_wk, stride_wn, out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0, *x2_strides, *down_strides,
        BM=bm, BN=bn, BK=bk, LOAD_SLOTS=a_idx is not None or scale is not None, A_INDEXED=a_idx is not None, SCALED=scale is not None,
        OUT_INDEXED=out_idx is not None, HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
        HAS_X2=x2 is not None and n_in2 > 0, BK2=bk2, DOWN_IN_KERNEL=down is not None, KEEP_SCALED=keep_scaled,
        EVEN_K=n_in % bk == 0, GROUP_M=GROUP_M, W_DESC=descriptor is not None,
        W_DESC_KN=descriptor is not None and descriptor[1],
        WS=descriptor is not None and loads == "tma_ws" and down is None, X_DESC=rows_descriptor is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _weight_descriptor(
    w: torch.Tensor, w_is_kn: bool, bk: int, bn: int
) -> tuple[TensorDescriptor, bool] | None:
    """A TMA descriptor over ``w`` in its memory order (the dimension of unit stride last) with
    ``[1, BK, BN]`` or ``[1, BN, BK]`` blocks, and whether that order is ``[E, K, N]``; None where a
    descriptor cannot address ``w`` or ``w`` is traced (:func:`_traced`): the kernel then loads
    through pointers."""
    _weight_loads(w.device)  # an unknown choice is an error here too
    if _traced(w):
        return None
    kn = w if w_is_kn else w.transpose(1, 2)  # [E, K, N] whatever the layout
    if kn.stride(2) == 1:
        storage, in_kn, block = kn, True, [1, bk, bn]
    elif kn.stride(1) == 1:
        storage, in_kn, block = kn.transpose(1, 2), False, [1, bn, bk]
    else:
        return None
    size = storage.element_size()
    if storage.data_ptr() % 16 or any(stride * size % 16 for stride in storage.stride()[:2]):
        return None
    return TensorDescriptor.from_tensor(storage, block), in_kn


def _rows_descriptor(x: torch.Tensor, bm: int, bk: int) -> TensorDescriptor | None:
    """A TMA descriptor over the ``[S, K]`` rows with ``[BM, BK]`` blocks; None where one cannot
    address them (no unit stride along K, the row stride or the base not 16-byte aligned) or they are
    traced (:func:`_traced`)."""
    size = x.element_size()
    if _traced(x) or x.dim() != 2 or x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) * size % 16:
        return None
    return TensorDescriptor.from_tensor(x, [bm, bk])


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a traced tensor (fake; functional, the Python or the C++ wrapper, whose
    ``data_ptr`` is 0 or an error, not the tensor's address): torch traces a ``triton_op``'s kernels
    outside Dynamo (``torch.compile``'s AOT pass, ``opcheck``), where it does not capture TMA
    descriptors (torch 2.11's ``TracingTritonHOPifier``: "TMA descriptor capturing not yet supported
    in non-dynamo tracing"; the graph would launch a descriptor over a traced tensor), so a traced
    call keeps the pointer loads."""
    return is_fake(t) or isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t)


@triton.jit
def _indexed_weight_grad_kernel(
    A, B, OUT, ENDS, A_IDX, A_SCALE, B_IDX, B_SCALE, n_a, n_b, div_a, div_b,
    stride_am, stride_an, stride_bm, stride_bn, stride_oe, stride_oa, stride_ob,
    BA: tl.constexpr, BB: tl.constexpr, BR: tl.constexpr, A_INDEXED: tl.constexpr, A_SCALED: tl.constexpr,
    A_SLOTS: tl.constexpr, B_INDEXED: tl.constexpr, B_SCALED: tl.constexpr, B_SLOTS: tl.constexpr,
):  # fmt: skip
    # output tiles vary fastest: the CTAs running together read the same expert's rows (from L2)
    expert = tl.program_id(1).to(tl.int64)
    tiles_b = tl.cdiv(n_b, BB)
    ia = tl.program_id(0) // tiles_b
    ib = tl.program_id(0) % tiles_b
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
        if A_SLOTS:
            slot_a = tl.load(A_IDX + rows, mask=row_mask, other=0).to(tl.int64)
        if A_INDEXED:
            rows_a = slot_a // div_a
        else:
            rows_a = rows
        if B_SLOTS:
            slot_b = tl.load(B_IDX + rows, mask=row_mask, other=0).to(tl.int64)
        if B_INDEXED:
            rows_b = slot_b // div_b
        else:
            rows_b = rows
        a = tl.load(
            A + rows_a[None, :] * stride_am + cols_a[:, None] * stride_an,
            mask=mask_a[:, None] & row_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            B + rows_b[:, None] * stride_bm + cols_b[None, :] * stride_bn,
            mask=row_mask[:, None] & mask_b[None, :],
            other=0.0,
        )
        # a per-row scale rounds the scaled operand to its dtype, as a materialised copy would
        if A_SCALED:
            s = tl.load(A_SCALE + slot_a, mask=row_mask, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * s[None, :]).to(A.dtype.element_ty)
        if B_SCALED:
            s = tl.load(B_SCALE + slot_b, mask=row_mask, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * s[:, None]).to(B.dtype.element_ty)
        acc = _dot(a, b, acc)
    tl.store(
        OUT + expert * stride_oe + cols_a[:, None] * stride_oa + cols_b[None, :] * stride_ob,
        acc.to(OUT.dtype.element_ty),
        mask=mask_a[:, None] & mask_b[None, :],
    )


def grouped_mm_weight_grad(
    a: torch.Tensor,
    b: torch.Tensor,
    ends: torch.Tensor,
    *,
    a_idx: torch.Tensor | None = None,
    a_div: int = 1,
    a_scale: torch.Tensor | None = None,
    b_idx: torch.Tensor | None = None,
    b_div: int = 1,
    b_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[e] = A[rows of e]^T @ B[rows of e]`` -> ``[E, A, B]`` (zero for an expert without rows).

    Row s of A is ``a[a_idx[s] // a_div] * a_scale[a_idx[s]]`` (each part optional; same for B), so
    token-order tensors enter without a gathered copy. In a's dtype.
    """
    experts = ends.shape[0]
    n_a, n_b = a.shape[1], b.shape[1]
    out = a.new_empty((experts, n_a, n_b))
    if out.numel() == 0:
        return out
    if (a_scale is not None and a_idx is None) or (b_scale is not None and b_idx is None):
        raise ValueError("grouped_mm_weight_grad: a per-row scale is read through the operand's index")
    big = a.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16)
    tile_a, tile_b, block_r, warps, stages = (
        (WGRAD_TILES or (128, 128, 64, 8, 3)) if big else (64, 64, 32, 4, 2)
    )
    block_a = max(16, min(tile_a, triton.next_power_of_2(n_a)))
    block_b = max(16, min(tile_b, triton.next_power_of_2(n_b)))
    grid = (triton.cdiv(n_a, block_a) * triton.cdiv(n_b, block_b), experts)
    launchable(_indexed_weight_grad_kernel)[grid](
        a, b, out, ends, a_idx if a_idx is not None else ends, a_scale if a_scale is not None else out,
        b_idx if b_idx is not None else ends, b_scale if b_scale is not None else out, n_a, n_b, a_div, b_div,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BA=block_a, BB=block_b, BR=block_r, A_INDEXED=a_idx is not None, A_SCALED=a_scale is not None,
        A_SLOTS=a_idx is not None, B_INDEXED=b_idx is not None, B_SCALED=b_scale is not None,
        B_SLOTS=b_idx is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _slot_sum_kernel(
    SRC, W, OUT, n_cols, top_k, stride_src, stride_out, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, top_k):
        values = tl.load(SRC + (token * top_k + j) * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            values = values * tl.load(W + token * top_k + j).to(tl.float32)
        acc += values
    tl.store(OUT + token * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def slot_sum(src: torch.Tensor, top_k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j (w[t, j] *) src[t * k + j]`` in fp32, j in order; src ``[T k, H]`` -> ``[T, H]``."""
    tokens = src.shape[0] // top_k
    out = src.new_empty((tokens, src.shape[1]))
    if out.numel() == 0:
        return out
    block = min(_ROW_BLOCK, triton.next_power_of_2(src.shape[1]))
    launchable(_slot_sum_kernel)[(tokens, triton.cdiv(src.shape[1], block))](
        src, weights if weights is not None else src, out, src.shape[1], top_k, src.stride(0), out.stride(0),
        HAS_W=weights is not None, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _slot_dot_kernel(DOUT, SRC, DW, n_cols, top_k, stride_dout, stride_src, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    for j in range(0, top_k):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            dout = tl.load(DOUT + token * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(SRC + (token * top_k + j) * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
            acc += dout * y
        tl.store(DW + token * top_k + j, tl.sum(acc, axis=0))


def slot_dot(dout: torch.Tensor, src: torch.Tensor, top_k: int) -> torch.Tensor:
    """``dw[t, j] = <dout[t], src[t * k + j]>`` as float32 ``[T, k]``."""
    tokens = dout.shape[0]
    dw = torch.zeros((tokens, top_k), dtype=torch.float32, device=dout.device)
    if tokens == 0 or dout.shape[1] == 0:
        return dw
    block = min(_ROW_BLOCK, triton.next_power_of_2(dout.shape[1]))
    launchable(_slot_dot_kernel)[(tokens,)](
        dout, src, dw, dout.shape[1], top_k, dout.stride(0), src.stride(0), BLOCK=block
    )
    return dw
