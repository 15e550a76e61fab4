"""4-bit base weights as ops: ``sloth::dequantize_4bit``, the fused products ``sloth::matmul_4bit`` /
``sloth::matmul_4bit_t`` and the LoRA layer ``sloth::lora_linear_4bit``.

The 4-bit weight (NF4/FP4 codes, two per byte, float32 block scales: the bitsandbytes layout, see
``lightning_sloth.ops.nf4_formats``) is frozen. The LoRA layer dequantises it into a scratch buffer
shared by every call of the same dtype and device (one flat buffer, the size of the largest
weight), then runs the same products as
``sloth::lora_linear``::

    forward   W  = dequant(packed)                     [out, in]  (scratch, never saved)
              xa = x A^T;  y = x W^T + scale * xa B^T
    backward  W  = dequant(packed)                     again, into the same scratch
              g  = scale * (dy B);  dA = g^T x;  dB = dy^T (scale * xa);  dx = dy W + g A

Saved for the backward: ``x``, ``xa`` and the 4-bit storage (a few bytes per weight), never a
dequantised weight. A base layer without adapters is the rank-0 case (``A [0, in]``, ``B [out, 0]``).
While anything traces, the scratch is a fresh tensor (a graph must not capture module state).

Two ways to run the base product ``x W^T`` (and ``dy W`` in the backward), chosen per call by the
number of rows (tokens):

- buffer: dequantise the whole weight into the scratch, then cuBLAS. The dequantisation costs a
  fixed ``2.5 * N * K`` bytes of traffic, small beside a GEMM over many rows;
- fused (``lightning_sloth.kernels.nf4_gemm``): a Triton GEMM that decodes the 4-bit codes inside
  its operand load and never writes the weight out; it reads ``N * K / 2`` bytes, which could pay
  where the product is bound by reading the weight (decoding, short steps), never once the rows
  make it compute bound (cuBLAS's tensor-core pipeline is far ahead there).

:data:`FUSED_MAX_ROWS` is the crossover measured on the H100 (``benchmarks/nf4_gemm_bench.py``,
``benchmarks/results/nf4_gemm_h100.json``): the fused kernel runs for at most that many rows, on
CUDA, with an even ``in_features``. The measurement found no crossover: the fused kernels as they
are lost at every token count from 16 to 16,384 on the four Llama-3.1-8B projection shapes, so it
is 0 and the buffer path always runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sloth.ops.registry import (
    TRITON_OPS,
    call,
    register_autograd,
    register_flops,
    sloth_op,
    tracing,
    use_triton,
)

if TRITON_OPS:
    from lightning_sloth.kernels import nf4 as _kernels
    from lightning_sloth.kernels import nf4_gemm as _gemm_kernels

__all__ = [
    "FUSED_MAX_ROWS",
    "dequantize_4bit",
    "dequantize_4bit_into",
    "lora_linear_4bit",
    "matmul_4bit",
    "release_scratch",
    "scratch_bytes",
]

FUSED_MAX_ROWS = 0
"""Rows (tokens) up to which the 4-bit base product decodes inside the GEMM instead of a buffer +
cuBLAS: 0, measured (the fused kernels never won; see the module notes)."""


def use_fused(x: Tensor, rows: int, in_features: int) -> bool:
    """Whether the base product of ``rows`` rows runs the fused decode-in-GEMM kernel (see the module notes)."""
    return use_triton(x) and in_features % 2 == 0 and 0 < rows <= FUSED_MAX_ROWS


def dequantize_4bit_into(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, out: Tensor) -> Tensor:
    """Dequantise into ``out`` (contiguous, the weight's shape and the target dtype) and return it.

    The Triton kernel on CUDA; elsewhere plain torch with the same arithmetic (one float32 product,
    one rounding), so both give the same bits.
    """
    if use_triton(out):
        return _kernels.dequantize_4bit(packed, absmax, code, blocksize, out)
    n = out.numel()
    flat = packed.reshape(-1)
    codes = torch.stack((flat >> 4, flat & 15), dim=1).reshape(-1)[:n].long()
    scales = absmax.repeat_interleave(blocksize)[:n]
    return out.copy_((code[codes] * scales).view(out.shape))


_SCRATCH: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _scratch(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A ``[rows, cols]`` dequantisation buffer (a fresh one while tracing).

    Every use is a view at the start of one flat buffer per dtype and device: a dequantised weight
    lives only between its decode and the product that reads it, one at a time on the stream, so
    all the shapes of a model (q/k/v/o, gate/up, down; the experts of a layer) share the bytes of
    its largest, instead of each shape keeping its own. The buffer grows to the largest use seen.
    """
    if tracing():
        return torch.empty(rows, cols, dtype=dtype, device=device)
    key = (dtype, device)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < rows * cols:
        _SCRATCH.pop(key, None)  # the old bytes go back before the larger buffer is made
        del buffer
        buffer = _SCRATCH[key] = torch.empty(rows * cols, dtype=dtype, device=device)
    return buffer[: rows * cols].view(rows, cols)


def scratch_bytes() -> int:
    """Bytes the dequantisation buffers hold now (all dtypes and devices)."""
    return sum(t.numel() * t.element_size() for t in _SCRATCH.values())


def release_scratch() -> None:
    """Free the dequantisation buffers (they are made again on the next call)."""
    _SCRATCH.clear()


@sloth_op("dequantize_4bit")
def _dequantize_op(
    packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int, cols: int, dtype: torch.dtype
) -> Tensor:
    out = torch.empty(rows, cols, dtype=dtype, device=packed.device)
    return dequantize_4bit_into(packed, absmax, code, blocksize, out)


@_dequantize_op.register_fake
def _dequantize_fake(packed, absmax, code, blocksize, rows, cols, dtype):
    return packed.new_empty((rows, cols), dtype=dtype)


register_flops(_dequantize_op, lambda *args, out_shape=None: math.prod(out_shape))


def dequantize_4bit(
    packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, shape: tuple[int, int], dtype: torch.dtype
) -> Tensor:
    """The ``[rows, cols]`` weight in ``dtype`` (float16/bfloat16/float32) from its 4-bit storage.

    Args:
        packed: ``uint8`` codes, two per byte (``[ceil(n / 2), 1]``).
        absmax: float32 ``[ceil(n / blocksize)]`` block scales (double-quantised scales decoded first).
        code: float32 ``[16]`` code book.
        blocksize: elements per block.
        shape: ``(rows, cols)``.
        dtype: output dtype.
    """
    _check_storage(packed, absmax, code, blocksize, math.prod(shape))
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"4-bit weights dequantise to float16/bfloat16/float32, not {dtype}")
    return call(_dequantize_op, packed, absmax, code, int(blocksize), int(shape[0]), int(shape[1]), dtype)


