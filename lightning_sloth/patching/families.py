"""The model-family table: which transformers module class gets which ``sloth::`` op.

One row per ``config.model_type``. A row names classes of the family's modeling module
(``transformers.models.<package>.modeling_<package>``) and the few numerical facts that differ
between families; :mod:`lightning_sloth.patching._forwards` holds the one replacement forward per op
that every family shares. Adding a family is adding a row.

======================  ==========================================================================
column                  what it decides
======================  ==========================================================================
``norms``               RMSNorm classes (Qwen3's and Gemma 3's per-head q/k norms included) ->
                        ``rms_norm`` with ``norm_style``.
``mlps``                gated MLPs with ``gate_proj``/``up_proj``/``down_proj`` -> ``swiglu`` or
                        ``geglu``, picked from the activation named by ``config.<activation_attr>``.
``attentions``          attention classes whose forward calls the module-level
                        ``apply_rotary_pos_emb`` -> ``apply_rope`` with ``rope_layout``.
``causal_lms``          ``*ForCausalLM`` classes -> ``linear_cross_entropy`` when labels are given
                        (Gemma 2's ``final_logit_softcapping`` is read from the config).
``moe``                 the causal LM adds the router load-balancing loss (``output_router_logits``).
``experts``             fused 3-D experts classes -> the "sloth" experts implementation
                        (``lightning_sloth.moe``, selected by ``patching.apply_experts``).
``routers``             top-k router classes -> the family's router with logits in float32
                        (``lightning_sloth.moe.routing``, installed by ``apply_experts``).
``moe_blocks``          MoE blocks that never dispatch their experts through the interface (Llama 4
                        runs every expert on every token) -> a block forward that routes in float32
                        and runs the routed rows only (``apply_experts``).
``decoder_layers``      pre-norm decoder layers (``input_layernorm`` -> ``self_attn`` -> add ->
                        ``post_attention_layernorm`` -> ``mlp`` -> add) -> ``add_rms_norm`` for the
                        residual add and the norm after attention (Llama-order norms only).
======================  ==========================================================================

MoE families (qwen3_moe, mixtral, gpt_oss, qwen2_moe, qwen3_next, qwen3_5_moe_text, glm4_moe,
deepseek_v3, llama4_text) get the norm, rope and loss parts here; their experts (transformers'
fused 3-D parameters) are switched through transformers' experts interface to
``lightning_sloth.moe``. Their gated MLP class is listed under ``mlps``: it is the dense layers'
MLP (Qwen's ``mlp_only_layers``, DeepSeek/GLM's ``first_k_dense_replace`` layers, Llama 4's
non-MoE layers) and the shared expert (Qwen2-MoE/Qwen3-Next/Qwen3.5-MoE behind their sigmoid
``shared_expert_gate``, which stays transformers' ``nn.Linear``; DeepSeek/GLM's ``shared_experts``;
Llama 4's ``shared_expert``), all ``down(act(gate(x)) * up(x))``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

from torch import nn

__all__ = ["FAMILIES", "Family", "NormStyle"]


@dataclass(frozen=True)
class NormStyle:
    """How a family's RMSNorm rounds and where it keeps eps.

    Attributes:
        offset: 0 for ``weight * x_hat``, 1 for Gemma's ``(1 + weight) * x_hat``.
        fp32_product: The weight product is taken in fp32 and rounded once (Gemma, GPT-OSS); else
            ``x_hat`` is rounded to the input dtype first (Llama).
        eps_attr: The module attribute holding eps.
    """

    offset: float
    fp32_product: bool
    eps_attr: str


LLAMA_NORM = NormStyle(offset=0.0, fp32_product=False, eps_attr="variance_epsilon")
GEMMA_NORM = NormStyle(offset=1.0, fp32_product=True, eps_attr="eps")
# GptOssRMSNorm: ``(weight * x_hat).to(dtype)``, the Gemma rounding without the offset.
GPT_OSS_NORM = NormStyle(offset=0.0, fp32_product=True, eps_attr="variance_epsilon")

RopeLayout = Literal["rotate_half", "half_table"]
"""``rotate_half``: cos/sin span the head dimension (``cat(freqs, freqs)``), transformers' usual form.
``half_table``: cos/sin hold the D/2 frequencies once and rotate the two halves (GPT-OSS)."""


@dataclass(frozen=True)
class Family:
    """One model family's row of the table (see the module docstring for the columns)."""

    package: str
    norms: tuple[str, ...]
    norm_style: NormStyle
    mlps: tuple[str, ...]
    activation_attr: str
    attentions: tuple[str, ...]
    rope_layout: RopeLayout
    causal_lms: tuple[str, ...]
    moe: bool = False
    experts: tuple[str, ...] = ()
    routers: tuple[str, ...] = ()
    moe_blocks: tuple[str, ...] = ()
    decoder_layers: tuple[str, ...] = ()

    def modeling(self) -> ModuleType:
        """transformers' modeling module of the family."""
        return importlib.import_module(f"transformers.models.{self.package}.modeling_{self.package}")

    def classes(self, names: tuple[str, ...]) -> tuple[type[nn.Module], ...]:
        """The named classes that this transformers version defines (a missing one is skipped)."""
        module = self.modeling()
        return tuple(getattr(module, name) for name in names if hasattr(module, name))


