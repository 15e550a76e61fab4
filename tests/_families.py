"""Tiny random-weight models of the families added to the table in 2026 (dense, hybrid linear
attention, and the attention / linear-attention side of the hybrid MoE families).

Imported as ``from _families import ...`` (``tests/`` is on ``sys.path`` through pytest's default
import mode). Every config is small enough for a CPU float32 test, and exercises the family's
differences: partial rotary, NoPE layers, sliding windows and chunked attention shorter than the
test documents, per-layer head dims, soft-capping, multipliers, fused projections, linear attention.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 128

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.15,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_HYBRID = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
_HYBRID_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    output_router_logits=False,
)

# model_type -> (config class, overrides, report counts of the 2-layer model with kernels=True)
CASES: dict[str, tuple[str, dict, dict[str, int]]] = {
    "phi3": (
        "Phi3Config",
        dict(partial_rotary_factor=0.5),
        dict(rms_norm=5, rope=2, glu=2, cross_entropy=1),
    ),
    "smollm3": (
        "SmolLM3Config",
        dict(no_rope_layers=[1, 0]),
        dict(rms_norm=5, rope=2, glu=2, cross_entropy=1, add_rms_norm=2),
    ),
    "olmo2": ("Olmo2Config", {}, dict(rms_norm=9, rope=2, glu=2, cross_entropy=1)),
    "olmo3": (
        "Olmo3Config",
        dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
        dict(rms_norm=9, rope=2, glu=2, cross_entropy=1),
    ),
    "granite": (
        "GraniteConfig",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
        dict(rms_norm=5, rope=2, glu=2, cross_entropy=1),
    ),
    "ministral3": (
        "Ministral3Config",
        dict(
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                llama_4_scaling_beta=0.1,
                original_max_position_embeddings=8,
            )
        ),
        dict(rms_norm=5, rope=2, glu=2, cross_entropy=1, add_rms_norm=2),
    ),  # fmt: skip
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=96,
            moe_layers=[1],
            no_rope_layers=[1, 0],
            use_qk_norm=True,
            attention_chunk_size=8,
            attn_temperature_tuning=True,
            floor_scale=4,
        ),
        dict(rms_norm=6, glu=2, cross_entropy=1),
    ),  # fmt: skip
    "gemma4_text": (
        "Gemma4TextConfig",
        dict(
            global_head_dim=32,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            final_logit_softcapping=3.0,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
        ),
        dict(rms_norm=18, rope=2, glu=2, cross_entropy=1),
    ),  # fmt: skip
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        _HYBRID,
        dict(rms_norm=7, rope=1, glu=2, cross_entropy=1, linear_attention=1, rms_norm_gated=1),
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        dict(_HYBRID, **_HYBRID_MOE),
        dict(rms_norm=7, rope=1, glu=2, cross_entropy=1, linear_attention=1, rms_norm_gated=1),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(_HYBRID, **_HYBRID_MOE),
        dict(rms_norm=7, rope=1, glu=2, cross_entropy=1, linear_attention=1, rms_norm_gated=1),
    ),
}

LINEAR_ATTENTION_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def tiny(model_type: str, seed: int = 0, attn: str = "sdpa", **overrides) -> torch.nn.Module:
    """Random float32 causal LM of the family in train mode, every norm weight moved off its init."""
    config_name, config_overrides, _ = CASES[model_type]
    config = getattr(transformers, config_name)(**{**COMMON, **config_overrides, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                param.add_(0.3 * torch.randn_like(param))
    return model.train()
