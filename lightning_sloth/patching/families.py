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
``decoder_layers``      pre-norm decoder layers (``input_layernorm`` -> ``self_attn`` -> add ->
                        ``post_attention_layernorm`` -> ``mlp`` -> add) -> ``add_rms_norm`` for the
                        residual add and the norm after attention (Llama-order norms only).
======================  ==========================================================================

MoE families (qwen3_moe, mixtral, gpt_oss) get the norm, rope and loss parts here; their experts
(transformers' fused 3-D parameters) are switched through transformers' experts interface to
``lightning_sloth.moe`` (Qwen3-MoE's dense ``mlp_only_layers`` MLPs are plain gated MLPs and are
listed).
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
}
"""``config.model_type`` -> :class:`Family`."""
