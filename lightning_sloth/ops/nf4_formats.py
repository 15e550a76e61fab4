"""4-bit storage formats (NF4, FP4, NF4 with double-quantised scales), laid out as bitsandbytes lays them.

A weight of ``n`` elements (row-major) becomes::

    packed   uint8 [ceil(n / 2), 1]   two 4-bit codes per byte, the even element in the high nibble
    absmax   float32 [ceil(n / 64)]   max |w| of each block of 64 elements
    code     float32 [16]             the code book: w ~ code[q] * absmax[block]

With double quantisation (``nf4-dq``) the block scales are stored in 8 bits as well::

    absmax         uint8 [blocks]            8-bit codes of (absmax - offset)
    nested_absmax  float32 [ceil(blocks / 256)]
    nested_code    float32 [256]             signed dynamic (exponent + fraction) 8-bit code
    offset         float32 []                mean of the block scales
    absmax[j] = nested_code[q_j] * nested_absmax[j // 256] + offset   (product, then sum: two roundings)

so a weight quantised by ``bitsandbytes.functional.quantize_4bit`` is read here bit for bit, and
ours by ``bitsandbytes.functional.dequantize_4bit`` (:func:`to_bnb` / :func:`from_bnb` convert the
scale bookkeeping; the tensors are shared, not copied). Everything here is plain torch and runs on
any device; the CUDA dequantisation kernel is ``lightning_sloth.kernels.nf4``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch
from torch import Tensor

QuantType = Literal["nf4", "nf4-dq", "fp4"]
QUANT_TYPES: tuple[str, ...] = get_args(QuantType)
BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256

# NF4: quantiles of a standard normal scaled to [-1, 1], with an exact zero (the QLoRA paper's
# values, as float32). FP4: sign, two exponent bits, one mantissa bit, in bitsandbytes' index order;
# code 8 is a negative zero, as bitsandbytes' CPU and CUDA kernels decode it.
_CODE_BOOKS = {
    "nf4": (
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ),
    "fp4": (
        0.0, 0.0052083334885537624, 0.6666666865348816, 1.0,
        0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
        -0.0, -0.0052083334885537624, -0.6666666865348816, -1.0,
        -0.3333333432674408, -0.5, -0.1666666716337204, -0.25,
    ),
}  # fmt: skip


def base_format(quant_type: str) -> str:
    """The 4-bit code book of a quantisation type (``"nf4-dq"`` -> ``"nf4"``)."""
    check_quant_type(quant_type)
    return quant_type.removesuffix("-dq")


def check_quant_type(quant_type: Any) -> str:
    """``quant_type`` if it is one of :data:`QUANT_TYPES`, else a ``ValueError`` naming them."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"unknown 4-bit quantisation {quant_type!r}; choose one of {QUANT_TYPES}")
    return quant_type


@functools.cache
def _code_book_cpu(name: str) -> Tensor:
    return torch.tensor(_CODE_BOOKS[name], dtype=torch.float32)


def code_book(quant_type: str, device: torch.device | str = "cpu") -> Tensor:
    """The float32 ``[16]`` code book of ``quant_type`` on ``device`` (a fresh tensor: a layer's copy
    is loaded into in place, which must never reach the shared one)."""
    return _code_book_cpu(base_format(quant_type)).to(device, copy=True)


@functools.cache
def dynamic_code() -> Tensor:
    """The signed dynamic 8-bit code (256 float32 values, sorted) that holds double-quantised scales.

    Sign, then a run of zero bits giving a power of ten from 1e-6 to 1, then a linear fraction in
    [0.1, 1] filling the bits left; plus 0 and 1. Dettmers, "8-Bit Approximations for Parallelism
    in Deep Learning" (2016).
    """
    values: list[float] = []
    exponents = 7
    for i in range(exponents):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0
        magnitude = 10 ** (-(exponents - 1) + i)
        values += (magnitude * centres).tolist()
        values += (-magnitude * centres).tolist()
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass(frozen=True)
class Packed4bit:
    """One weight in 4-bit storage (see the module docstring for the layout).

    Attributes:
        packed: ``uint8 [ceil(n / 2), 1]``.
        absmax: float32 ``[blocks]``, or uint8 ``[blocks]`` with double quantisation.
        code: float32 ``[16]`` code book.
        shape: the weight's shape (``[out, in]`` for a linear layer).
        dtype: the dtype the weight had before quantisation.
        quant_type: ``"nf4"``, ``"nf4-dq"`` or ``"fp4"``.
        blocksize: elements per block (64 here; bitsandbytes weights may use another power of two).
        nested_absmax, nested_code, offset: the second level of ``nf4-dq`` (None otherwise).
    """

    packed: Tensor
    absmax: Tensor
    code: Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant_type: str
    blocksize: int = BLOCKSIZE
    nested_absmax: Tensor | None = None
    nested_code: Tensor | None = None
    offset: Tensor | None = None

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def block_absmax(self) -> Tensor:
        """The float32 block scales (the double-quantised ones decoded as bitsandbytes decodes them)."""
        if not self.nested:
            return self.absmax
        blocks = self.absmax.numel()
        scale = self.nested_absmax.repeat_interleave(NESTED_BLOCKSIZE)[:blocks]
        absmax = self.nested_code[self.absmax.long()] * scale
        return absmax + self.offset

    def to(self, device: torch.device | str) -> Packed4bit:
        """The same storage on ``device``."""
        moved = {
            k: getattr(self, k).to(device)
            for k in ("packed", "absmax", "code", "nested_absmax", "nested_code", "offset")
            if getattr(self, k) is not None
        }
        return replace(self, **moved)

    def nbytes(self) -> int:
        """Bytes of device memory the storage takes."""
        tensors = (self.packed, self.absmax, self.code, self.nested_absmax, self.nested_code, self.offset)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _nearest(values: Tensor, code: Tensor) -> Tensor:
    """Index into ``code`` of the nearest entry to each of ``values`` (ties go to the lower entry)."""
    order = torch.argsort(code, stable=True)
    ordered = code[order]
    bounds = (ordered[:-1] + ordered[1:]) / 2
    return order[torch.bucketize(values, bounds)]


