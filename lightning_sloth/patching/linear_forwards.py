"""Gated DeltaNet forwards (Qwen3.5, Qwen3-Next) over a packed row's segments.

transformers' Gated DeltaNet forward calls module-level functions of its modeling file for its short
convolution and its delta rule. :func:`linear_attention_forward` rebuilds the class's own forward
(same code object) over a copy of its module namespace in which those names run
:mod:`lightning_sloth.linear_attention`'s packed kernels (:mod:`._rebuild`), and each falls back to
transformers' function where the call has no packed metadata or carries a cache.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_sloth.linear_attention import packed_causal_conv1d, packed_gated_delta_rule
from lightning_sloth.patching._forwards import _op_forward
from lightning_sloth.patching._rebuild import rebuild_with_globals


def _packed_conv(original: Callable) -> Callable:
    """transformers' ``causal_conv1d_fn(x [B, D, T], weight [D, W], bias, activation, **kwargs)``,
    over the packed row's segments when the call carries ``cu_seq_lens_q``; else the original."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        out = packed_causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation, cu_seqlens)
        return out.transpose(1, 2)

    return causal_conv1d_fn


def _packed_conv_forward(original: Callable) -> Callable:
    """transformers' (5.25 on) ``causal_conv1d_forward(conv1d, x [B, D, T], cache, layer_idx,
    activation, state_idx, **kwargs)``, over the packed row's segments when the call carries
    ``cu_seq_lens_q`` and no cache; else the original."""

    def causal_conv1d_forward(
        conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs
    ):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None or cache is not None:
            return original(
                conv1d, hidden_states, cache, layer_idx, activation=activation, state_idx=state_idx, **kwargs
            )
        weight = conv1d.weight.squeeze(1)
        out = packed_causal_conv1d(hidden_states.transpose(1, 2), weight, conv1d.bias, activation, cu_seqlens)
        return out.transpose(1, 2)

    return causal_conv1d_forward


def _packed_delta_rule(original: Callable) -> Callable:
    """transformers' ``torch_chunk_gated_delta_rule(q, k, v, g, beta, ..., cu_seqlens)`` over the packed
    row's segments when ``cu_seqlens`` is given without a carried state; else the original."""

    def torch_chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        **kwargs,
    ):
        if cu_seqlens is None or initial_state is not None or output_final_state:
            return original(
                query,
                key,
                value,
                g=g,
                beta=beta,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens,
                **kwargs,
            )
        out = packed_gated_delta_rule(
            query, key, value, g, beta, cu_seqlens, use_qk_l2norm=use_qk_l2norm_in_kernel
        )
        return out, None

    return torch_chunk_gated_delta_rule


_LINEAR_FORWARDS: dict[type, Callable | None] = {}


def linear_attention_forward(cls: type[nn.Module]) -> Callable | None:
    """A Gated DeltaNet class's forward rebuilt so that its short convolution and delta rule run over
    the packed row's segments (:mod:`lightning_sloth.linear_attention`).

    Returns None when the forward does not call ``torch_chunk_gated_delta_rule`` and one of the
    convolutions (``causal_conv1d_fn`` up to transformers 5.24, ``causal_conv1d_forward`` from 5.25)
    by their global names.
    """
    if cls not in _LINEAR_FORWARDS:
        rebuilt = None
        for conv_name, conv in (
            ("causal_conv1d_fn", _packed_conv),
            ("causal_conv1d_forward", _packed_conv_forward),
        ):
            rebuilt = rebuilt or rebuild_with_globals(
                cls.forward, {conv_name: conv, "torch_chunk_gated_delta_rule": _packed_delta_rule}
            )
        _LINEAR_FORWARDS[cls] = None if rebuilt is None else _op_forward("linear_attention")(rebuilt)
    return _LINEAR_FORWARDS[cls]