def _check_storage(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, n: int) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"4-bit codes must be uint8, got {packed.dtype}")
    if absmax.dtype != torch.float32 or code.dtype != torch.float32:
        raise TypeError(f"absmax and code must be float32, got {absmax.dtype} and {code.dtype}")
    if blocksize < 2 or blocksize % 2:
        raise ValueError(f"blocksize must be even, got {blocksize}")
    if packed.numel() != -(-n // 2) or absmax.numel() != -(-n // blocksize) or code.numel() != 16:
        raise ValueError(
            f"4-bit storage does not fit {n} elements: {packed.numel()} bytes, {absmax.numel()} scales "
            f"(block {blocksize}), {code.numel()} codes"
        )
    if len({packed.device, absmax.device, code.device}) > 1:
        raise ValueError(
            f"4-bit storage tensors are on different devices: {packed.device}, {absmax.device}, {code.device}"
        )


# ------------------------------------------------------------------- fused decode-in-GEMM products
@sloth_op("matmul_4bit")
def _matmul_op(x: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, n: int) -> Tensor:
    """``x [M, K] @ W^T`` for the 4-bit ``W [n, K]``: Triton decodes W in the load on CUDA."""
    if use_triton(x) and x.shape[1] % 2 == 0:
        return _gemm_kernels.matmul_4bit(x.contiguous(), packed, absmax, code, blocksize, n)
    weight = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
    return x @ dequantize_4bit_into(packed, absmax, code, blocksize, weight).t()


@_matmul_op.register_fake
def _matmul_fake(x, packed, absmax, code, blocksize, n):
    return x.new_empty((x.shape[0], n))


@sloth_op("matmul_4bit_t")
def _matmul_t_op(dy: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, k: int) -> Tensor:
    """``dy [M, N] @ W`` for the 4-bit ``W [N, k]``."""
    if use_triton(dy) and k % 2 == 0:
        return _gemm_kernels.matmul_4bit_t(dy.contiguous(), packed, absmax, code, blocksize, k)
    weight = torch.empty(dy.shape[1], k, dtype=dy.dtype, device=dy.device)
    return dy @ dequantize_4bit_into(packed, absmax, code, blocksize, weight)


@_matmul_t_op.register_fake
def _matmul_t_fake(dy, packed, absmax, code, blocksize, k):
    return dy.new_empty((dy.shape[0], k))


def _matmul_setup(ctx, inputs, output):
    x, packed, absmax, code, blocksize, n = inputs
    ctx.save_for_backward(packed, absmax, code)
    ctx.blocksize, ctx.k = blocksize, x.shape[1]


def _matmul_backward(ctx, grad_y):
    packed, absmax, code = ctx.saved_tensors
    if any(ctx.needs_input_grad[1:4]):
        raise RuntimeError("sloth::matmul_4bit: the 4-bit weight is frozen; it has no gradient")
    dx = call(_matmul_t_op, grad_y.contiguous(), packed, absmax, code, ctx.blocksize, ctx.k)
    return dx, None, None, None, None, None


register_autograd(_matmul_op, _matmul_backward, _matmul_setup)
register_flops(
    _matmul_op,
    lambda x, packed, absmax, code, blocksize, n, out_shape=None: 2 * x[0] * x[1] * n + x[1] * n,
)
register_flops(
    _matmul_t_op,
    lambda dy, packed, absmax, code, blocksize, k, out_shape=None: 2 * dy[0] * dy[1] * k + dy[1] * k,
)


def matmul_4bit(
    x: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, out_features: int
) -> Tensor:
    """``x @ W.T`` with the 4-bit ``W [out_features, in]`` decoded inside the GEMM (never materialised).

    Args:
        x: ``[..., in]`` float16/bfloat16/float32; the product runs in its dtype, float32 accumulation.
        packed, absmax, code, blocksize: ``W``'s storage (float32 block scales; see :func:`dequantize_4bit`).
        out_features: rows of ``W``.

    Returns:
        ``[..., out_features]`` in x's dtype; the gradient flows to x (``dy @ W``, decoded the same way).
        On CUDA with an even ``in`` it runs the fused Triton kernels; elsewhere dequantise + matmul.
    """
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"matmul_4bit computes in float16/bfloat16/float32, got x of dtype {x.dtype}")
    _check_storage(packed, absmax, code, blocksize, out_features * x.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    y = call(_matmul_op, rows, packed, absmax, code, int(blocksize), int(out_features))
    return y.view(*x.shape[:-1], out_features)


# --------------------------------------------------------------------------------------- LoRA
@sloth_op("lora_linear_4bit")
def _lora_4bit_op(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    overwrite_input: bool = False,
) -> tuple[Tensor, Tensor]:
    """Returns ``(y [..., out], xa [N, r])``; ``xa`` is kept for the backward. ``overwrite_input``:
    the backward writes x's gradient into x's memory (:func:`lora_linear_4bit`)."""
    out_features, in_features = lora_b.shape[0], x.shape[-1]
    rows = x.reshape(-1, in_features)
    xa = rows @ lora_a.t()
    if rows.shape[0] == 0:  # nothing to multiply: no weight decoded, no buffer made
        y = rows.new_zeros(0, out_features)
    elif use_fused(x, rows.shape[0], in_features):
        y = _gemm_kernels.matmul_4bit(rows.contiguous(), packed, absmax, code, blocksize, out_features)
    else:
        weight = dequantize_4bit_into(
            packed, absmax, code, blocksize, _scratch(out_features, in_features, x.dtype, x.device)
        )
        y = torch.mm(rows, weight.t())
    if lora_a.shape[0]:
        y.addmm_(xa, lora_b.t(), alpha=scale)
    return y.view(*x.shape[:-1], out_features), xa


@_lora_4bit_op.register_fake
def _lora_4bit_fake(x, packed, absmax, code, blocksize, lora_a, lora_b, scale, overwrite_input=False):
    y = x.new_empty((*x.shape[:-1], lora_b.shape[0]))
    return y, x.new_empty((math.prod(x.shape[:-1]), lora_a.shape[0]))


@sloth_op("lora_linear_4bit_backward")
def _lora_4bit_backward_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_x: bool,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dx, dA, dB)``; gradients not asked for are empty tensors."""
    dy = grad_y.reshape(-1, grad_y.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    g = (dy @ lora_b) * scale if (grad_x or grad_a) else None
    dx = x.new_empty(0)
    if grad_x:
        storage = (packed, absmax, code, blocksize, lora_b.shape[0])
        dx = _input_rows(dy, g, x, lora_a, *storage) if dy.shape[0] else x.new_zeros(0, x.shape[-1])
        dx = dx.view(x.shape)
    da = g.t() @ rows if grad_a else x.new_empty(0)
    db = dy.t() @ (xa * scale) if grad_b else x.new_empty(0)
    return dx, da, db


@_lora_4bit_backward_op.register_fake
def _lora_4bit_backward_fake(
    grad_y, x, xa, packed, absmax, code, blocksize, lora_a, lora_b, scale, grad_x, grad_a, grad_b
):
    return (
        x.new_empty(x.shape) if grad_x else x.new_empty(0),
        torch.empty_like(lora_a) if grad_a else x.new_empty(0),
        torch.empty_like(lora_b) if grad_b else x.new_empty(0),
    )


@sloth_op("lora_linear_4bit_backward_", mutates_args=("x",))
def _lora_4bit_backward_inplace_op(
    grad_y: Tensor,
    x: Tensor,
    xa: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    grad_a: bool,
    grad_b: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`_lora_4bit_backward_op` writing ``dx`` into x (after ``dA`` has read it): the same
    products in the same order, one ``[N, in]`` buffer fewer. Returns ``(dA, dB)``."""
    dy = grad_y.reshape(-1, grad_y.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    g = (dy @ lora_b) * scale
    da = g.t() @ rows if grad_a else x.new_empty(0)
    db = dy.t() @ (xa * scale) if grad_b else x.new_empty(0)
    if dy.shape[0]:
        # rows is a view of x where x is contiguous: the product lands in x's memory
        out = rows if x.is_contiguous() else None
        dx = _input_rows(dy, g, x, lora_a, packed, absmax, code, blocksize, lora_b.shape[0], out=out)
        if dx is not rows:
            x.copy_(dx.view(x.shape))
    return da, db


def _input_rows(
    dy, g, x, lora_a, packed, absmax, code, blocksize: int, out_features: int, out=None
) -> Tensor:
    """``dy W + g A`` as ``[N, in]`` rows for the two backward ops: the fused kernel where it
    applies, else the decoded weight's product (written into ``out`` where given)."""
    if use_fused(x, dy.shape[0], x.shape[-1]):
        dx = _gemm_kernels.matmul_4bit_t(dy.contiguous(), packed, absmax, code, blocksize, x.shape[-1])
    else:
        weight = dequantize_4bit_into(
            packed, absmax, code, blocksize, _scratch(out_features, x.shape[-1], x.dtype, x.device)
        )
        dx = torch.mm(dy, weight) if out is None else torch.mm(dy, weight, out=out)
    if lora_a.shape[0]:
        dx.addmm_(g, lora_a)
    return dx


@_lora_4bit_backward_inplace_op.register_fake
def _lora_4bit_backward_inplace_fake(
    grad_y, x, xa, packed, absmax, code, blocksize, lora_a, lora_b, scale, grad_a, grad_b
):
    return (
        torch.empty_like(lora_a) if grad_a else x.new_empty(0),
        torch.empty_like(lora_b) if grad_b else x.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, packed, absmax, code, blocksize, lora_a, lora_b, scale = inputs[:8]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], packed, absmax, code, lora_a, lora_b)
    ctx.blocksize, ctx.scale = blocksize, scale
    ctx.overwrite_input = len(inputs) > 8 and bool(inputs[8])


