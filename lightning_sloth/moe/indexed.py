"""Grouped GEMMs whose rows are read and written through the routing permutation, on both paths.

The building blocks of :mod:`.fused`: each function runs the Triton kernel of
``lightning_sloth.kernels.moe_fused`` on CUDA float16/bfloat16/float32 (and, under
``TRITON_INTERPRET=1``, on CPU float32/float16) and otherwise a plain-torch reference that makes the
gathered copy the kernel avoids (``index_select``, the per-expert loop of :mod:`.gemm`, a weighted
sum). Rows are in expert order; ``perm[s]`` is the slot ``t * k + j`` of sorted row s.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from lightning_sloth.moe.gemm import _mm, _mm_into, _weight_grad, grouped_mm_reference
from lightning_sloth.moe.ops import _combine_weight_grad, _gather_sum, _rows
from lightning_sloth.moe.quant import _weight as _dequantized
from lightning_sloth.moe.routing import inverse_permutation
from lightning_sloth.ops.registry import TRITON_OPS, use_triton

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if TRITON_OPS or _INTERPRETED:
    from lightning_sloth.kernels import moe_fused as _kernels
    from lightning_sloth.kernels import moe_lora_pair as _pair_kernels

__all__ = [
    "GATHERED_ROWS_GROUPED_MM",
    "GROUPED_MM_CHOICES",
    "LORA_GRAD_PAIR",
    "ORDERED_ROWS_GROUPED_MM",
    "bias_grad",
    "down_in_kernel",
    "expert_weight",
    "gathered_grouped_mm",
    "gathered_rows",
    "grouped_mm_choice",
    "indexed_grouped_mm",
    "indexed_lora_grouped_mm",
    "indexed_weight_grad",
    "lora_grad_pair",
    "lora_input_grad",
    "ordered_grouped_mm",
    "ordered_input_grad_sum",
    "ordered_rows_dot",
    "ordered_rows_sum",
    "slot_dot",
    "slot_sum",
    "use_kernels",
]


def use_kernels(t: Tensor) -> bool:
    """Whether ``t`` goes to the Triton kernels: CUDA 16/32-bit floats, or float32/float16 under the interpreter."""
    return use_triton(t) or (_INTERPRETED and t.dtype in (torch.float32, torch.float16))


def expert_weight(weight: Tensor, absmax: Tensor | None, code: Tensor | None, blocksize: int, shape, dtype):
    """The ``[E, ., .]`` expert weight in ``dtype``: the dense weight, or the 4-bit storage (``absmax``
    given) dequantised into the reusable buffer of :mod:`.quant`."""
    if absmax is None:
        return weight.to(dtype)
    return _dequantized(weight, absmax, code, blocksize, shape, dtype)


# --------------------------------------------------------------------- indexed GEMM, both paths
def indexed_grouped_mm(
    x: Tensor,
    w: Tensor,
    ends: Tensor,
    w_is_kn: bool,
    *,
    a_idx: Tensor | None = None,
    div: int = 1,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    expert_ids: Tensor | None = None,
    out: Tensor | None = None,
    out_idx: Tensor | None = None,
    x2: Tensor | None = None,
    w2: Tensor | None = None,
    w2_is_kn: bool = False,
) -> Tensor:
    """``out[out_idx[s]] (+)= scale[a_idx[s]] * x[a_idx[s] // div] @ W_e + x2[s] @ W2_e (+ b_e)``.

    Each part optional; ``W2_e = w2[e]`` (``w2_is_kn``, ``[E, r, N]``) or ``w2[e].T`` (``[E, N, r]``).
    One fp32 sum, one rounding (the kernel's epilogue adds the rank-r term, so the output is written
    once). The rows are a whole grouping (``ends[-1] == S``): every output row is written, so a new
    output is not zeroed first.
    """
    if use_kernels(x):
        return _kernels.grouped_mm(
            x, w, ends, w_is_kn, a_idx=a_idx, div=div, scale=scale, bias=bias, out=out, out_idx=out_idx,
            x2=x2, w2=w2, w2_is_kn=w2_is_kn, covered=True,
        )  # fmt: skip
    rows = x if a_idx is None else x.index_select(0, a_idx // div)
    prod = grouped_mm_reference(rows, w, ends, transposed=w_is_kn)
    compute = torch.promote_types(x.dtype, torch.float32)
    if scale is not None or bias is not None or x2 is not None:
        value = prod.to(compute)
        if scale is not None:
            value = value * scale.to(compute).index_select(0, a_idx)[:, None]
        if x2 is not None:
            value = value + grouped_mm_reference(x2.to(compute), w2.to(compute), ends, transposed=w2_is_kn)
        if bias is not None:
            value = value + bias.to(compute).index_select(0, expert_ids)
        prod = value.to(x.dtype)
    if out is None:
        return prod if out_idx is None else torch.empty_like(prod).index_copy_(0, out_idx, prod)
    if out_idx is None:
        return out.copy_((out.to(compute) + prod.to(compute)).to(out.dtype))
    summed = out.index_select(0, out_idx).to(compute) + prod.to(compute)
    return out.index_copy_(0, out_idx, summed.to(out.dtype))


DOWN_IN_KERNEL_MAX_RANK = 32
"""Largest LoRA rank whose down product runs inside the main grouped GEMM on the kernel path (its
``[BM, r]`` accumulator sits beside the main one); larger ranks make the separate pass."""


DOWN_IN_KERNEL_MAX_OUT = 2048
"""Widest output whose GEMM makes the rank-r side inside: every N tile of the output recomputes it,
while the separate pass reads the rows once, so the one pass pays off for narrow outputs only (on the
H200 block, ``benchmarks/results/moe_fused_sweep4_h200.json``: Qwen3-30B-A3B's outputs of 768 to
2,048 columns gain 4%, GPT-OSS-20B's 2,880 and 5,760 lose 5 to 12%)."""


def down_in_kernel(x: Tensor, rank: int, n_out: int) -> bool:
    """Whether :func:`indexed_lora_grouped_mm` computes the rank-r side inside the main GEMM of x's rows
    into ``n_out`` columns."""
    return use_kernels(x) and 0 < rank <= DOWN_IN_KERNEL_MAX_RANK and n_out <= DOWN_IN_KERNEL_MAX_OUT


def indexed_lora_grouped_mm(
    x: Tensor,
    w: Tensor,
    ends: Tensor,
    w_is_kn: bool,
    *,
    down: Tensor,
    down_is_kn: bool,
    up: Tensor,
    up_is_kn: bool,
    lora_scale: float,
    keep_scaled: bool,
    a_idx: Tensor | None = None,
    div: int = 1,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    expert_ids: Tensor | None = None,
    out_idx: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, side)``: :func:`indexed_grouped_mm` with the LoRA term ``x2 @ up_e`` whose rank-r input
    is made from the same rows, ``side = scale(s) * x[aidx(s)] @ down_e`` (in x's dtype) and
    ``x2 = side * lora_scale``; ``side`` is returned scaled (``keep_scaled``) or not.

    On the kernel path, for a rank up to :data:`DOWN_IN_KERNEL_MAX_RANK` and an output up to
    :data:`DOWN_IN_KERNEL_MAX_OUT` columns wide, one pass: the rows are read
    once for both products (the separate pass reads all ``[S, K]`` of them again for r columns). The
    roundings are the separate passes', which run otherwise (and from then on, with a warning, where
    the one-pass kernel does not fit the device's shared memory).
    """
    global DOWN_IN_KERNEL_MAX_RANK
    rank = down.shape[2] if down_is_kn else down.shape[1]
    n_rows = a_idx.shape[0] if a_idx is not None else x.shape[0]
    if down_in_kernel(x, rank, w.shape[2] if w_is_kn else w.shape[1]):
        side = x.new_empty((n_rows, rank))
        try:
            out = _kernels.grouped_mm(
                x, w, ends, w_is_kn, a_idx=a_idx, div=div, scale=scale, bias=bias, out_idx=out_idx,
                w2=up, w2_is_kn=up_is_kn, covered=True, down=down, down_is_kn=down_is_kn,
                lora_scale=lora_scale, r_out=side, keep_scaled=keep_scaled,
            )  # fmt: skip
            return out, side
        except _kernels.OutOfResources as error:  # a device smaller than the tiles assume
            DOWN_IN_KERNEL_MAX_RANK = 0
            warnings.warn(
                f"the one-pass LoRA side of the fused MoE GEMMs does not fit this device ({error}); "
                "the separate rank-r passes run from now on (the same products)",
                RuntimeWarning,
                stacklevel=2,
            )
    side = indexed_grouped_mm(x, down, ends, down_is_kn, a_idx=a_idx, div=div, scale=scale)
    x2 = side * lora_scale
    out = indexed_grouped_mm(
        x, w, ends, w_is_kn, a_idx=a_idx, div=div, scale=scale, bias=bias, expert_ids=expert_ids,
        out_idx=out_idx, x2=x2, w2=up, w2_is_kn=up_is_kn,
    )  # fmt: skip
    return out, (x2 if keep_scaled else side)


def indexed_weight_grad(
    a, b, ends, *, a_idx=None, a_div=1, a_scale=None, b_idx=None, b_div=1, b_scale=None
) -> Tensor:
    """``[E, A, B]``: ``A[rows of e]^T B[rows of e]`` with either operand's rows read through an index."""
    if use_kernels(a):
        return _kernels.grouped_mm_weight_grad(
            a, b, ends, a_idx=a_idx, a_div=a_div, a_scale=a_scale, b_idx=b_idx, b_div=b_div, b_scale=b_scale
        )
    compute = torch.promote_types(a.dtype, torch.float32)

    def rows(t, idx, div, scale):
        if idx is None:
            return t
        t = t.index_select(0, idx // div)
        if scale is None:
            return t
        return (t.to(compute) * scale.to(compute).index_select(0, idx)[:, None]).to(t.dtype)

    return _weight_grad(rows(a, a_idx, a_div, a_scale), rows(b, b_idx, b_div, b_scale), ends)


LORA_GRAD_PAIR = True
"""Whether the first fused op's backward makes the LoRA up factor's two rank-r products from its
output's gradient (``g = grad B_e``, ``dB = grad^T xa``) in one pass over that ``[S, N]`` gradient
(:func:`lora_grad_pair`) instead of two GEMMs that each read all of it."""


def lora_grad_pair(grad: Tensor, up: Tensor, side: Tensor, ends: Tensor) -> tuple[Tensor, Tensor]:
    """``(grad @ up_e [S, r], grad^T side per expert [E, N, r])`` for rows in expert order (every row
    routed), ``up`` ``[E, N, r]``: one read of ``grad`` on the kernel path (:data:`LORA_GRAD_PAIR`,
    ranks up to 64), else ``torch._grouped_mm`` / the per-expert reference, twice."""
    if LORA_GRAD_PAIR and use_kernels(grad) and 0 < up.shape[2] <= _pair_kernels.LORA_GRAD_PAIR_MAX_RANK:
        return _pair_kernels.lora_grad_pair(grad, up, side, ends)
    return _mm(grad, up, ends, w_is_kn=True), _weight_grad(grad, side, ends)


def slot_sum(src: Tensor, top_k: int, weights: Tensor | None) -> Tensor:
    """``[T, N]``: ``sum_j (w[t, j] *) src[t k + j]`` of slot-ordered ``[T k, N]`` rows, fp32, j in order."""
    if use_kernels(src):
        return _kernels.slot_sum(src, top_k, weights)
    compute = torch.promote_types(src.dtype, torch.float32)
    rows = src.to(compute).view(-1, top_k, src.shape[1])
    if weights is not None:
        rows = rows * weights.to(compute).view(-1, top_k, 1)
    return rows.sum(dim=1).to(src.dtype)


def slot_dot(dout: Tensor, src: Tensor, top_k: int) -> Tensor:
    """float32 ``[T, k]``: ``<dout[t], src[t k + j]>`` (the routing weights' gradient)."""
    if use_kernels(dout):
        return _kernels.slot_dot(dout, src, top_k)
    compute = torch.promote_types(src.dtype, torch.float32)
    return (src.to(compute).view(-1, top_k, src.shape[1]) * dout.to(compute)[:, None, :]).sum(-1)


def bias_grad(
    grad: Tensor, ends: Tensor, expert_ids: Tensor, idx: Tensor | None = None, div: int = 1, scale=None
) -> Tensor:
    """``[E, N]``: per expert, the sum of its rows of ``grad`` (row s read as ``grad[idx[s] // div] *
    scale[idx[s]]`` when indexed; ``expert_ids`` int64 ``[S]`` the expert of each sorted row).

    With the kernels: a weight gradient against a column of ones, one program per output tile
    summing its rows in order (``index_add_`` adds with atomics on CUDA). Elsewhere ``index_add_``
    (ordered on CPU), which traces without reading the row ends on the host.
    """
    if use_kernels(grad):
        ones = grad.new_ones((idx.shape[0] if idx is not None else grad.shape[0], 1))
        return indexed_weight_grad(ones, grad, ends, b_idx=idx, b_div=div, b_scale=scale)[:, 0]
    compute = torch.promote_types(grad.dtype, torch.float32)
    rows = grad.to(compute) if idx is None else grad.to(compute).index_select(0, idx // div)
    if scale is not None:
        rows = rows * scale.to(compute).index_select(0, idx)[:, None]
    out = rows.new_zeros((ends.shape[0], grad.shape[1])).index_add_(0, expert_ids, rows)
    return out.to(grad.dtype)


# ------------------------------------------------- rows already in expert order: torch._grouped_mm
GROUPED_MM_CHOICES = {
    "none": (False, False),
    "ordered": (True, False),
    "gathered": (False, True),
    "both": (True, True),
}
"""Which of the fused path's expert GEMMs run ``torch._grouped_mm``: (:data:`ORDERED_ROWS_GROUPED_MM`,
:data:`GATHERED_ROWS_GROUPED_MM`) by name, as ``LIGHTNING_SLOTH_MOE_GROUPED_MM`` in the environment
and ``benchmarks/moe_bench.py --grouped-mm`` take them."""


def grouped_mm_choice(name: str) -> tuple[bool, bool]:
    """``(ordered, gathered)`` for a :data:`GROUPED_MM_CHOICES` name; a clear error for any other."""
    if name not in GROUPED_MM_CHOICES:
        raise ValueError(
            f"LIGHTNING_SLOTH_MOE_GROUPED_MM / --grouped-mm takes {sorted(GROUPED_MM_CHOICES)}, got {name!r}"
        )
    return GROUPED_MM_CHOICES[name]


_FROM_ENV = grouped_mm_choice(os.environ.get("LIGHTNING_SLOTH_MOE_GROUPED_MM", "none") or "none")

ORDERED_ROWS_GROUPED_MM = _FROM_ENV[0]
"""Whether the fused path's two GEMMs whose input rows are already in expert order (the second GEMM's
forward, the first GEMM's input gradient) run ``torch._grouped_mm`` (CUTLASS, Hopper bfloat16) in expert
order, each token's k rows then summed through the inverse permutation, instead of the Triton kernel
writing slot order. Only the rows' write order changes: the gathered copies stay avoided (those two
GEMMs read their rows in place either way). Off: three interleaved rounds on the H200 block gained
nothing (``benchmarks/results/moe_fused_grouped_mm_rounds_h200.json``; ``moe_bench.py --grouped-mm``)."""


def _grouped_mm_takes(x: Tensor, shape) -> bool:
    """Whether ``torch._grouped_mm`` takes rows x against an expert weight of ``shape``: bfloat16 CUDA
    from Hopper on, every dimension a multiple of 8 (16-byte rows)."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0) and all(
        d % 8 == 0 for d in (*shape[1:], x.shape[1])
    )


def ordered_grouped_mm(x: Tensor, shape, rank: int) -> bool:
    """Whether rows of x in expert order, times an expert weight of ``shape`` with rank-r LoRA, take
    the ``torch._grouped_mm`` path (:data:`ORDERED_ROWS_GROUPED_MM`)."""
    return ORDERED_ROWS_GROUPED_MM and rank % 8 == 0 and _grouped_mm_takes(x, shape)


def ordered_rows_sum(rows: Tensor, perm: Tensor, top_k: int, weights: Tensor | None) -> Tensor:
    """``[T, N]``: ``sum_j (w[t, j] *) rows[inv[t k + j]]`` of expert-ordered rows, fp32, j in order."""
    return _gather_sum(rows, inverse_permutation(perm), top_k, weights)


def ordered_rows_dot(dout: Tensor, rows: Tensor, perm: Tensor, top_k: int) -> Tensor:
    """float32 ``[T, k]``: ``<dout[t], rows[inv[t k + j]]>`` of expert-ordered rows (the routing weights' gradient)."""
    return _combine_weight_grad(dout, rows, inverse_permutation(perm), top_k)


def lora_input_grad(
    rows: Tensor, w: Tensor, ends: Tensor, w_is_kn: bool, g: Tensor | None, lora_a: Tensor
) -> Tensor:
    """``[S, K]`` in expert order: ``rows @ W_e^T (+ g @ A_e)`` by ``torch._grouped_mm`` and the rank-r pass."""
    out = _mm(rows, w, ends, w_is_kn=w_is_kn)
    return _mm_into(out, g, lora_a, ends, w_is_kn=True) if g is not None else out


def ordered_input_grad_sum(grad, w, ends, w_is_kn, g, lora_a, perm, top_k) -> Tensor:
    """``[T, K]``: each token's sum over its k rows of ``grad @ W_e^T (+ g @ A_e)``, the rows made in
    expert order by ``torch._grouped_mm`` and summed through the inverse permutation."""
    return ordered_rows_sum(lora_input_grad(grad, w, ends, w_is_kn, g, lora_a), perm, top_k, None)


GATHERED_ROWS_GROUPED_MM = _FROM_ENV[1]
"""Whether the fused path's two GEMMs that read their rows through the permutation (the first GEMM's
forward, the second GEMM's input gradient) make the gathered copy and run ``torch._grouped_mm`` on it,
as the separate path does, while the sums, the combine and the weight gradients stay fused. With
:data:`ORDERED_ROWS_GROUPED_MM` every expert GEMM is CUTLASS's. Off, as measured with it
(``moe_fused_grouped_mm_rounds_h200.json``: the gathered copies and separate rank-r passes cost what
CUTLASS gains)."""


def gathered_grouped_mm(x: Tensor, shape, rank: int) -> bool:
    """Whether rows read through the permutation from x take the gathered ``torch._grouped_mm`` path."""
    return GATHERED_ROWS_GROUPED_MM and rank % 8 == 0 and _grouped_mm_takes(x, shape)


def gathered_rows(x: Tensor, perm: Tensor, top_k: int, scale: Tensor | None = None) -> Tensor:
    """``[S, K]``: ``x[perm[s] // k]`` (times ``scale[perm[s]]``, rounded to x's dtype as a scaled copy is)."""
    return _rows(x, perm, top_k, scale)  # the separate path's gather (its Triton kernel on CUDA)