def _blockwise(flat: Tensor, blocksize: int) -> tuple[Tensor, Tensor]:
    """(``flat`` scaled to [-1, 1] per block, the float32 block absmax); ``flat`` is float32."""
    n = flat.numel()
    blocks = -(-n // blocksize)
    padded = torch.nn.functional.pad(flat, (0, blocks * blocksize - n)).view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    scaled = padded * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)
    return scaled.clamp(-1, 1).reshape(-1)[:n], absmax


@torch.no_grad()
def quantize_4bit(weight: Tensor, quant_type: str = "nf4", blocksize: int = BLOCKSIZE) -> Packed4bit:
    """Quantise ``weight`` (float16/bfloat16/float32, any device) to 4-bit storage, in plain torch.

    Each block of ``blocksize`` elements is divided by its max ``|w|`` and every value mapped to the
    nearest code (ties to the lower code). Works in float32 chunks of at most 2**26 elements, so a
    large weight needs little scratch memory.

    Args:
        weight: the weight; its shape and dtype are recorded.
        quant_type: ``"nf4"``, ``"nf4-dq"`` (NF4 with 8-bit block scales) or ``"fp4"``.
        blocksize: elements per block (a power of two from 32 to 4096).

    Returns:
        The :class:`Packed4bit` storage on ``weight``'s device.
    """
    check_quant_type(quant_type)
    if not weight.is_floating_point() or weight.dtype == torch.float64:
        raise TypeError(f"4-bit quantisation takes float16/bfloat16/float32 weights, got {weight.dtype}")
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"blocksize must be a power of two from 32 to 4096, got {blocksize}")
    code = code_book(quant_type, weight.device)
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    chunk = max(blocksize, (1 << 26) // blocksize * blocksize)
    packed, absmax = [], []
    for start in range(0, n, chunk):
        scaled, scales = _blockwise(flat[start : start + chunk].float(), blocksize)
        if scaled.numel() % 2:  # the unused low nibble of the last byte holds the code of 0
            scaled = torch.nn.functional.pad(scaled, (0, 1))
        q = _nearest(scaled, code).to(torch.uint8)
        packed.append((q[0::2] << 4) | q[1::2])
        absmax.append(scales)
    packed_t = torch.cat(packed).unsqueeze(1)
    absmax_t = torch.cat(absmax)
    out = Packed4bit(packed_t, absmax_t, code, tuple(weight.shape), weight.dtype, quant_type, blocksize)
    return _double_quantize(out) if quant_type.endswith("-dq") else out


def _double_quantize(q: Packed4bit) -> Packed4bit:
    offset = q.absmax.mean()
    nested_code = dynamic_code().to(q.absmax.device, copy=True)
    scaled, nested_absmax = _blockwise(q.absmax - offset, NESTED_BLOCKSIZE)
    codes = _nearest(scaled, nested_code).to(torch.uint8)
    return replace(q, absmax=codes, nested_absmax=nested_absmax, nested_code=nested_code, offset=offset)


def dequantize_4bit_reference(q: Packed4bit, dtype: torch.dtype | None = None) -> Tensor:
    """The weight in ``dtype`` (default: its original dtype): ``code[q] * absmax`` in float32, rounded once."""
    n = q.numel
    packed = q.packed.reshape(-1)
    codes = torch.stack(((packed >> 4), (packed & 15)), dim=1).reshape(-1)[:n].long()
    absmax = q.block_absmax().repeat_interleave(q.blocksize)[:n]
    return (q.code[codes] * absmax).view(q.shape).to(dtype or q.dtype)


# ---------------------------------------------------------------------------------- bitsandbytes
def to_bnb(q: Packed4bit) -> tuple[Tensor, Any]:
    """``(packed, bitsandbytes.functional.QuantState)`` over the same tensors (needs bitsandbytes)."""
    from bitsandbytes.functional import QuantState

    state2 = None
    if q.nested:
        state2 = QuantState(
            absmax=q.nested_absmax, code=q.nested_code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32
        )
    state = QuantState(
        absmax=q.absmax,
        shape=torch.Size(q.shape),
        code=q.code,
        blocksize=q.blocksize,
        quant_type=base_format(q.quant_type),
        dtype=q.dtype,
        offset=q.offset,
        state2=state2,
    )
    return q.packed, state


def from_bnb(packed: Tensor, state: Any) -> Packed4bit:
    """The :class:`Packed4bit` of a bitsandbytes weight (``Params4bit`` data and its ``quant_state``).

    Shares the tensors; nothing is re-quantised.
    """
    if state.quant_type not in ("nf4", "fp4"):
        raise ValueError(f"bitsandbytes quant_type {state.quant_type!r} is not a 4-bit format read here")
    nested = bool(getattr(state, "nested", False))
    if nested and state.quant_type != "nf4":
        raise NotImplementedError("double-quantised FP4 (fp4 with nested scales) is not supported")
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    return Packed4bit(
        packed=packed,
        absmax=state.absmax,
        code=state.code.float(),
        shape=tuple(state.shape),
        dtype=state.dtype,
        quant_type=state.quant_type + ("-dq" if nested else ""),
        blocksize=int(state.blocksize),
        nested_absmax=state.state2.absmax if nested else None,
        nested_code=state.state2.code if nested else None,
        offset=state.offset if nested else None,
    )