def _backward(ctx, grad_y, _grad_xa):
    need = ctx.needs_input_grad
    if need[2] or need[3]:
        raise RuntimeError("sloth::lora_linear_4bit: the 4-bit base weight is frozen; it has no gradient")
    dx, da, db = _input_grads(ctx, grad_y, need[0], need[5], need[6])
    return dx, None, None, None, None, da, db, None, None


def _input_grads(ctx, grad_y, need_x: bool, need_a: bool, need_b: bool):
    """``(dx, dA, dB)``, None where not needed, from ``ctx.saved_tensors`` = ``(x, xa, packed,
    absmax, code, A, B)``, ``ctx.blocksize``, ``ctx.scale`` and ``ctx.overwrite_input``."""
    x, xa, packed, absmax, code, lora_a, lora_b = ctx.saved_tensors
    if ctx.overwrite_input and need_x:
        da, db = call(
            _lora_4bit_backward_inplace_op,
            grad_y, x, xa, packed, absmax, code, ctx.blocksize, lora_a, lora_b, ctx.scale, need_a, need_b,
        )  # fmt: skip
        dx = x
    else:
        dx, da, db = call(
            _lora_4bit_backward_op,
            grad_y, x, xa, packed, absmax, code, ctx.blocksize, lora_a, lora_b, ctx.scale,
            need_x, need_a, need_b,
        )  # fmt: skip
    return dx if need_x else None, da if need_a else None, db if need_b else None


