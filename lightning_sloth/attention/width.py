"""How wide a model's softmax attention is, summed over its layers, for attention FLOP counts.

``6 · heads · head_dim · Σ len²`` per layer is the usual causal-attention term of a training step's
FLOPs. Two kinds of model break the one-line form ``layers · heads · config.head_dim``: per-layer head
dims (Gemma 4's 512-dim global layers beside 256-dim sliding ones, where reading ``config.head_dim``
raises) and hybrid linear attention (Qwen3.5's Gated DeltaNet layers have no ``Σ len²`` term).
"""

from __future__ import annotations

from typing import Any

__all__ = ["attention_width"]


def attention_width(config: Any) -> int:
    """``Σ`` over the softmax-attention layers of ``num_attention_heads · head_dim``.

    Layers whose ``config.layer_types`` entry is ``"linear_attention"`` count 0; a layer's head dim
    comes from ``config.per_layer_config[i]`` where the config has one (Gemma 4), else from
    ``config.head_dim`` or ``hidden_size // num_attention_heads``.

    Args:
        config: a transformers text config.

    Returns:
        The width as a Python int (multiply by ``6 · Σ len²`` for the step's attention FLOPs).
    """
    layers = config.num_hidden_layers
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    per_layer = getattr(config, "per_layer_config", None)
    width = 0
    for index, kind in enumerate(kinds[:layers]):
        if kind == "linear_attention":
            continue
        layer = per_layer[index] if per_layer is not None else config
        width += config.num_attention_heads * _head_dim(layer, config)
    return width


def _head_dim(layer: Any, config: Any) -> int:
    head_dim = getattr(layer, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads
