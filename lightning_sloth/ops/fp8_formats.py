"""FP8 storage with row-wise scales, and the plain-torch emulation every FP8 product is checked against.

A ``[rows, cols]`` tensor ``t`` is stored as FP8 codes ``q`` (``float8_e4m3fn`` or ``float8_e5m2``)
and one float32 scale per row::

    scale[i] = max_j |t[i, j]| / FMAX          (FMAX = 448 for e4m3, 57344 for e5m2; 1 for a zero row)
    q[i, j]  = fp8(clamp(t[i, j] / scale[i], -FMAX, FMAX))        round to nearest even, saturating
    t[i, j] ~= float32(q[i, j]) * scale[i]

Frozen base weights ``W [out, in]`` are stored this way once (one scale per output channel);
activations ``x [tokens, in]`` are quantised per row (per token) on the fly. The product is then::

    x W^T ~= (q_x s_x) (q_W s_W)^T = (q_x q_W^T) * s_x * s_W^T     (s_x [tokens, 1], s_W^T [1, out])

which is what ``torch._scaled_mm`` computes with row-wise scales (FP8 operands, float32
accumulation, the scales applied in the epilogue). The gradient of x, ``dy W``, contracts over the
output channels, where W's scales lie; they are folded into ``dy`` before it is quantised per row::

    dy W = (dy * s_W^T) q_W                     dy [tokens, out], q_W [out, in]

The functions here are the reference (quantise, dequantise, float32 matmul): exact and
deterministic on any device, and the oracle of ``sloth::linear_fp8``'s ``torch._scaled_mm`` path.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "FP8_DTYPES",
    "GRAD_FORMATS",
    "check_fp8_device",
    "check_grad_format",
    "dequantize_rows",
    "fp8_linear_grad_reference",
    "fp8_linear_reference",
    "fp8_supported",
    "quantize_rows",
]

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The two FP8 formats by name: e4m3 (more precision, max 448) and e5m2 (more range, max 57344)."""

GRAD_FORMATS = ("e4m3", "e5m2", "bf16")
"""How the incoming gradient meets the FP8 weight in the input-gradient product: quantised per row
to e4m3 or e5m2, or kept in the compute dtype against the weight dequantised to it (``bf16``)."""

MIN_FP8_CAPABILITY = (8, 9)
"""CUDA compute capability of the first FP8 tensor cores (Ada, sm89; Hopper is sm90)."""


def check_grad_format(grad_format: str) -> str:
    """``grad_format`` if it is one of :data:`GRAD_FORMATS`, else a ``ValueError``."""
    if grad_format not in GRAD_FORMATS:
        raise ValueError(f"FP8 gradient format must be one of {GRAD_FORMATS}, got {grad_format!r}")
    return grad_format


def fp8_supported(device: torch.device | str | int | None = None) -> bool:
    """Whether ``device`` (default: the current CUDA device) has FP8 tensor cores (sm89 or newer)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= MIN_FP8_CAPABILITY


def check_fp8_device(device: torch.device | str | None = None) -> None:
    """Raise a ``RuntimeError`` for a CUDA device without FP8 tensor cores (below sm89).

    CPU (and any non-CUDA device) passes: there the FP8 products run the plain-torch emulation of
    this module, for tests and references, not for speed.
    """
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return
    if not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"FP8 base weights need FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or newer); "
            f"{name} has compute capability {capability[0]}.{capability[1]}. Use bf16 base weights or "
            "quantize='nf4' on this GPU"
        )


def quantize_rows(t: Tensor, fmt: str = "e4m3") -> tuple[Tensor, Tensor]:
    """Quantise ``t [rows, cols]`` to FP8 with one float32 scale per row (see the module notes).

    Args:
        t: float16/bfloat16/float32/float64 ``[rows, cols]``.
        fmt: ``"e4m3"`` or ``"e5m2"``.

    Returns:
        ``(q, scale)``: ``q [rows, cols]`` in the FP8 dtype, ``scale [rows, 1]`` float32. A row of
        zeros gets scale 1 (codes 0); non-finite values raise.
    """
    if fmt not in FP8_DTYPES:
        raise ValueError(f"FP8 format must be one of {tuple(FP8_DTYPES)}, got {fmt!r}")
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(
            f"quantize_rows takes a floating-point [rows, cols] tensor, got {t.dtype} {tuple(t.shape)}"
        )
    dtype = FP8_DTYPES[fmt]
    fmax = torch.finfo(dtype).max
    t32 = t.float()
    amax = t32.abs().amax(dim=1, keepdim=True)
    # A tensor divisor: torch on CUDA multiplies by the reciprocal of a Python-number divisor, which
    # is not the IEEE quotient (one ulp off for some rows); tensor / tensor divides on every device.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, fmax), torch.ones_like(amax))
    q = (t32 / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``float32(q) * scale`` rounded once to ``dtype``: the ``[rows, cols]`` values the codes stand for."""
    return (q.float() * scale).to(dtype)


def fp8_linear_reference(x: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """``x W^T`` as the FP8 GEMM computes it, emulated: x quantised per row to e4m3, float32 product.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32.
        weight: ``[N, K]`` ``float8_e4m3fn`` codes of W.
        weight_scale: ``[N, 1]`` float32 scales of W's rows.

    Returns:
        ``[M, N]`` in x's dtype (float32 accumulation, one rounding at the end).
    """
    qx, sx = quantize_rows(x, "e4m3")
    return (dequantize_rows(qx, sx) @ dequantize_rows(weight, weight_scale).t()).to(x.dtype)


def fp8_linear_grad_reference(dy: Tensor, weight: Tensor, weight_scale: Tensor, grad_format: str) -> Tensor:
    """``dy W`` (the input gradient of ``x W^T``) as the FP8 path computes it, emulated.

    Args:
        dy: ``[M, N]`` incoming gradient (float16/bfloat16/float32).
        weight, weight_scale: W's ``[N, K]`` e4m3 codes and ``[N, 1]`` float32 scales.
        grad_format: ``"e4m3"`` / ``"e5m2"``: ``dy * s_W^T`` quantised per row to that format, float32
            product with the codes; ``"bf16"``: ``dy`` against W dequantised to dy's dtype, in that
            dtype (a plain 16-bit GEMM).

    Returns:
        ``[M, K]`` in dy's dtype.
    """
    if check_grad_format(grad_format) == "bf16":
        return dy @ dequantize_rows(weight, weight_scale, dy.dtype)
    qg, sg = quantize_rows(dy.float() * weight_scale.t(), grad_format)
    return (dequantize_rows(qg, sg) @ weight.float()).to(dy.dtype)
