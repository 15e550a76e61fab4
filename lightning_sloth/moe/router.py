"""The top-k router as one ``sloth::`` op: float32 logits, the family's rule, one Triton kernel on CUDA.

``sloth::moe_router_topk(x, weight, bias, top_k, softmax_first, normalize)`` returns
``(logits [T, E] float32, weights [T, k] float32, index [T, k] int64)``, the same as
:func:`~.routing.router_logits` followed by the family's rule of :data:`~.routing.ROUTERS`:

- ``softmax_first``: softmax over the E logits in float32, the top k, divided by their sum when
  ``normalize`` (Qwen2/3-MoE and Qwen3-Next by ``norm_topk_prob``, Qwen3.5-MoE and Mixtral always);
- otherwise: the top k logits, softmax over those k (GPT-OSS).

On CUDA with float16/bfloat16 (or float32) operands of one dtype, at most
:data:`~lightning_sloth.kernels.moe_router.MAX_EXPERTS` experts, it is one kernel
(``lightning_sloth.kernels.moe_router``): the router GEMM, the top k and the weights in its
epilogue, in place of the float32 copies of x and W, the GEMM, softmax, top-k, sum, division and
cast, eight launches on the host's path to the first expert GEMM. Elsewhere the plain-torch rule
runs. The backward is the analytic one of the rule (the weights are a softmax over the k chosen
logits, or the full softmax read at k experts) plus the logits' own gradient (an auxiliary loss), then
the GEMMs of the reference in float32. Where the forward ran the kernel, one backward kernel makes the
logits' gradient and the input's ``dlogits W`` in the same program (for 16-bit W with the gradient
split in two 16-bit parts: 16 bits of its mantissa, the products summed in float32 and rounded once, as
the float32 GEMM's result is); a trained router weight or bias takes ``dlogits`` from it in float32.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from lightning_sloth.moe.routing import route_softmax_topk, route_topk_softmax, router_logits
from lightning_sloth.ops.registry import (
    TRITON_OPS,
    call,
    register_autograd,
    register_flops,
    sloth_op,
    use_triton,
)

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if TRITON_OPS or _INTERPRETED:
    from lightning_sloth.kernels import moe_router as _kernels

__all__ = ["FUSED_ROUTER_RULES", "fused_router_rule", "route_topk"]

FUSED_ROUTER_RULES: dict[str, tuple[bool, bool | str]] = {
    "qwen3_moe": (True, "norm_topk_prob"),
    "qwen2_moe": (True, "norm_topk_prob"),
    "qwen3_next": (True, "norm_topk_prob"),
    "qwen3_5_moe_text": (True, True),
    "mixtral": (True, True),
    "gpt_oss": (False, False),
}
"""``model_type`` -> ``(softmax_first, normalize)`` (normalize: a bool or the config attribute that
holds it) for the families whose router this op computes; the others keep :data:`~.routing.ROUTERS`."""

_MAX_EXPERTS = 256
_MAX_TOP_K = 32


def fused_router_rule(model_type: str, config) -> tuple[bool, bool] | None:
    """``(softmax_first, normalize)`` of a family's router for :func:`route_topk`, or None."""
    rule = FUSED_ROUTER_RULES.get(model_type)
    if rule is None:
        return None
    softmax_first, normalize = rule
    return softmax_first, normalize if isinstance(normalize, bool) else bool(getattr(config, normalize))


def _reference(x, weight, bias, top_k, softmax_first, normalize):
    logits = router_logits(x, weight, bias)
    if softmax_first:
        weights, index = route_softmax_topk(logits, top_k, normalize, keep_float32=True)
    else:
        weights, index = route_topk_softmax(logits, top_k)
    return logits, weights, index


def _kernel_usable(x: Tensor, weight: Tensor, top_k: int) -> bool:
    on_kernels = use_triton(x) or (_INTERPRETED and x.dtype in (torch.float32, torch.float16))
    return (
        on_kernels
        and weight.dtype == x.dtype
        and weight.device == x.device
        and 0 < weight.shape[0] <= _MAX_EXPERTS
        and 0 < top_k <= min(weight.shape[0], _MAX_TOP_K)
    )