def _dense(
    prefix: str,
    package: str,
    norm_style: NormStyle = LLAMA_NORM,
    activation: str = "hidden_act",
    pre_norm_layers: bool = False,
) -> Family:
    return Family(
        package=package,
        norms=(f"{prefix}RMSNorm",),
        norm_style=norm_style,
        mlps=(f"{prefix}MLP",),
        activation_attr=activation,
        attentions=(f"{prefix}Attention",),
        rope_layout="rotate_half",
        causal_lms=(f"{prefix}ForCausalLM",),
        decoder_layers=(f"{prefix}DecoderLayer",) if pre_norm_layers else (),
    )


def _moe(
    prefix: str,
    package: str,
    experts: tuple[str, ...],
    routers: tuple[str, ...] = (),
    moe_blocks: tuple[str, ...] = (),
    load_balancing: bool = False,
    causal_lms: tuple[str, ...] | None = None,
) -> Family:
    return Family(
        package=package,
        norms=(),
        norm_style=LLAMA_NORM,
        mlps=(f"{prefix}MLP",),
        activation_attr="hidden_act",
        attentions=(),
        rope_layout="rotate_half",
        causal_lms=(f"{prefix}ForCausalLM",) if causal_lms is None else causal_lms,
        moe=load_balancing,
        experts=experts,
        routers=routers,
        moe_blocks=moe_blocks,
    )


FAMILIES: dict[str, Family] = {
    "llama": _dense("Llama", "llama", pre_norm_layers=True),
    "mistral": _dense("Mistral", "mistral", pre_norm_layers=True),
    "qwen2": _dense("Qwen2", "qwen2", pre_norm_layers=True),
    "qwen3": _dense("Qwen3", "qwen3", pre_norm_layers=True),
    "gemma2": _dense("Gemma2", "gemma2", GEMMA_NORM, "hidden_activation"),
    "gemma3_text": _dense("Gemma3", "gemma3", GEMMA_NORM, "hidden_activation"),
    "qwen3_moe": Family(
        package="qwen3_moe",
        norms=("Qwen3MoeRMSNorm",),
        norm_style=LLAMA_NORM,
        mlps=("Qwen3MoeMLP",),
        activation_attr="hidden_act",
        attentions=("Qwen3MoeAttention",),
        rope_layout="rotate_half",
        causal_lms=("Qwen3MoeForCausalLM",),
        moe=True,
        experts=("Qwen3MoeExperts",),
        routers=("Qwen3MoeTopKRouter",),
    ),
    "mixtral": Family(
        package="mixtral",
        norms=("MixtralRMSNorm",),
        norm_style=LLAMA_NORM,
        mlps=(),
        activation_attr="hidden_act",
        attentions=("MixtralAttention",),
        rope_layout="rotate_half",
        causal_lms=("MixtralForCausalLM",),
        moe=True,
        experts=("MixtralExperts",),
        routers=("MixtralTopKRouter",),
    ),
    "gpt_oss": Family(
        package="gpt_oss",
        norms=("GptOssRMSNorm",),
        norm_style=GPT_OSS_NORM,
        mlps=(),
        activation_attr="hidden_act",
        attentions=("GptOssAttention",),
        rope_layout="half_table",
        causal_lms=("GptOssForCausalLM",),
        moe=True,
        experts=("GptOssExperts",),
        routers=("GptOssTopKRouter",),
    ),
    # MoE rows: the MoE columns (moe, experts, routers, moe_blocks) and the gated MLPs (shared
    # experts and dense layers); norms and attention come with the dense columns.
    "qwen2_moe": _moe(
        "Qwen2Moe",
        "qwen2_moe",
        load_balancing=True,
        experts=("Qwen2MoeExperts",),
        routers=("Qwen2MoeTopKRouter",),
    ),
    "qwen3_next": _moe(
        "Qwen3Next",
        "qwen3_next",
        load_balancing=True,
        experts=("Qwen3NextExperts",),
        routers=("Qwen3NextTopKRouter",),
    ),
    "qwen3_5_moe_text": _moe(
        "Qwen3_5Moe",
        "qwen3_5_moe",
        load_balancing=True,
        experts=("Qwen3_5MoeExperts",),
        routers=("Qwen3_5MoeTopKRouter",),
    ),
    "glm4_moe": _moe("Glm4Moe", "glm4_moe", experts=("Glm4MoeExperts",), routers=("Glm4MoeTopkRouter",)),
    "deepseek_v3": _moe(
        "DeepseekV3", "deepseek_v3", experts=("DeepseekV3Experts",), routers=("DeepseekV3TopkRouter",)
    ),
    # Llama4ForCausalLM names its decoder ``model`` but its base_model_prefix "language_model", which
    # the fused loss's forward reads: its loss stays transformers' until that column handles it.
    "llama4_text": _moe(
        "Llama4Text", "llama4", causal_lms=(), experts=("Llama4TextExperts",), moe_blocks=("Llama4TextMoe",)
    ),
}
"""``config.model_type`` -> :class:`Family`."""
