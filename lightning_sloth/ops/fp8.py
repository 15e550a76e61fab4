"""FP8 frozen-base products as ops: ``sloth::linear_fp8`` (``x W^T``) and its input gradient
``sloth::linear_fp8_grad`` (``dy W``), W stored in e4m3 with one float32 scale per output channel.

::

    forward   q_x, s_x = rowwise_e4m3(x)                       x [M, K] -> codes, s_x [M, 1]
              y = _scaled_mm(q_x, q_W^T, s_x, s_W^T)           bf16 [M, N]
    backward  e4m3 / e5m2:  q_g, s_g = rowwise(dy * s_W^T)      W's scales folded into dy's columns
                            dx = _scaled_mm(q_g, q_W, s_g, 1)
              bf16:         dx = dy @ bf16(q_W * s_W)           a 16-bit GEMM on the dequantised weight

The ops take W's codes as ``uint8`` (the e4m3 bits; viewed back inside): the op checks of
``torch.library`` compare their arguments with arithmetic CPU float8 tensors do not have.

``sloth::linear_4bit_fp8`` (and its ``_grad``) computes the same products for a weight stored in
4 bits (QLoRA): each call decodes it to bfloat16 in the 4-bit ops' reused buffer and quantises it per
row to e4m3 first, so the memory stays that of the 4-bit weights.

Only the input gradient exists: the weight is frozen (LoRA trains beside it, in the compute dtype).
Saved for the backward: the FP8 weight and its scales (module state, nothing new per call).

The per-row quantisation is one Triton kernel on CUDA (``lightning_sloth.kernels.fp8``: amax, scale
and codes from one read of the input, W's scales multiplied in for the gradient), bit-identical to
the plain-torch :func:`~lightning_sloth.ops.fp8_formats.quantize_rows`.

Where the FP8 GEMM runs: CUDA devices with FP8 tensor cores (sm89+), bfloat16 activations, ``K`` and
``N`` multiples of 16 (``torch._scaled_mm``'s layout rule; every transformer projection meets it).
Everywhere else (CPU, float32, odd shapes) the body is the plain-torch emulation of
:mod:`lightning_sloth.ops.fp8_formats` (quantise, dequantise, float32 matmul), which is also the
oracle of the GPU path: the two differ only in float32 accumulation order and the final rounding.

Accumulation: ``torch._scaled_mm`` runs with ``use_fast_accum`` (:data:`FAST_ACCUM`, on by default;
``SlothPrecision(..., fp8_fast_accum=False)`` or ``precision.fp8_fast_accum=false`` turn it off):
Hopper's FP8 tensor cores then keep their own accumulator across the whole K loop instead of
promoting the partial sums to float32 every few steps. Measured on the Llama-3.1-8B projections
(``benchmarks/results/fp8_accum_h200.json``) it runs 6-21% faster and moves the product by 2-3e-3
(relative, against the exact product of the same FP8 operands; 1.7e-3 without it), against the
0.037 that the e4m3 rounding of the operands itself costs. Like ``torch.backends.cuda.matmul``'s
switches it holds for the whole process.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_sloth.ops.fp8_formats import (
    FP8_DTYPES,
    check_grad_format,
    dequantize_rows,
    fp8_linear_grad_reference,
    fp8_linear_reference,
    fp8_supported,
    quantize_rows,
)
from lightning_sloth.ops.nf4 import _check_storage, _scratch, dequantize_4bit_into
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
    from lightning_sloth.kernels import fp8 as _kernels

__all__ = [
    "E4M3",
    "FAST_ACCUM",
    "check_fp8_operands",
    "fp8_from_4bit",
    "fp8_grad_product",
    "fp8_grad_product_4bit",
    "fp8_product",
    "linear_4bit_fp8",
    "linear_fp8",
    "linear_fp8_grad",
    "quantize_activation",
    "scaled_mm",
    "scaled_mm_applies",
]

E4M3 = FP8_DTYPES["e4m3"]

FAST_ACCUM = True
"""``use_fast_accum`` of every FP8 product (see the module notes); read at each call."""


def scaled_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``torch._scaled_mm`` with row-wise scales and the process's :data:`FAST_ACCUM`, into ``out``
    where given."""
    into = {} if out is None else {"out": out}
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=FAST_ACCUM, **into
    )


@functools.cache
def _device_has_fp8(index: int) -> bool:
    return fp8_supported(index)


def scaled_mm_applies(x: Tensor, n: int) -> bool:
    """Whether the product of ``x [M, K]`` with an ``[n, K]`` FP8 weight runs ``torch._scaled_mm``
    (CUDA with FP8 tensor cores, bfloat16, ``K`` and ``n`` multiples of 16), not the emulation."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and x.shape[-1] % 16 == 0
        and n % 16 == 0
        and _device_has_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())
    )


def _unit_scales(k, device: torch.device, rows=1) -> Tensor:
    """``[rows, k]`` float32 ones: the input gradient's scales for W's side (W's own are folded into
    dy; ``rows``: one row per expert of a grouped weight), made once per shape and device rather
    than on every backward call. While tracing (``torch.compile`` decomposes the op and runs its body
    on fake tensors; opcheck, ``make_fx``) a fresh tensor: a cached real tensor must not enter a fake
    trace, nor a fake one the cache (a symbolic size, from dynamic shapes, has no hash either)."""
    if isinstance(k, int) and isinstance(rows, int) and not tracing():
        return _cached_unit_scales(k, device, rows)
    return torch.ones(rows, k, dtype=torch.float32, device=device)


@functools.cache
def _cached_unit_scales(k: int, device: torch.device, rows: int = 1) -> Tensor:
    return torch.ones(rows, k, dtype=torch.float32, device=device)


def quantize_activation(t: Tensor, fmt: str, col_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Row-wise codes and scales of ``t`` (times ``col_scale [K]`` per column): the kernel on CUDA."""
    if use_triton(t):
        return _kernels.quantize_rows(t, FP8_DTYPES[fmt], col_scale)
    return quantize_rows(t.float() * col_scale if col_scale is not None else t, fmt)


