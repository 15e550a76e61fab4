"""Row-wise FP8 quantisation in one kernel: per row, the largest magnitude, the float32 scale and the
FP8 codes, from one read of a 16-bit (or float32) input.

Computes exactly what ``lightning_sloth.ops.fp8_formats.quantize_rows`` computes in plain torch::

    v        = float32(x[i, j]) * col_scale[j]     (col_scale optional: W's scales folded into dy;
                                                   row_groups[i] picks row i's [K] row of a 2-D one)
    scale[i] = max_j |v| / FMAX                     (1 for a zero row)
    q[i, j]  = fp8_rne(clamp(v / scale[i], -FMAX, FMAX))

Divisions are IEEE round-to-nearest (``div_rn``) and the conversion rounds to nearest even, so the
codes and scales equal the plain-torch ones bit for bit. A program owns one row: a row of up to 4,096
columns is read once and kept in registers; a longer one is walked twice in ``BLOCK``-wide chunks
(the amax, then the codes; the second read of a row of a few KiB comes from L2): three bytes of
traffic per bf16 element, against the dozens of the unfused torch ops.

The Triton interpreter's float8 conversion does not round like the hardware (it drops carries into
the exponent), so the codes are checked on the GPU; the interpreter checks the scales.

``quantize_rows_lora``: the same codes and scales for the input of LoRA layers over FP8 bases, with
the adapters' ``x A_i^T`` (rank r_i) made from the same read of x: a program owns ``BLOCK_M`` rows
at a time and walks them in ``BLOCK_K``-wide chunks (the amax and each adapter's product, one
``tl.dot`` per chunk in float32, rounded once to x's dtype), then again for the codes (the second
read from L2). Without
it each adapter's product is a skinny GEMM of its own that reads all of x again. With
``codes=False`` only the products: a checkpoint's recompute that skips the base product
(``UnreadSumFP8``) gets the forward's ``x A^T`` bit for bit.

``transpose_bytes``: the transposed copy of an FP8 weight's codes that the input gradient's
``_scaled_mm`` needs (its second operand column-major), in tiles read and written along their rows.
torch's strided copy of one-byte elements moved the 8B shape's codes at about 0.3 TB/s (221 copies,
47.4 ms of a 1,222 ms step on the H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import _multiprocessors, launchable

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

ONE_PASS_MAX_COLS = 4096
"""The widest row read once and kept in registers; wider rows are walked twice in 4,096-wide chunks.
Reading rows of up to 16,384 once (up to 32 warps) left the 5,760-wide GPT-OSS-20B expert gradient's
quantisation where it was on the H200 (0.640 against 0.653 ms, ``moe_fp8_gemm_16k_h200.json``), so
the bound stays where it was measured to gain."""


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_kernel(
    X,
    COL_SCALE,
    Q,
    SCALE,
    n_rows,
    n_cols,
    stride_x,
    stride_q,
    ROW_GROUPS,
    FMAX: tl.constexpr,
    HAS_COL_SCALE: tl.constexpr,
    HAS_ROW_GROUPS: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    if HAS_ROW_GROUPS:
        COL_SCALE += tl.load(ROW_GROUPS + row).to(tl.int64) * n_cols
    if ONE_PASS:  # the row fits one block: read it once, keep it in registers
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(COL_SCALE + cols, mask=mask, other=0.0)
        row_max = tl.max(tl.abs(v), axis=0)
        scale = tl.where(row_max > 0, tl.math.div_rn(row_max, FMAX), 1.0)
        tl.store(SCALE + row, scale)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FMAX), FMAX)
        code = v.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(Q + row * stride_q + cols, code, mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(COL_SCALE + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
    row_max = tl.max(amax, axis=0)
    scale = tl.where(row_max > 0, tl.math.div_rn(row_max, FMAX), 1.0)
    tl.store(SCALE + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(COL_SCALE + cols, mask=mask, other=0.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FMAX), FMAX)
        code = v.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(Q + row * stride_q + cols, code, mask=mask)


def quantize_rows(
    x: torch.Tensor,
    dtype: torch.dtype,
    col_scale: torch.Tensor | None = None,
    row_groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] in dtype, scales [M, 1] float32)`` of ``x [M, K]`` (unit stride along K).

    Args:
        x: float16/bfloat16/float32 ``[M, K]``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        col_scale: optional float32 ``[K]`` multiplied into each row before the amax, or ``[G, K]``
            (contiguous) with ``row_groups``: row i is multiplied by ``col_scale[row_groups[i]]``.
        row_groups: int64 ``[M]`` group of each row (an expert's scales for its rows), with a 2-D
            ``col_scale`` only.
    """
    if dtype not in _FP8:
        raise ValueError(f"quantize_rows writes float8_e4m3fn or float8_e5m2, not {dtype}")
    if (row_groups is not None) != (col_scale is not None and col_scale.dim() == 2):
        raise ValueError("quantize_rows: row_groups goes with a 2-D [G, K] col_scale, and only with one")
    if col_scale is not None:
        col_scale = col_scale.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_rows, n_cols = x.shape
    q = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device)
    scale = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return q, scale
    block = triton.next_power_of_2(max(n_cols, 16))
    if block > ONE_PASS_MAX_COLS:
        block = 4096  # walked twice in chunks
    launchable(_quantize_rows_kernel)[(n_rows,)](
        x,
        col_scale if col_scale is not None else scale,
        q,
        scale,
        n_rows,
        n_cols,
        x.stride(0),
        q.stride(0),
        row_groups if row_groups is not None else scale,
        FMAX=torch.finfo(dtype).max,
        HAS_COL_SCALE=col_scale is not None,
        HAS_ROW_GROUPS=row_groups is not None,
        ONE_PASS=n_cols <= block,
        BLOCK=block,
        num_warps=min(32, max(8, block // 512)) if block >= 2048 else 4,
    )
    return q, scale


MAX_ADAPTERS = 3
"""Adapters one ``quantize_rows_lora`` call serves (q/k/v, gate/up, or one layer)."""


@triton.jit
def _adapter_product(x, A, cols, col_mask, n_cols, acc, rank, RANK_BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """``acc += x [BLOCK_M, BLOCK_K] @ A[:, cols]^T`` (A ``[rank, n_cols]`` row-major) in float32."""
    ranks = tl.arange(0, RANK_BLOCK)
    a = tl.load(
        A + ranks[None, :] * n_cols + cols[:, None],
        mask=col_mask[:, None] & (ranks[None, :] < rank),
        other=0.0,
    )
    if IEEE:
        return tl.dot(x, a, acc, input_precision="ieee")
    return tl.dot(x, a, acc)


@triton.jit
def _store_product(XA, acc, rows, row_mask, stride_xa, rank, RANK_BLOCK: tl.constexpr):
    ranks = tl.arange(0, RANK_BLOCK)
    tl.store(
        XA + rows[:, None] * stride_xa + ranks[None, :],
        acc.to(XA.dtype.element_ty),
        mask=row_mask[:, None] & (ranks[None, :] < rank),
    )


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_lora_kernel(
    X,
    Q,
    SCALE,
    XA,
    A0,
    A1,
    A2,
    n_rows,
    n_cols,
    stride_x,
    stride_q,
    stride_xa,
    rank0,
    rank1,
    rank2,
    FMAX: tl.constexpr,
    CODES: tl.constexpr,
    N_ADAPTERS: tl.constexpr,
    RANK0: tl.constexpr,
    RANK1: tl.constexpr,
    RANK2: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid-stride over blocks of rows: the launcher bounds the programs so that the rows they
    # walk at once stay in L2 for the second pass (see quantize_rows_lora).
    for block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, RANK0], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, RANK1], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, RANK2], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_mask = cols < n_cols
            x = tl.load(
                X + rows[:, None] * stride_x + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if CODES:
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
            acc0 = _adapter_product(x, A0, cols, col_mask, n_cols, acc0, rank0, RANK0, IEEE)
            if N_ADAPTERS > 1:
                acc1 = _adapter_product(x, A1, cols, col_mask, n_cols, acc1, rank1, RANK1, IEEE)
            if N_ADAPTERS > 2:
                acc2 = _adapter_product(x, A2, cols, col_mask, n_cols, acc2, rank2, RANK2, IEEE)
        _store_product(XA, acc0, rows, row_mask, stride_xa, rank0, RANK0)
        if N_ADAPTERS > 1:
            _store_product(XA + rank0, acc1, rows, row_mask, stride_xa, rank1, RANK1)
        if N_ADAPTERS > 2:
            _store_product(XA + rank0 + rank1, acc2, rows, row_mask, stride_xa, rank2, RANK2)
        if CODES:
            scale = tl.where(amax > 0, tl.math.div_rn(amax, FMAX), 1.0)
            tl.store(SCALE + rows, scale, mask=row_mask)
            for start in range(0, n_cols, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                v = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -FMAX), FMAX)
                code = v.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
                tl.store(Q + rows[:, None] * stride_q + cols[None, :], code, mask=mask)


LORA_BLOCK_M = 32
"""Rows per program up to :data:`ONE_PASS_MAX_COLS` columns (16 above): each block of rows reads
every A once more from L2, so more rows read them less often, fewer rows keep more programs within
:data:`LORA_ROWS_IN_FLIGHT_BYTES`."""
LORA_BLOCK_K = 256
LORA_ROWS_IN_FLIGHT_BYTES = 24 << 20
"""The bytes of x the programs of one ``quantize_rows_lora`` call hold between their two passes at
most (their rows, read once for the amax and the products, then again for the codes): about half
an H100's L2, so that the second read comes from there."""


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def quantize_rows_lora(
    x: torch.Tensor, adapters: list[torch.Tensor], dtype: torch.dtype | None = torch.float8_e4m3fn
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(codes, scales, xa)`` for ``x [M, K]`` and the adapters' ``A_i [r_i, K]`` (x's dtype,
    contiguous): codes and scales as :func:`quantize_rows` makes them, bit for bit, and
    ``xa = [x A_1^T, x A_2^T, ...]`` ``[M, sum r_i]`` in x's dtype (each product in float32, rounded
    once). ``dtype=None``: the products alone (codes and scales None). Each adapter's product does not
    depend on the others passed with it: one layer alone and the same layer in a group get the same
    ``x A^T`` bit for bit."""
    if not 1 <= len(adapters) <= MAX_ADAPTERS:
        raise ValueError(f"quantize_rows_lora takes 1 to {MAX_ADAPTERS} adapters, got {len(adapters)}")
    if dtype is not None and dtype not in _FP8:
        raise ValueError(f"quantize_rows_lora writes float8_e4m3fn or float8_e5m2, not {dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_rows, n_cols = x.shape
    for a in adapters:
        if (
            a.dim() != 2
            or not a.shape[0]
            or a.shape[1] != n_cols
            or a.dtype != x.dtype
            or not a.is_contiguous()
        ):
            raise ValueError(
                f"quantize_rows_lora: each A must be a contiguous [r, {n_cols}] {x.dtype} tensor (r >= 1), got "
                f"{a.dtype} {tuple(a.shape)}"
            )
    ranks = [a.shape[0] for a in adapters]
    xa = torch.empty(n_rows, sum(ranks), dtype=x.dtype, device=x.device)
    q = scale = None
    if dtype is not None:
        q = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device)
        scale = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return q, scale, xa
    padded = adapters + [adapters[0]] * (MAX_ADAPTERS - len(adapters))
    padded_ranks = ranks + [0] * (MAX_ADAPTERS - len(ranks))
    block_m = LORA_BLOCK_M if n_cols <= ONE_PASS_MAX_COLS else 16
    blocks = triton.cdiv(n_rows, block_m)
    programs = max(1, LORA_ROWS_IN_FLIGHT_BYTES // (block_m * n_cols * x.element_size()))
    if x.is_cuda:  # at least one program per SM, whatever the width
        programs = max(
            programs,
            _multiprocessors(x.device.index if x.device.index is not None else torch.cuda.current_device()),
        )
    else:  # the interpreter: a few programs exercise the grid-stride loop
        programs = min(programs, 2)
    launchable(_quantize_rows_lora_kernel)[(min(blocks, programs),)](
        x,
        q if q is not None else xa,
        scale if scale is not None else xa,
        xa,
        *padded,
        n_rows,
        n_cols,
        x.stride(0),
        q.stride(0) if q is not None else 0,
        xa.stride(0),
        *padded_ranks,
        FMAX=torch.finfo(dtype).max if dtype is not None else 1.0,
        CODES=dtype is not None,
        N_ADAPTERS=len(adapters),
        RANK0=_rank_block(padded_ranks[0]),
        RANK1=_rank_block(padded_ranks[1]),
        RANK2=_rank_block(padded_ranks[2]),
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_K=LORA_BLOCK_K,
        num_warps=4,
    )
    return q, scale, xa


@triton.jit
def _transpose_bytes_kernel(X, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tile = tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask)
    tl.store(Y + cols[:, None] * n_rows + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor of one-byte elements (FP8 codes, ``uint8``), in
    ``128 x 128`` tiles; the result has ``x``'s dtype."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(
            f"transpose_bytes takes a 2-D tensor of one-byte elements, got {tuple(x.shape)} {x.dtype}"
        )
    bits = x.contiguous().view(torch.uint8)
    n_rows, n_cols = bits.shape
    out = torch.empty(n_cols, n_rows, dtype=torch.uint8, device=x.device)
    if bits.numel():
        grid = (triton.cdiv(n_rows, 128), triton.cdiv(n_cols, 128))
        launchable(_transpose_bytes_kernel)[grid](
            bits, out, n_rows, n_cols, BLOCK_R=128, BLOCK_C=128, num_warps=8
        )
    return out.view(x.dtype)