@sloth_op("moe_router_topk")
def _router_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, softmax_first: bool, normalize: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logits [T, E] float32, weights [T, k] float32, index [T, k] int64)``, see the module docstring."""
    if _kernel_usable(x, weight, top_k) and (bias is None or bias.device == x.device):
        return _kernels.router_topk(x, weight, bias, top_k, softmax_first, normalize)
    return _reference(x, weight, bias, top_k, softmax_first, normalize)


@_router_op.register_fake
def _router_fake(x, weight, bias, top_k, softmax_first, normalize):
    tokens, experts = x.shape[0], weight.shape[0]
    return (
        x.new_empty((tokens, experts), dtype=torch.float32),
        x.new_empty((tokens, top_k), dtype=torch.float32),
        x.new_empty((tokens, top_k), dtype=torch.int64),
    )


def _setup(ctx, inputs, output):
    x, weight, bias, top_k, softmax_first, normalize = inputs
    logits, weights, index = output
    ctx.mark_non_differentiable(index)
    ctx.save_for_backward(x, weight, logits, weights, index)
    ctx.softmax_first, ctx.normalize = softmax_first, normalize
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.kernel = _kernel_usable(x, weight, top_k) and (bias is None or bias.device == x.device)


def _backward(ctx, grad_logits, grad_weights, _grad_index):
    x, weight, logits, weights, index = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if grad_logits is None and grad_weights is None:
        return None, None, None, None, None, None
    if ctx.kernel:  # the rule's backward and dx = dlogits W in one kernel
        grad_weights = (
            torch.zeros_like(weights) if grad_weights is None else grad_weights.float().contiguous()
        )
        dx, grad = _kernels.router_topk_backward(
            grad_weights,
            weights,
            index,
            logits,
            None if grad_logits is None else grad_logits.float().contiguous(),
            weight,
            ctx.softmax_first and not ctx.normalize,
            need_x=need_x,
            need_logits=need_w or need_b,
        )
        dweight = (grad.t() @ x.float()).to(weight.dtype) if need_w else None  # a trained router: float32
        dbias = grad.sum(dim=0).to(ctx.bias_dtype) if need_b else None
        return dx, dweight, dbias, None, None, None
    grad = torch.zeros_like(logits) if grad_logits is None else grad_logits.float()
    if grad_weights is not None:
        dw = grad_weights.float()
        if ctx.softmax_first and not ctx.normalize:  # w_j = softmax(logits)[i_j]: the full softmax's backward
            probs = torch.softmax(logits, dim=-1)
            picked = torch.zeros_like(logits).scatter_(1, index, dw)
            grad = grad + probs * (picked - (dw * weights).sum(dim=-1, keepdim=True))
        else:  # w = softmax over the k chosen logits (renormalised probabilities are exactly that)
            chosen = weights * (dw - (dw * weights).sum(dim=-1, keepdim=True))
            grad = grad + torch.zeros_like(logits).scatter_(1, index, chosen)  # k distinct experts per row
    dx = (grad @ weight.float()).to(x.dtype) if need_x else None
    dweight = (grad.t() @ x.float()).to(weight.dtype) if need_w else None  # a trained router: float32
    dbias = grad.sum(dim=0).to(ctx.bias_dtype) if need_b else None
    return dx, dweight, dbias, None, None, None


register_autograd(_router_op, _backward, _setup, none_grads=True)
register_flops(
    _router_op,
    lambda x, weight, bias, top_k, softmax_first, normalize, out_shape=None: 2 * x[0] * x[1] * weight[0],
)


def route_topk(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    top_k: int,
    softmax_first: bool,
    normalize: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """A top-k router's ``(logits [T, E] float32, weights [T, k] float32, index [T, k] int64)``.

    Args:
        hidden_states: ``[T, H]``.
        weight: ``[E, H]`` router weight.
        bias: optional ``[E]``.
        top_k: experts per token (1..E).
        softmax_first: softmax over all E, then top k (else top k, then softmax over those k).
        normalize: with ``softmax_first``, divide the k weights by their sum.

    Raises:
        ValueError: shapes that do not fit, or top_k out of range.
    """
    if hidden_states.dim() != 2 or weight.dim() != 2 or hidden_states.shape[1] != weight.shape[1]:
        raise ValueError(
            f"route_topk: hidden_states {tuple(hidden_states.shape)} [T, H] does not fit the router "
            f"weight {tuple(weight.shape)} [E, H]"
        )
    if not 0 < top_k <= weight.shape[0]:
        raise ValueError(f"route_topk: top_k={top_k} must be in 1..{weight.shape[0]} (the experts)")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"route_topk: bias {tuple(bias.shape)} must be [E] = ({weight.shape[0]},)")
    return call(_router_op, hidden_states, weight, bias, int(top_k), bool(softmax_first), bool(normalize))
