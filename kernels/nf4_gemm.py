"""Matrix products with a 4-bit weight decoded inside the GEMM's operand load (no dequantised copy).

The weight ``W [N, K]`` is stored as in ``lightning_sloth.kernels.nf4`` (row-major 4-bit codes, two
per byte, the even element in the high nibble; float32 block scales). With ``K`` even, byte ``b``
of row ``n`` holds columns ``2b`` (high nibble) and ``2b + 1`` (low nibble), and both share one
block scale. So each K step loads a tile of bytes once and splits it into two half-width operands::

    y  = x  @ W^T :   y  += x[:, 0::2] @ hi^T  +  x[:, 1::2] @ lo^T        (matmul_4bit)
    dx = dy @ W   :   dx[:, 0::2] += dy @ hi;   dx[:, 1::2] += dy @ lo       (matmul_4bit_t)

with ``hi = round(code[b >> 4] * absmax)``, ``lo = round(code[b & 15] * absmax)`` rounded to the
input dtype exactly as the dequantisation kernel rounds them, and float32 accumulation. Small
products (decoding, a few hundred tokens) leave most SMs idle with one program per output tile, so
the reduction is split over ``SPLIT`` programs writing float32 partial sums, added afterwards.

Measured on the H100 (``benchmarks/results/nf4_gemm_h100.json``) these kernels are slower than
dequantise-into-a-buffer + cuBLAS at every token count tried, 16 to 16,384 (0.3x to 0.9x at 16
tokens, about 0.03x at 16k): each code and block scale is a gathered load per element, and the
byte tiles are not vectorised. So ``sloth::lora_linear_4bit`` does not use them
(``lightning_sloth.ops.nf4.FUSED_MAX_ROWS = 0``); they stay as the ``sloth::matmul_4bit`` ops, the
measured alternative.

Double-quantised scales (``nf4-dq``) are decoded to float32 before the call (a ``[K * N / 64]``
vector), as for the buffer path; the kernel reads float32 scales only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import _multiprocessors as multiprocessors
from lightning_sloth.kernels._utils import launchable


@triton.jit
def _decode(packed, scale, CODE, dtype: tl.constexpr):
    """(high, low) nibbles of ``packed`` (int32) decoded and rounded to ``dtype``."""
    high = (tl.load(CODE + (packed >> 4)) * scale).to(dtype)
    low = (tl.load(CODE + (packed & 15)) * scale).to(dtype)
    return high, low


# M (the batch's rows) is not specialized: no batch brings a new compile.
@triton.jit(do_not_specialize=["M"])
def _matmul_4bit_kernel(
    X, PACKED, ABSMAX, CODE, OUT,
    M, N, HALF_K,
    stride_xm, stride_om, stride_os, steps_per_split,
    HALF_BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = rn.to(tl.int64)[None, :] * HALF_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(steps_per_split):
        kb = (pid_s * steps_per_split + step) * BLOCK_KB + tl.arange(0, BLOCK_KB)
        k_ok = kb < HALF_K
        byte = w_rows + kb[:, None]  # [BLOCK_KB, BLOCK_N]
        w_ok = k_ok[:, None] & n_ok[None, :]
        packed = tl.load(PACKED + byte, mask=w_ok, other=0).to(tl.int32)
        scale = tl.load(ABSMAX + byte // HALF_BLOCKSIZE, mask=w_ok, other=0.0)
        high, low = _decode(packed, scale, CODE, X.dtype.element_ty)
        x_ok = m_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_rows + 2 * kb[None, :], mask=x_ok, other=0.0)
        x_odd = tl.load(x_rows + 2 * kb[None, :] + 1, mask=x_ok, other=0.0)
        if IEEE:
            acc = tl.dot(x_even, high, acc, input_precision="ieee")
            acc = tl.dot(x_odd, low, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_even, high, acc)
            acc = tl.dot(x_odd, low, acc)
    out = OUT + pid_s.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _matmul_4bit_t_kernel(
    DY, PACKED, ABSMAX, CODE, OUT,
    M, N, HALF_K,
    stride_dym, stride_om, stride_os, steps_per_split,
    HALF_BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = pid_k * BLOCK_KB + tl.arange(0, BLOCK_KB)
    m_ok, k_ok = rm < M, kb < HALF_K
    dy_rows = DY + rm.to(tl.int64)[:, None] * stride_dym
    acc_even = tl.zeros((BLOCK_M, BLOCK_KB), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_M, BLOCK_KB), dtype=tl.float32)
    for step in range(steps_per_split):
        rn = (pid_s * steps_per_split + step) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        byte = rn.to(tl.int64)[:, None] * HALF_K + kb[None, :]  # [BLOCK_N, BLOCK_KB]
        w_ok = n_ok[:, None] & k_ok[None, :]
        packed = tl.load(PACKED + byte, mask=w_ok, other=0).to(tl.int32)
        scale = tl.load(ABSMAX + byte // HALF_BLOCKSIZE, mask=w_ok, other=0.0)
        high, low = _decode(packed, scale, CODE, DY.dtype.element_ty)
        dy = tl.load(dy_rows + rn[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc_even = tl.dot(dy, high, acc_even, input_precision="ieee")
            acc_odd = tl.dot(dy, low, acc_odd, input_precision="ieee")
        else:
            acc_even = tl.dot(dy, high, acc_even)
            acc_odd = tl.dot(dy, low, acc_odd)
    out = OUT + pid_s.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + 2 * kb[None, :]
    ok = m_ok[:, None] & k_ok[None, :]
    tl.store(out, acc_even.to(OUT.dtype.element_ty), mask=ok)
    tl.store(out + 1, acc_odd.to(OUT.dtype.element_ty), mask=ok)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits exercise the partial sums
    return multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def _tiles(m: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_KB, num_warps)`` for ``m`` rows: thin tiles for few rows; float32
    rows take half the ``N`` tile (128x128 float32 tiles, pipelined, need 256 KiB of shared memory
    in the transposed product, more than an H100 has)."""
    if m <= 16:
        return 16, 64, 64, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 64 if itemsize == 4 else 128, 32, 8