def fp8_product(x: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """``x W^T`` for e4m3 ``W`` and its ``[N, 1]`` scales: ``_scaled_mm`` where it applies, else the emulation."""
    if scaled_mm_applies(x, weight.shape[0]):
        qx, sx = quantize_activation(x, "e4m3")
        return scaled_mm(qx, weight.t(), sx, weight_scale.t(), x.dtype)
    return fp8_linear_reference(x, weight, weight_scale)


def _grad_runs_scaled_mm(dy: Tensor, weight: Tensor, grad_format: str) -> bool:
    return grad_format != "bf16" and scaled_mm_applies(dy, weight.shape[1]) and weight.shape[0] % 16 == 0


def _grad_scaled_mm(dy: Tensor, w_col: Tensor, weight_scale: Tensor, grad_format: str, out: Tensor | None):
    """``dy W`` on the FP8 tensor cores, ``w_col`` W's codes column-major (``[N, K]``, a transposed
    copy's view): dy quantised per row with W's scales folded into its columns."""
    qg, sg = quantize_activation(dy, grad_format, weight_scale.view(-1))
    ones = _unit_scales(w_col.shape[1], dy.device)
    return scaled_mm(qg, w_col, sg, ones, dy.dtype, out)


def fp8_grad_product(
    dy: Tensor, weight: Tensor, weight_scale: Tensor, grad_format: str, out: Tensor | None = None
) -> Tensor:
    """``dy W`` for e4m3 ``W`` (see the module notes); written into ``out`` (``[M, K]``, dy's dtype,
    contiguous) where given, and returned."""
    if _grad_runs_scaled_mm(dy, weight, grad_format):
        # _scaled_mm wants its second operand column-major: a transposed copy of the codes (N*K bytes),
        # made in tiles (torch's strided copy of one-byte elements runs at a fraction of the bandwidth).
        return _grad_scaled_mm(dy, _kernels.transpose_bytes(weight).t(), weight_scale, grad_format, out)
    if grad_format == "bf16" and dy.device.type == "cuda":
        weight = dequantize_rows(weight, weight_scale, dy.dtype)
        return torch.mm(dy, weight) if out is None else torch.mm(dy, weight, out=out)
    dx = fp8_linear_grad_reference(dy, weight, weight_scale, grad_format)
    return dx if out is None else out.copy_(dx)


def fp8_grad_product_4bit(
    dy: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    k: int,
    grad_format: str,
    out: Tensor | None = None,
) -> Tensor:
    """:func:`fp8_grad_product` for a 4-bit ``W [N, k]`` (``N = dy.shape[1]``), decoded and quantised
    to e4m3 as :func:`fp8_from_4bit` does. On the FP8 tensor cores the row-major codes are let go
    once their transposed copy is made, before dy is quantised: the two copies of the codes and dy's
    are never alive at once (one ``N * k``-byte buffer less at the op's peak)."""
    codes, scale = fp8_from_4bit(packed, absmax, code, blocksize, (dy.shape[1], k))
    if _grad_runs_scaled_mm(dy, codes, grad_format):
        w_col = _kernels.transpose_bytes(codes).t()
        del codes
        return _grad_scaled_mm(dy, w_col, scale, grad_format, out)
    return fp8_grad_product(dy, codes, scale, grad_format, out)


@sloth_op("linear_fp8")
def _linear_op(x: Tensor, weight_bits: Tensor, weight_scale: Tensor, grad_format: str) -> Tensor:
    """``x [M, K] @ W^T`` for the e4m3 ``W [N, K]`` (its bits, uint8) with scales ``[N, 1]``;
    ``grad_format`` is for the backward."""
    return fp8_product(x, weight_bits.view(E4M3), weight_scale)


@_linear_op.register_fake
def _linear_fake(x, weight, weight_scale, grad_format):
    return x.new_empty((x.shape[0], weight.shape[0]))


@sloth_op("linear_fp8_grad")
def _grad_op(dy: Tensor, weight_bits: Tensor, weight_scale: Tensor, grad_format: str) -> Tensor:
    """``dy [M, N] @ W`` for the e4m3 ``W [N, K]`` (its bits, uint8): the input gradient (see the module notes)."""
    return fp8_grad_product(dy, weight_bits.view(E4M3), weight_scale, grad_format)


@_grad_op.register_fake
def _grad_fake(dy, weight, weight_scale, grad_format):
    return dy.new_empty((dy.shape[0], weight.shape[1]))


def _setup_context(ctx, inputs, output):
    x, weight, weight_scale, grad_format = inputs
    ctx.save_for_backward(weight, weight_scale)
    ctx.grad_format = grad_format


def _backward(ctx, grad_y):
    weight, weight_scale = ctx.saved_tensors
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("sloth::linear_fp8: the FP8 base weight is frozen; it has no gradient")
    dx = call(_grad_op, grad_y.contiguous(), weight, weight_scale, ctx.grad_format)
    return dx, None, None, None


register_autograd(_linear_op, _backward, _setup_context)
register_flops(_linear_op, lambda x, w, s, fmt, out_shape=None: 2 * x[0] * x[1] * w[0])
register_flops(_grad_op, lambda dy, w, s, fmt, out_shape=None: 2 * dy[0] * dy[1] * w[1])


def check_fp8_operands(x: Tensor, weight: Tensor, weight_scale: Tensor, name: str) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name} computes in float16/bfloat16/float32, got {x.dtype}")
    if weight.dtype != E4M3 or weight.dim() != 2:
        raise TypeError(
            f"{name}: the weight must be [out, in] float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}"
        )
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (weight.shape[0], 1):
        raise ValueError(
            f"{name}: weight_scale must be float32 [{weight.shape[0]}, 1] (one per output channel), "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if len({x.device, weight.device, weight_scale.device}) > 1:
        raise ValueError(f"{name}: x ({x.device}) and the FP8 weight ({weight.device}) must share a device")


def linear_fp8(x: Tensor, weight: Tensor, weight_scale: Tensor, grad_format: str = "e4m3") -> Tensor:
    """``x @ W.T`` for the frozen FP8 weight ``W``, x quantised per row to e4m3 on the fly.

    Args:
        x: ``[..., in]`` float16/bfloat16/float32 (the FP8 GEMM runs for bfloat16 on sm89+ CUDA).
        weight: ``[out, in]`` ``float8_e4m3fn`` codes.
        weight_scale: ``[out, 1]`` float32 per-output-channel scales.
        grad_format: how the input gradient is computed: ``"e4m3"``, ``"e5m2"`` or ``"bf16"``
            (see :data:`~lightning_sloth.ops.fp8_formats.GRAD_FORMATS`).

    Returns:
        ``[..., out]`` in x's dtype; the gradient flows to x only.
    """
    check_fp8_operands(x, weight, weight_scale, "linear_fp8")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear_fp8: x {tuple(x.shape)} does not fit the weight {tuple(weight.shape)} [out, in]"
        )
    rows = x.reshape(-1, x.shape[-1])
    y = call(_linear_op, rows, weight.view(torch.uint8), weight_scale, check_grad_format(grad_format))
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_fp8_grad(dy: Tensor, weight: Tensor, weight_scale: Tensor, grad_format: str = "e4m3") -> Tensor:
    """``dy @ W``: the input gradient of :func:`linear_fp8` for ``dy [..., out]``, as ``[..., in]``."""
    check_fp8_operands(dy, weight, weight_scale, "linear_fp8_grad")
    if weight.shape[0] != dy.shape[-1]:
        raise ValueError(
            f"linear_fp8_grad: dy {tuple(dy.shape)} does not fit the weight {tuple(weight.shape)}"
        )
    rows = dy.reshape(-1, dy.shape[-1])
    dx = call(
        _grad_op, rows.contiguous(), weight.view(torch.uint8), weight_scale, check_grad_format(grad_format)
    )
    return dx.view(*dy.shape[:-1], weight.shape[1])


