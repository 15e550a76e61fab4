"""The packed short convolution and gated delta rule: one entry point each, the backend picked per call."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sloth.linear_attention.fla_kernels import (
    MISSING,
    causal_conv1d_fla,
    fla_available,
    gated_delta_rule_fla,
)
from lightning_sloth.linear_attention.reference import causal_conv1d_reference, gated_delta_rule_reference

__all__ = [
    "BACKENDS",
    "get_linear_attention_backend",
    "packed_causal_conv1d",
    "packed_gated_delta_rule",
    "set_linear_attention_backend",
]

BACKENDS = ("auto", "reference")
"""``"auto"``: flash-linear-attention's kernels on CUDA (an error naming the extra if they are not
installed), the plain-torch reference elsewhere. ``"reference"``: the reference everywhere."""

_backend = "auto"


def set_linear_attention_backend(backend: str) -> None:
    """Choose the linear-attention backend, process-wide (see :data:`BACKENDS`)."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear attention backend {backend!r}; choose one of {BACKENDS}")
    _backend = backend


def get_linear_attention_backend() -> str:
    """The backend chosen with :func:`set_linear_attention_backend` (``"auto"`` by default)."""
    return _backend


def _use_fla(x: Tensor) -> bool:
    if _backend == "reference" or x.device.type != "cuda":
        return False
    if not fla_available():
        raise ImportError(MISSING)
    return True


def _check_packed(x: Tensor, cu_seqlens: Tensor | None, name: str) -> None:
    if cu_seqlens is None:
        return
    if x.shape[0] != 1:
        raise ValueError(f"{name}: a packed row (cu_seqlens given) has batch size 1, got {tuple(x.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens!r}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"{name}: cu_seqlens is on {cu_seqlens.device}, the row on {x.device}")


@torch.compiler.disable
def packed_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Depthwise causal convolution that starts every segment from zero history.

    Args:
        x: ``[B, T, D]`` float (``B == 1`` with ``cu_seqlens``).
        weight: ``[D, W]`` taps per channel (``W`` typically 4).
        bias: ``[D]`` or None.
        activation: None, ``"silu"`` or ``"swish"`` (fused on CUDA).
        cu_seqlens: ``[N + 1]`` int32/int64 segment bounds on x's device, or None.

    Returns:
        ``[B, T, D]`` in x's dtype.

    Raises:
        ImportError: on CUDA without ``fla-core`` (names the extra ``lightning-sloth[linear]``).
        ValueError: a packed row with ``B != 1`` or malformed ``cu_seqlens``.
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"packed_causal_conv1d: x must be [B, T, D] and weight [D, W], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    _check_packed(x, cu_seqlens, "packed_causal_conv1d")
    if _use_fla(x):
        return causal_conv1d_fla(x, weight, bias, activation, cu_seqlens)
    return causal_conv1d_reference(x, weight, bias, activation, cu_seqlens)


@torch.compiler.disable
def packed_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """Chunked gated delta rule whose state restarts at zero at every segment.

    Args:
        q: ``[B, T, Hk, Dk]`` (``B == 1`` with ``cu_seqlens``).
        k: ``[B, T, Hk, Dk]``.
        v: ``[B, T, Hv, Dv]``, ``Hv`` a multiple of ``Hk``.
        g: ``[B, T, Hv]`` log decay (float32 in transformers' modules).
        beta: ``[B, T, Hv]``.
        cu_seqlens: ``[N + 1]`` int32/int64 segment bounds on q's device, or None.
        scale: query scale (``Dk ** -0.5`` if None).
        use_qk_l2norm: L2-normalise q and k first (fused on CUDA).

    Returns:
        ``[B, T, Hv, Dv]`` in q's dtype.

    Raises:
        ImportError: on CUDA without ``fla-core`` (names the extra ``lightning-sloth[linear]``).
        ValueError: mismatched shapes, a packed row with ``B != 1`` or malformed ``cu_seqlens``.
    """
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"packed_gated_delta_rule: q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(
            f"packed_gated_delta_rule: g and beta must be [B, T, Hv] = {tuple(v.shape[:3])}, got "
            f"{tuple(g.shape)} and {tuple(beta.shape)}"
        )
    if v.shape[2] % k.shape[2]:
        raise ValueError(f"value heads ({v.shape[2]}) must be a multiple of query/key heads ({k.shape[2]})")
    _check_packed(q, cu_seqlens, "packed_gated_delta_rule")
    if _use_fla(q):
        return gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm)
    return gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm)
