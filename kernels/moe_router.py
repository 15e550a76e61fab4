"""A top-k router in one kernel: the router GEMM, then the routing rule in its epilogue.

``router_topk`` computes, per token row of x ``[T, H]`` and router weight ``[E, H]``:

- ``logits = x W^T (+ b)`` in float32 (16-bit operands multiply exactly into the float32
  accumulator; float32 operands in IEEE precision, no TF32), written out ``[T, E]``;
- the k experts of largest logit, in descending order (ties: the lower expert id first);
- their weights, by one of two rules:

  - ``softmax_first``: ``softmax(logits)`` over all E experts in float32, read at the k experts,
    divided by their sum when ``normalize`` (Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral);
  - otherwise: softmax over the k logits (GPT-OSS).

Choosing by logit is choosing by probability (softmax is monotone), without the rounding of the
probabilities in the way. One program owns ``BM`` rows and all E (<= 256) experts, so the rule needs
no second pass: the three torch ops of the GEMM's cast, softmax and top-k (whose sort alone runs
about 0.1 ms on 16k tokens and 128 experts) and the normalisation become one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_sloth.kernels._utils import launchable
from lightning_sloth.kernels.moe import _dot

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "router_topk", "router_topk_backward"]

MAX_EXPERTS = 256
"""The most experts one program holds (a row's logits stay in registers)."""

MAX_TOP_K = 32
"""The most experts per token the epilogue selects."""


@triton.jit
def _router_topk_kernel(
    X, W, BIAS, LOGITS, WEIGHTS, INDEX, n_tokens, n_in, n_experts,
    stride_xm, stride_xk, stride_we, stride_wk, stride_lm, stride_wm, stride_im,
    BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORMALIZE: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_mask = rows < n_tokens
    cols = tl.arange(0, BE)
    col_mask = cols < n_experts
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    for k0 in range(0, n_in, BK):
        ks = k0 + tl.arange(0, BK)
        if EVEN_K:
            x_mask = row_mask[:, None]
            w_mask = col_mask[None, :]
        else:
            k_mask = ks < n_in
            x_mask = row_mask[:, None] & k_mask[None, :]
            w_mask = k_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
        w = tl.load(W + cols[None, :] * stride_we + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc = _dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        LOGITS + rows[:, None] * stride_lm + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :]
    )

    neg_inf = float("-inf")
    masked = tl.where(col_mask[None, :], acc, neg_inf)  # the padding experts never chosen
    work = masked
    top = tl.max(work, axis=1)
    slots = tl.arange(0, KP)
    values = tl.full((BM, KP), neg_inf, dtype=tl.float32)
    index = tl.zeros((BM, KP), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(work, axis=1)
        # the lowest expert id holding the maximum (a NaN row still yields an expert in range)
        at = tl.min(tl.where(work == best[:, None], cols[None, :], BE), axis=1)
        at = tl.minimum(at, n_experts - 1)
        values = tl.where(slots[None, :] == j, best[:, None], values)
        index = tl.where(slots[None, :] == j, at[:, None], index)
        work = tl.where(cols[None, :] == at[:, None], neg_inf, work)
    if SOFTMAX_FIRST:
        total = tl.sum(tl.exp(masked - top[:, None]), axis=1)
        weights = tl.exp(values - top[:, None]) / total[:, None]
        if NORMALIZE:
            weights = weights / tl.sum(weights, axis=1)[:, None]
    else:
        shifted = tl.exp(values - top[:, None])
        weights = shifted / tl.sum(shifted, axis=1)[:, None]
    out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(WEIGHTS + rows[:, None] * stride_wm + slots[None, :], weights, mask=out_mask)
    tl.store(INDEX + rows[:, None] * stride_im + slots[None, :], index.to(tl.int64), mask=out_mask)


TILES: tuple[int, int] | None = None
"""``(BM, BK)`` of the forward kernel on CUDA instead of the built-in choice (a probe's sweep sets it)."""

BACKWARD_TILES: tuple[int, int] | None = None
"""``(BM, BN)`` of the backward kernel on CUDA instead of the built-in choice."""


def _tiles(device: torch.device, experts: int) -> tuple[int, int, int, int]:
    """``(BM, BE, BK, num_warps)``: the E experts in one tile, fewer rows per program the more there are."""
    be = max(16, triton.next_power_of_2(experts))
    if device.type != "cuda":
        return 16, be, 32, 4
    bm, bk = TILES or ((32 if be <= 128 else 16), 128)
    return bm, be, bk, 4


def router_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    softmax_first: bool,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [T, E] float32, weights [T, k] float32, index [T, k] int64)`` (module docstring).

    Args:
        x: ``[T, H]`` token rows, float16/bfloat16 (or float32) like ``weight``.
        weight: ``[E, H]`` router weight, E <= :data:`MAX_EXPERTS`.
        bias: optional ``[E]``.
        top_k: experts per token, 1 <= k <= min(E, :data:`MAX_TOP_K`).
        softmax_first: the rule, as in the module docstring.
        normalize: with ``softmax_first``, divide the k weights by their sum.
    """
    tokens, n_in = x.shape
    experts = weight.shape[0]
    if not 0 < experts <= MAX_EXPERTS or not 0 < top_k <= min(experts, MAX_TOP_K):
        raise ValueError(
            f"router_topk: {experts} experts (at most {MAX_EXPERTS}) and top_k={top_k} "
            f"(1..min(E, {MAX_TOP_K})) are out of range"
        )
    if weight.shape[1] != n_in or weight.dtype != x.dtype:
        raise ValueError(
            f"router_topk: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}"
        )
    logits = torch.empty((tokens, experts), device=x.device, dtype=torch.float32)
    weights = torch.empty((tokens, top_k), device=x.device, dtype=torch.float32)
    index = torch.empty((tokens, top_k), device=x.device, dtype=torch.int64)
    if tokens == 0:
        return logits, weights, index
    bm, be, bk, warps = _tiles(x.device, experts)
    bk = max(16, min(bk, triton.next_power_of_2(n_in)))
    launchable(_router_topk_kernel)[(triton.cdiv(tokens, bm),)](
        x, weight, bias if bias is not None else weight, logits, weights, index, tokens, n_in, experts,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), logits.stride(0), weights.stride(0),
        index.stride(0),
        BM=bm, BE=be, BK=bk, TOP_K=top_k, KP=max(2, triton.next_power_of_2(top_k)), HAS_BIAS=bias is not None,
        SOFTMAX_FIRST=softmax_first, NORMALIZE=normalize, EVEN_K=n_in % bk == 0,
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    return logits, weights, index


@triton.jit
def _router_backward_kernel(
    GRAD_W, WEIGHTS, INDEX, LOGITS, GRAD_L, W, DX, DLOGITS, n_tokens, n_in, n_experts,
    stride_gwm, stride_wm, stride_im, stride_lm, stride_glm, stride_we, stride_wk, stride_dxm, stride_dlm,
    BM: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
    FULL_SOFTMAX: tl.constexpr, HAS_GRAD_L: tl.constexpr, NEED_X: tl.constexpr, STORE_DLOGITS: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_mask = rows < n_tokens
    cols = tl.arange(0, BE)
    col_mask = cols < n_experts
    slots = tl.arange(0, KP)
    k_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    dw = tl.load(GRAD_W + rows[:, None] * stride_gwm + slots[None, :], mask=k_mask, other=0.0).to(tl.float32)
    w = tl.load(WEIGHTS + rows[:, None] * stride_wm + slots[None, :], mask=k_mask, other=0.0)
    index = tl.load(INDEX + rows[:, None] * stride_im + slots[None, :], mask=k_mask, other=0).to(tl.int32)
    dot_w = tl.sum(dw * w, axis=1)
    if FULL_SOFTMAX:  # w_j = softmax(logits)[i_j]: dl = p * (G - <dw, w>), G the k gradients at their experts
        logits = tl.load(
            LOGITS + rows[:, None] * stride_lm + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=float("-inf"),
        )
        top = tl.max(logits, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)
        p = tl.exp(logits - top[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        per_slot = dw
    else:  # w = softmax over the k chosen logits: dl_j = w_j (dw_j - <dw, w>) at expert i_j, 0 elsewhere
        per_slot = w * (dw - dot_w[:, None])
    g = tl.zeros((BM, BE), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        at = tl.sum(tl.where(slots[None, :] == j, index, 0), axis=1)
        value = tl.sum(tl.where(slots[None, :] == j, per_slot, 0.0), axis=1)
        g = tl.where(cols[None, :] == at[:, None], g + value[:, None], g)
    if FULL_SOFTMAX:
        g = p * (g - dot_w[:, None])
    if HAS_GRAD_L:
        g += tl.load(
            GRAD_L + rows[:, None] * stride_glm + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
    g = tl.where(row_mask[:, None] & col_mask[None, :], g, 0.0)
    if STORE_DLOGITS:
        tl.store(
            DLOGITS + rows[:, None] * stride_dlm + cols[None, :],
            g,
            mask=row_mask[:, None] & col_mask[None, :],
        )
    if NEED_X:
        if SPLIT:  # g in two 16-bit parts: their exact products summed in float32, one rounding
            hi = g.to(W.dtype.element_ty)
            lo = (g - hi.to(tl.float32)).to(W.dtype.element_ty)
        for n0 in range(0, n_in, BN):
            ns = n0 + tl.arange(0, BN)
            n_mask = ns < n_in
            wt = tl.load(
                W + cols[:, None] * stride_we + ns[None, :] * stride_wk,
                mask=col_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if SPLIT:
                acc = tl.dot(hi, wt, acc)
                acc = tl.dot(lo, wt, acc)
            else:
                acc = _dot(g, wt, acc)
            tl.store(
                DX + rows[:, None] * stride_dxm + ns[None, :],
                acc.to(DX.dtype.element_ty),
                mask=row_mask[:, None] & n_mask[None, :],
            )


def router_topk_backward(
    grad_weights: torch.Tensor,
    weights: torch.Tensor,
    index: torch.Tensor,
    logits: torch.Tensor,
    grad_logits: torch.Tensor | None,
    weight: torch.Tensor,
    full_softmax: bool,
    need_x: bool = True,
    need_logits: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx [T, H] in weight's dtype or None, dlogits [T, E] float32 or None)`` of :func:`router_topk`.

    ``dlogits`` is the rule's backward from the weights' gradient (``full_softmax``: the weights are
    the full softmax read at k experts; else a softmax over the k chosen logits) plus ``grad_logits``;
    ``dx = dlogits W`` in the same program, 16-bit W multiplied by dlogits split into two 16-bit parts
    (16 bits of its mantissa, float32 sums, one rounding). ``dlogits`` is written out only when
    ``need_logits`` (the router's weight or bias trains).
    """
    tokens, top_k = weights.shape
    experts, n_in = weight.shape
    dx = torch.empty((tokens, n_in), device=weight.device, dtype=weight.dtype) if need_x else None
    dlogits = (
        torch.empty((tokens, experts), device=weight.device, dtype=torch.float32) if need_logits else None
    )
    if tokens == 0 or not (need_x or need_logits):
        return dx, dlogits
    be = max(16, triton.next_power_of_2(experts))
    if weight.device.type == "cuda":
        bm, bn = BACKWARD_TILES or ((32 if be <= 128 else 16), 128)
    else:
        bm, bn = 16, 32
    bn = max(16, min(bn, triton.next_power_of_2(n_in)))
    grad_l = grad_logits if grad_logits is not None else logits
    launchable(_router_backward_kernel)[(triton.cdiv(tokens, bm),)](
        grad_weights, weights, index, logits, grad_l, weight, dx if dx is not None else logits,
        dlogits if dlogits is not None else logits, tokens, n_in, experts,
        grad_weights.stride(0), weights.stride(0), index.stride(0), logits.stride(0), grad_l.stride(0),
        weight.stride(0), weight.stride(1), dx.stride(0) if dx is not None else 0,
        dlogits.stride(0) if dlogits is not None else 0,
        BM=bm, BE=be, BN=bn, TOP_K=top_k, KP=max(2, triton.next_power_of_2(top_k)), FULL_SOFTMAX=full_softmax,
        HAS_GRAD_L=grad_logits is not None, NEED_X=need_x, STORE_DLOGITS=need_logits,
        SPLIT=weight.dtype in (torch.bfloat16, torch.float16),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return dx, dlogits