# ------------------------------------------------------------------ 4-bit storage, FP8 compute
def fp8_from_4bit(
    packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, shape: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """The e4m3 codes ``[N, K]`` and ``[N, 1]`` scales of a 4-bit weight: decoded to bfloat16 (into the
    4-bit ops' reused buffer, exactly as ``sloth::lora_linear_4bit`` decodes it), then quantised per row.
    Plain torch off CUDA with the same arithmetic, so both give the same codes."""
    n, k = shape
    dense = dequantize_4bit_into(
        packed, absmax, code, blocksize, _scratch(n, k, torch.bfloat16, packed.device)
    )
    return quantize_activation(dense, "e4m3")


@sloth_op("linear_4bit_fp8")
def _linear_4bit_op(
    x: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, n: int, grad_format: str
) -> Tensor:
    """``x [M, K] @ W^T`` for the 4-bit ``W [n, K]``, computed in FP8 (see :func:`linear_4bit_fp8`)."""
    if x.shape[0] == 0:  # nothing to multiply: no weight decoded
        return x.new_zeros(0, n)
    return fp8_product(x, *fp8_from_4bit(packed, absmax, code, blocksize, (n, x.shape[1])))


@_linear_4bit_op.register_fake
def _linear_4bit_fake(x, packed, absmax, code, blocksize, n, grad_format):
    return x.new_empty((x.shape[0], n))


@sloth_op("linear_4bit_fp8_grad")
def _grad_4bit_op(
    dy: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, k: int, grad_format: str
) -> Tensor:
    """``dy [M, N] @ W`` for the 4-bit ``W [N, k]``, computed in FP8 (``grad_format`` for dy)."""
    return fp8_grad_product_4bit(dy, packed, absmax, code, blocksize, k, grad_format)


@_grad_4bit_op.register_fake
def _grad_4bit_fake(dy, packed, absmax, code, blocksize, k, grad_format):
    return dy.new_empty((dy.shape[0], k))


def _setup_4bit(ctx, inputs, output):
    x, packed, absmax, code, blocksize, n, grad_format = inputs
    ctx.save_for_backward(packed, absmax, code)
    ctx.blocksize, ctx.k, ctx.grad_format = blocksize, x.shape[1], grad_format


def _backward_4bit(ctx, grad_y):
    packed, absmax, code = ctx.saved_tensors
    if any(ctx.needs_input_grad[1:4]):
        raise RuntimeError("sloth::linear_4bit_fp8: the 4-bit base weight is frozen; it has no gradient")
    dx = call(_grad_4bit_op, grad_y.contiguous(), packed, absmax, code, ctx.blocksize, ctx.k, ctx.grad_format)
    return dx, None, None, None, None, None, None


register_autograd(_linear_4bit_op, _backward_4bit, _setup_4bit)
register_flops(_linear_4bit_op, lambda x, p, a, c, b, n, fmt, out_shape=None: 2 * x[0] * x[1] * n + x[1] * n)
register_flops(
    _grad_4bit_op, lambda dy, p, a, c, b, k, fmt, out_shape=None: 2 * dy[0] * dy[1] * k + dy[1] * k
)


def linear_4bit_fp8(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    blocksize: int,
    out_features: int,
    grad_format: str = "e4m3",
) -> Tensor:
    """``x @ W.T`` for a frozen 4-bit ``W [out, in]`` (QLoRA storage) computed on FP8 tensor cores.

    Each call decodes W to bfloat16 in a reused buffer and quantises it per output channel to e4m3
    (:func:`fp8_from_4bit`); x is quantised per row, and the product is :func:`linear_fp8`'s. The
    backward decodes again (nothing dense is kept) and computes ``dy W`` in ``grad_format``. The
    weight stays in 4 bits: memory as with ``sloth::lora_linear_4bit``.

    Args:
        x: ``[..., in]`` float16/bfloat16/float32.
        packed, absmax, code, blocksize: W's 4-bit storage (float32 block scales, see
            ``lightning_sloth.ops.nf4.dequantize_4bit``).
        out_features: rows of W.
        grad_format: ``"e4m3"``, ``"e5m2"`` or ``"bf16"``.

    Returns:
        ``[..., out_features]`` in x's dtype; the gradient flows to x only.
    """
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"linear_4bit_fp8 computes in float16/bfloat16/float32, got {x.dtype}")
    _check_storage(packed, absmax, code, blocksize, out_features * x.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    y = call(
        _linear_4bit_op,
        rows,
        packed,
        absmax,
        code,
        int(blocksize),
        int(out_features),
        check_grad_format(grad_format),
    )
    return y.view(*x.shape[:-1], out_features)