class UnreadSum4bit(torch.autograd.Function):
    """``residual + lora_linear_4bit(x, ...)`` when nothing reads the sum's values, only its
    gradients (a checkpointed layer's recompute, whose output only carries the backward): the
    forward keeps what the backward reads (x and ``xa = x A^T``) and skips the weight's decode and
    the base product, returning uninitialised memory; the backward is the op's (same products, same
    values), with the sum's gradient passed to ``residual`` too. As ``ops.lora.UnreadSum`` for 16-bit
    bases."""

    @staticmethod
    def forward(ctx, residual, x, packed, absmax, code, blocksize, lora_a, lora_b, scale, overwrite_input):
        xa = x.reshape(-1, x.shape[-1]) @ lora_a.t()
        ctx.save_for_backward(x, xa, packed, absmax, code, lora_a, lora_b)
        ctx.blocksize, ctx.scale, ctx.overwrite_input = blocksize, scale, overwrite_input
        # The sum's dtype, as ``residual + y`` promotes (a float32 residual stream under autocast).
        return residual.new_empty(residual.shape, dtype=torch.promote_types(residual.dtype, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0]
        grad_y = grad if grad.dtype == x.dtype else grad.to(x.dtype)  # y's gradient in y's dtype
        need = ctx.needs_input_grad
        if need[2] or need[3]:
            raise RuntimeError("sloth::lora_linear_4bit: the 4-bit base weight is frozen; it has no gradient")
        dx, da, db = _input_grads(ctx, grad_y, need[1], need[6], need[7])
        return grad if need[0] else None, dx, None, None, None, None, da, db, None, None


register_autograd(_lora_4bit_op, _backward, _setup_context)


def _forward_flops(
    x_shape, packed, absmax, code, blocksize, a_shape, b_shape, scale, overwrite_input=False, out_shape=None
) -> int:
    n_rows, in_features = math.prod(x_shape[:-1]), x_shape[-1]
    out_features, rank = b_shape
    dequant = in_features * out_features
    return 2 * n_rows * (in_features * out_features + in_features * rank + rank * out_features) + dequant


def _backward_flops(
    grad_y, x_shape, xa_shape, packed, absmax, code, blocksize, a_shape, b_shape, scale,
    grad_x, grad_a, grad_b, out_shape=None,
) -> int:  # fmt: skip
    n_rows, in_features = xa_shape[0], x_shape[-1]
    out_features, rank = b_shape
    flops = 2 * n_rows * out_features * rank if (grad_x or grad_a) else 0
    if grad_x:
        flops += 2 * n_rows * (out_features * in_features + rank * in_features) + in_features * out_features
    if grad_a:
        flops += 2 * n_rows * rank * in_features
    if grad_b:
        flops += 2 * n_rows * out_features * rank
    return flops


register_flops(_lora_4bit_op, _forward_flops)
register_flops(_lora_4bit_backward_op, _backward_flops)
register_flops(
    _lora_4bit_backward_inplace_op,
    lambda grad_y, x_shape, xa_shape, packed, absmax, code, blocksize, a_shape, b_shape, scale, grad_a, grad_b, out_shape=None: (
        _backward_flops(
            grad_y,
            x_shape,
            xa_shape,
            packed,
            absmax,
            code,
            blocksize,
            a_shape,
            b_shape,
            scale,
            True,
            grad_a,
            grad_b,
        )
    ),
)


def lora_linear_4bit(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    *,
    overwrite_input: bool = False,
    unread_sum_with: Tensor | None = None,
) -> Tensor:
    """``x @ W.T + scale * (x @ lora_a.T) @ lora_b.T`` with ``W`` the dequantised 4-bit weight.

    Args:
        x: ``[..., in]`` float16/bfloat16/float32 input; the product runs in its dtype.
        packed, absmax, code, blocksize: the frozen ``[out, in]`` weight's 4-bit storage (float32
            block scales; see :func:`dequantize_4bit`).
        lora_a: ``[r, in]`` adapter A in x's dtype (``r`` may be 0: no adapter).
        lora_b: ``[out, r]`` adapter B in x's dtype.
        scale: LoRA scaling.
        overwrite_input: The backward writes x's gradient into x's memory (saves one ``[..., in]``
            buffer at the backward's peak: the MLP's down projection's ``[tokens, intermediate]``).
            Only for an x that nothing reads after this layer (the activation's output).
        unread_sum_with: a residual ``[..., out]``: returns ``residual + y`` for a backward only, its
            values never computed (:class:`UnreadSum4bit`: no decode, no base product).

    Returns:
        ``[..., out]`` in x's dtype. Gradients flow to x, lora_a and lora_b.
    """
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"lora_linear_4bit computes in float16/bfloat16/float32, got x of dtype {x.dtype}")
    if (
        lora_a.dim() != 2
        or lora_b.dim() != 2
        or lora_a.shape[1] != x.shape[-1]
        or lora_b.shape[1] != lora_a.shape[0]
    ):
        raise ValueError(
            f"shapes do not fit a LoRA layer: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)} [r, in], "
            f"lora_b {tuple(lora_b.shape)} [out, r]"
        )
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise TypeError(
            f"x, lora_a and lora_b must share a dtype, got {x.dtype}, {lora_a.dtype}, {lora_b.dtype}"
        )
    _check_storage(packed, absmax, code, blocksize, lora_b.shape[0] * x.shape[-1])
    if len({x.device, packed.device, lora_a.device, lora_b.device}) > 1:
        raise ValueError(
            f"x ({x.device}), the 4-bit weight ({packed.device}) and the adapters ({lora_a.device}) must "
            "share a device"
        )
    if unread_sum_with is not None:
        if (
            unread_sum_with.shape != (*x.shape[:-1], lora_b.shape[0])
            or not unread_sum_with.is_floating_point()
        ):
            raise ValueError(
                f"unread_sum_with must be a floating [..., out] residual of shape {(*x.shape[:-1], lora_b.shape[0])}, "
                f"got {unread_sum_with.dtype} {tuple(unread_sum_with.shape)}"
            )
        args = (packed, absmax, code, int(blocksize), lora_a, lora_b, float(scale), overwrite_input)
        return UnreadSum4bit.apply(unread_sum_with, x, *args)
    y, _ = call(
        _lora_4bit_op, x, packed, absmax, code, int(blocksize), lora_a, lora_b, float(scale), overwrite_input
    )
    return y