def _launch(a: torch.Tensor, m: int, outer: int, inner_steps: int, block_outer: int, out_cols: int, tiles):
    """Split the reduction (``inner_steps`` tiles) so the grid fills the GPU about twice, then launch."""
    block_m, _, _, warps = tiles
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(outer, block_outer)
    split = max(1, min(inner_steps, 16, (2 * _multiprocessors(a.device)) // grid_mn))
    steps = triton.cdiv(inner_steps, split)
    split = triton.cdiv(inner_steps, steps)
    if split == 1:
        out = torch.empty(m, out_cols, dtype=a.dtype, device=a.device)
    else:
        out = torch.empty(split, m, out_cols, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(outer, block_outer), split)
    return out, grid, steps, warps


def matmul_4bit(
    x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, n: int
) -> torch.Tensor:
    """``x @ W^T`` for the 4-bit ``W [n, K]``, decoded in the operand load.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32 rows, unit column stride, ``K`` even.
        packed: ``uint8`` codes of ``W`` (``n * K / 2`` bytes, contiguous).
        absmax: float32 ``[n * K / blocksize]`` block scales.
        code: float32 ``[16]`` code book.
        blocksize: elements per block scale (even).
        n: output features.

    Returns:
        ``[M, n]`` in x's dtype (float32 accumulation).
    """
    m, k = x.shape
    if m == 0:
        return x.new_empty(0, n)
    half_k = k // 2
    tiles = _tiles(m, x.element_size())
    block_m, block_n, block_kb, _ = tiles
    out, grid, steps, warps = _launch(x, m, n, triton.cdiv(half_k, block_kb), block_n, n, tiles)
    launchable(_matmul_4bit_kernel)[grid](
        x, packed, absmax, code, out, m, n, half_k,
        x.stride(0), out.stride(-2), out.stride(0) if out.dim() == 3 else 0, steps,
        HALF_BLOCKSIZE=blocksize // 2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KB=block_kb, IEEE=x.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip
    return out if out.dim() == 2 else out.sum(0).to(x.dtype)


def matmul_4bit_t(
    dy: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, k: int
) -> torch.Tensor:
    """``dy @ W`` for the 4-bit ``W [N, k]`` (the input gradient of :func:`matmul_4bit`).

    Args:
        dy: ``[M, N]`` float16/bfloat16/float32, unit column stride.
        packed, absmax, code, blocksize: ``W``'s storage (see :func:`matmul_4bit`); ``k`` even.
        k: input features.

    Returns:
        ``[M, k]`` in dy's dtype.
    """
    m, n = dy.shape
    if m == 0:
        return dy.new_empty(0, k)
    half_k = k // 2
    tiles = _tiles(m, dy.element_size())
    block_m, block_n, block_kb, _ = tiles
    out, grid, steps, warps = _launch(dy, m, half_k, triton.cdiv(n, block_n), block_kb, k, tiles)
    launchable(_matmul_4bit_t_kernel)[grid](
        dy, packed, absmax, code, out, m, n, half_k,
        dy.stride(0), out.stride(-2), out.stride(0) if out.dim() == 3 else 0, steps,
        HALF_BLOCKSIZE=blocksize // 2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KB=block_kb, IEEE=dy.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip
    return out if out.dim() == 2 else out.sum(0).to(dy.dtype)
