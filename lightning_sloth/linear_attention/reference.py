"""Plain-torch references of the two token mixers of hybrid linear-attention layers, run segment by
segment: the short causal convolution and the chunked gated delta rule.

Both cut the packed row at ``cu_seqlens`` and run every segment alone, so no state crosses a
document boundary; the segment bounds are read on the host (``cu_seqlens.tolist()``), which is what
makes this path slow on a GPU and fine on the CPU, where it is the test oracle. Each segment runs
the same operations in the same order as transformers' own fallbacks (``causal_conv1d_fn`` and
``torch_chunk_gated_delta_rule`` in ``modeling_qwen3_5``), so a packed row equals each document run
alone through the unmodified model up to float32 rounding.

Gated delta rule, per head (state ``S`` of ``[Dk, Dv]``, zero at every document start)::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (x) beta_t * (v_t - S_t^T k_t)
    o_t = S_t^T q_t                      q_t, k_t L2-normalised (optional), q_t scaled by Dk^-1/2

computed by chunks of 64 positions (the UT transform inside a chunk, a scan over chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_conv1d_reference", "gated_delta_rule_reference", "segments"]

CHUNK_SIZE = 64
"""Positions per chunk of the delta rule (transformers' and flash-linear-attention's default)."""

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def segments(cu_seqlens: Tensor | None, length: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every non-empty segment, read on the host; one segment without ``cu_seqlens``.

    Raises:
        ValueError: ``cu_seqlens`` does not rise from 0 to ``length``.
    """
    if cu_seqlens is None:
        return [(0, length)]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {length}, got {bounds}")
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def causal_conv1d_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None
) -> Tensor:
    """Depthwise causal convolution of each segment alone (zero history at its start).

    Args:
        x: ``[B, T, D]`` (``B == 1`` with ``cu_seqlens``); any strides.
        weight: ``[D, W]``, the taps of each channel, the last one on the current position.
        bias: ``[D]`` or None.
        activation: None, ``"silu"`` or ``"swish"``.
        cu_seqlens: ``[N + 1]`` int segment bounds, or None (each row is one segment).

    Returns:
        ``[B, T, D]`` in x's dtype (computed in the weight's dtype, as transformers does).
    """
    act = _activation(activation)
    width = weight.shape[-1]
    rows = []
    for row in x:  # [T, D]
        parts = []
        for start, end in segments(cu_seqlens, row.shape[0]):
            seg = row[start:end].transpose(0, 1).unsqueeze(0).to(weight.dtype)  # [1, D, L]
            out = F.conv1d(seg, weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
            out = out[..., : end - start]
            if act is not None:
                out = act(out)
            parts.append(out[0].transpose(0, 1).to(x.dtype))
        rows.append(torch.cat(parts) if parts else row.new_empty(0, x.shape[-1]))
    return torch.stack(rows)


def _activation(name: str | None):
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"short convolution activation must be one of {sorted(map(str, _ACTIVATIONS))}, got {name!r}"
        )
    return _ACTIVATIONS[name]


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """The gated delta rule over each segment alone, in float32 (float64 for float64 inputs).

    Args:
        q: ``[B, T, Hk, Dk]`` queries (``B == 1`` with ``cu_seqlens``).
        k: ``[B, T, Hk, Dk]`` keys.
        v: ``[B, T, Hv, Dv]`` values, ``Hv`` a multiple of ``Hk`` (each query/key head serves
            ``Hv / Hk`` consecutive value heads).
        g: ``[B, T, Hv]`` log decay (``<= 0``).
        beta: ``[B, T, Hv]`` write strength.
        cu_seqlens: ``[N + 1]`` segment bounds, or None (each row is one segment).
        scale: query scale, ``Dk ** -0.5`` if None.
        use_qk_l2norm: L2-normalise q and k first (eps 1e-6).

    Returns:
        ``[B, T, Hv, Dv]`` in q's dtype.
    """
    out_dtype = q.dtype
    heads_k, heads_v = k.shape[2], v.shape[2]
    if heads_v % heads_k:
        raise ValueError(f"value heads ({heads_v}) must be a multiple of query/key heads ({heads_k})")
    if heads_v != heads_k:
        q = q.repeat_interleave(heads_v // heads_k, dim=2)
        k = k.repeat_interleave(heads_v // heads_k, dim=2)
    # [B, H, T, ...] in float32 as transformers' fallback computes (float64 stays float64: a test oracle)
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).to(compute) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    rows = []
    for b in range(q.shape[0]):
        parts = [
            _chunked(q[b, :, s:e], k[b, :, s:e], v[b, :, s:e], g[b, :, s:e], beta[b, :, s:e])
            for s, e in segments(cu_seqlens, q.shape[2])
        ]
        rows.append(torch.cat(parts, dim=1) if parts else v.new_empty(v.shape[1], 0, v.shape[-1]))
    return torch.stack(rows).transpose(1, 2).to(out_dtype)


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One segment: ``q``/``k`` ``[H, L, Dk]``, ``v`` ``[H, L, Dv]``, ``g``/``beta`` ``[H, L]`` -> ``[H, L, Dv]``."""
    heads, length, _ = k.shape
    pad = (CHUNK_SIZE - length % CHUNK_SIZE) % CHUNK_SIZE
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK_SIZE
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, CHUNK_SIZE, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, chunks, CHUNK_SIZE).cumsum(dim=-1)
    above = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()
    # The UT transform: (I + strictly-lower(beta K K^T * decay)) solves the delta updates of a chunk at once.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = q.new_zeros(heads, k.shape[-1], v.shape[-1])
    out = []
    for i in range(chunks):
        v_new = values[:, i] - k_cumdecay[:, i] @ state
        out.append(q[:, i] @ state + intra[:, i] @ v_new)
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return torch.cat(out, dim=1)[:, :length]
