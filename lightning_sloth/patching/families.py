"""The model-family table: which transformers module class gets which ``sloth::`` op.

One row per ``config.model_type``. A row names classes of the family's modeling module
(``transformers.models.<package>.modeling_<package>``) and the few numerical facts that differ
between families; :mod:`lightning_sloth.patching._forwards` holds the one replacement forward per op
that every family shares. Adding a family is adding a row.

======================  ==========================================================================
column                  what it decides
======================  ==========================================================================
``norms``               RMSNorm classes (per-head and whole-projection q/k norms included; a norm
                        without a weight, e.g. Llama 4's L2 norm or Gemma 4's v norm, is the unit
                        weight) -> ``rms_norm`` with ``norm_style``.
``mlps``                gated MLPs -> ``swiglu`` or ``geglu``, picked from the activation named by
                        ``config.<activation_attr>``; ``glu_layout`` says where gate and up come
                        from: ``"split"`` (``gate_proj``/``up_proj``/``down_proj``) or ``"fused"``
                        (Phi-3's ``gate_up_proj``, gate then up, and ``down_proj``).
``attentions``          attention classes whose forward calls the module-level
                        ``apply_rotary_pos_emb`` -> ``apply_rope`` with ``rope_layout``, called as
                        ``rope_form`` says: ``"qk"`` (``(q, k, cos, sin)``, heads before positions)
                        or ``"single"`` (Gemma 4: ``(x, cos, sin, unsqueeze_dim=2)`` on
                        ``[B, T, heads, D]``). Partial rotary (``cos`` narrower than the head) and
                        per-layer head dims need nothing more: the op reads both from its inputs.
``linear_attentions``   Gated DeltaNet classes (hybrid linear attention) -> their forward with the
                        short convolution and the delta rule over the packed row's ``cu_seqlens``
                        (:mod:`lightning_sloth.linear_attention`).
``gated_norms``         the gated RMSNorm after their delta rule -> ``rms_norm_gated``
                        (:mod:`lightning_sloth.patching.gated_norm`).
``mla_attentions``      multi-head latent attention classes (DeepSeek-V3) -> a forward that builds q,
                        k and v of packed rows in the flash varlen layout, the interleaved rotary
                        included (:mod:`lightning_sloth.patching.mla`); other calls, and
                        ``config.rope_interleave=False`` models, run transformers' forward.
``causal_lms``          ``*ForCausalLM`` classes -> ``linear_cross_entropy`` when labels are given
                        (``final_logit_softcapping`` is read from the config; the logits are divided
                        by ``config.<logits_divisor_attr>`` where a row names one, Granite's
                        ``logits_scaling``).
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
``absent``              op -> why the family does not take it (said in the patch report).
``traits``              what sets the family apart, for the support matrix (``support.py``).
======================  ==========================================================================

MoE families (qwen3_moe, mixtral, gpt_oss, qwen2_moe, qwen3_next, qwen3_5_moe_text, glm4_moe,
deepseek_v3, llama4_text) get the norm, rope and loss parts here where they apply; their experts
(transformers' fused 3-D parameters) are switched through transformers' experts interface to
``lightning_sloth.moe``. Their gated MLP class is listed under ``mlps``: it is the dense layers'
MLP (Qwen's ``mlp_only_layers``, DeepSeek/GLM's ``first_k_dense_replace`` layers, Llama 4's
non-MoE layers) and the shared expert (Qwen2-MoE/Qwen3-Next/Qwen3.5-MoE behind their sigmoid
``shared_expert_gate``, which stays transformers' ``nn.Linear``; DeepSeek/GLM's ``shared_experts``;
Llama 4's ``shared_expert``), all ``down(act(gate(x)) * up(x))``. The hybrid families
(qwen3_5_text, qwen3_5_moe_text, qwen3_next) also have linear-attention layers.

The decoder layers of Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4-MoE and DeepSeek-V3 are Llama's line for
line (Llama-order norms; the model passes all but the hidden states by keyword) with an MoE block or
a dense MLP as ``mlp``: the block returns the hidden states alone (transformers takes the router
logits for the load-balancing loss from a forward hook on the router), so they take ``add_rms_norm``
too. GPT-OSS's does not: its ``mlp`` returns ``(hidden_states, router_scores)`` and its norms round
the weight product in fp32.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Literal

from torch import nn

__all__ = ["FAMILIES", "OP_COLUMNS", "Family", "GluLayout", "NormStyle", "RopeForm", "RopeLayout"]


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
# Gemma 2/3, Qwen3.5, Qwen3-Next: ``x_hat * (1 + weight)`` in fp32, rounded once.
GEMMA_NORM = NormStyle(offset=1.0, fp32_product=True, eps_attr="eps")
# GptOssRMSNorm, Olmo2/3RMSNorm: ``(weight * x_hat).to(dtype)``, the Gemma rounding without the offset.
GPT_OSS_NORM = NormStyle(offset=0.0, fp32_product=True, eps_attr="variance_epsilon")
# Llama4TextRMSNorm (and its weightless L2 norm): ``x_hat.type_as(x) * weight``, eps in ``eps``.
LLAMA4_NORM = NormStyle(offset=0.0, fp32_product=False, eps_attr="eps")
# Gemma4RMSNorm: ``(x_hat * weight.float()).type_as(x)`` (weights start at 1, no offset).
GEMMA4_NORM = NormStyle(offset=0.0, fp32_product=True, eps_attr="eps")

RopeLayout = Literal["rotate_half", "half_table"]
"""``rotate_half``: cos/sin span the head dimension (``cat(freqs, freqs)``), transformers' usual form.
``half_table``: cos/sin hold the D/2 frequencies once and rotate the two halves (GPT-OSS)."""

RopeForm = Literal["qk", "single"]
"""How the attention forward calls ``apply_rotary_pos_emb``: ``qk``: ``(q, k, cos, sin)`` on
``[B, heads, T, D]``; ``single``: ``(x, cos, sin, unsqueeze_dim=2)`` on ``[B, T, heads, D]`` (Gemma 4)."""

GluLayout = Literal["split", "fused"]
"""``split``: ``gate_proj`` and ``up_proj``; ``fused``: one ``gate_up_proj`` whose output is gate then up."""


OP_COLUMNS: dict[str, tuple[str, str]] = {
    "rms_norm": ("norms", "RMSNorm modules"),
    "rope": ("attentions", "rotary attention modules"),
    "glu": ("mlps", "dense gated MLPs"),
    "linear_attention": ("linear_attentions", "linear-attention layers"),
    "rms_norm_gated": ("gated_norms", "gated RMSNorm modules"),
    "mla": ("mla_attentions", "multi-head latent attention modules"),
    "add_rms_norm": ("decoder_layers", "pre-norm decoder layers"),
    "cross_entropy": ("causal_lms", "causal LM head"),
}
"""op -> (the column naming the classes it applies to, what those are); ``lora`` needs no column."""


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
    glu_layout: GluLayout = "split"
    rope_form: RopeForm = "qk"
    linear_attentions: tuple[str, ...] = ()
    gated_norms: tuple[str, ...] = ()
    mla_attentions: tuple[str, ...] = ()
    logits_divisor_attr: str | None = None
    absent: tuple[tuple[str, str], ...] = ()
    traits: tuple[str, ...] = ()

    def why_absent(self, op: str) -> str | None:
        """Why the family does not take ``op``: its ``absent`` entry, else (for an op of
        :data:`OP_COLUMNS` whose column is empty) that the table lists no such module; None when the
        row takes it."""
        reason = dict(self.absent).get(op)
        if reason is None and op in OP_COLUMNS and not getattr(self, OP_COLUMNS[op][0]):
            reason = f"the table lists no {OP_COLUMNS[op][1]} for this family"
        return reason

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
    **columns,
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
        **columns,
    )


def _moe(
    prefix: str,
    package: str,
    experts: tuple[str, ...],
    routers: tuple[str, ...],
    load_balancing: bool = False,
    rotary: bool = True,
    **columns,
) -> Family:
    """An MoE family of Llama-order norms, Llama's pre-norm decoder layer and rotate-half rotary
    (``rotary=False``: the attention rotates another way, said in ``absent``) whose dense MLPs and
    shared experts are gated MLPs."""
    return Family(
        package=package,
        norms=(f"{prefix}RMSNorm",),
        norm_style=LLAMA_NORM,
        mlps=(f"{prefix}MLP",),
        activation_attr="hidden_act",
        attentions=(f"{prefix}Attention",) if rotary else (),
        rope_layout="rotate_half",
        causal_lms=(f"{prefix}ForCausalLM",),
        moe=load_balancing,
        experts=experts,
        routers=routers,
        decoder_layers=(f"{prefix}DecoderLayer",),
        **columns,
    )


_POST_NORM = ("add_rms_norm", "post-norm decoder layers (the norm follows attention and the MLP)")
_SANDWICH = ("add_rms_norm", "sandwich decoder layers (a norm before and after attention and the MLP)")
_OFFSET_NORMS = (
    "add_rms_norm",
    "its decoder norms are (1 + weight) norms; add_rms_norm fuses Llama-order norms",
)


def _hybrid(prefix: str, package: str, moe: bool, *traits: str) -> Family:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet and gated full attention, 3:1."""
    return Family(
        package=package,
        norms=(f"{prefix}RMSNorm",),
        norm_style=GEMMA_NORM,
        mlps=(f"{prefix}MLP",),
        activation_attr="hidden_act",
        attentions=(f"{prefix}Attention",),
        rope_layout="rotate_half",
        causal_lms=(f"{prefix}ForCausalLM",),
        moe=moe,
        linear_attentions=(f"{prefix}GatedDeltaNet",),
        gated_norms=(f"{prefix}RMSNormGated",),
        absent=(_OFFSET_NORMS,),
        traits=("hybrid linear attention (Gated DeltaNet 3:1)", "partial rotary", "per-head QK-norm",
                "gated attention output", *traits),
    )  # fmt: skip


FAMILIES: dict[str, Family] = {
    "llama": _dense("Llama", "llama", pre_norm_layers=True),
    "mistral": _dense("Mistral", "mistral", pre_norm_layers=True),
    "qwen2": _dense("Qwen2", "qwen2", pre_norm_layers=True),
    "qwen3": _dense("Qwen3", "qwen3", pre_norm_layers=True),
    "gemma2": _dense("Gemma2", "gemma2", GEMMA_NORM, "hidden_activation", absent=(_SANDWICH,)),
    "gemma3_text": _dense("Gemma3", "gemma3", GEMMA_NORM, "hidden_activation", absent=(_SANDWICH,)),
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
        decoder_layers=("Qwen3MoeDecoderLayer",),
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
        decoder_layers=("MixtralDecoderLayer",),
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
    # ------------------------------------------------------------------ dense families of 2025-26
    "phi3": _dense(
        "Phi3",
        "phi3",
        glu_layout="fused",
        absent=(("add_rms_norm", "the decoder layer runs residual dropouts (resid_pdrop) around each add"),),
        traits=("fused qkv_proj", "fused gate_up_proj", "partial rotary", "LongRoPE scaling"),
    ),
    "smollm3": _dense("SmolLM3", "smollm3", pre_norm_layers=True, traits=("NoPE layers",)),
    "olmo2": _dense(
        "Olmo2", "olmo2", GPT_OSS_NORM, absent=(_POST_NORM,), traits=("QK-norm over all heads", "post-norm")
    ),
    "olmo3": _dense(
        "Olmo3",
        "olmo3",
        GPT_OSS_NORM,
        absent=(_POST_NORM,),
        traits=("QK-norm over all heads", "post-norm", "sliding window"),
    ),
    "granite": _dense(
        "Granite",
        "granite",
        logits_divisor_attr="logits_scaling",
        absent=(("add_rms_norm", "the decoder layer scales each branch by residual_multiplier"),),
        traits=("embedding, residual, attention and logit multipliers",),
    ),
    "ministral3": _dense(
        "Ministral3", "ministral3", pre_norm_layers=True, traits=("Llama-4 query scaling", "YaRN")
    ),
    "llama4_text": Family(
        package="llama4",
        # transformers 5.25 renamed the weightless q/k norm (Llama4TextL2Norm stays an alias).
        norms=("Llama4TextRMSNorm", "Llama4TextL2Norm", "Llama4TextWeightlessRMSNorm"),
        norm_style=LLAMA4_NORM,
        mlps=("Llama4TextMLP",),
        activation_attr="hidden_act",
        attentions=(),
        rope_layout="rotate_half",
        causal_lms=("Llama4ForCausalLM",),
        experts=("Llama4TextExperts",),
        moe_blocks=("Llama4TextMoe",),
        absent=(
            ("rope", "interleaved complex rotary (apply_rotary_emb); sloth::rope computes rotate-half"),
            ("add_rms_norm", "the decoder layer's MLP is feed_forward (a MoE block in MoE layers)"),
        ),
        traits=("weightless QK L2 norm", "NoPE layers", "chunked attention", "interleaved MoE layers"),
    ),
    "gemma4_text": Family(
        package="gemma4",
        norms=("Gemma4RMSNorm",),
        norm_style=GEMMA4_NORM,
        mlps=("Gemma4TextMLP",),
        activation_attr="hidden_activation",
        attentions=("Gemma4TextAttention",),
        rope_layout="rotate_half",
        rope_form="single",
        causal_lms=("Gemma4ForCausalLM",),
        absent=(_SANDWICH,),
        traits=(
            "per-layer head dims",
            "QK-norm and weightless V-norm",
            "proportional partial rotary",
            "final logit soft-capping",
            "sliding window",
            "K = V global layers",
        ),
    ),  # fmt: skip
    "qwen3_5_text": _hybrid("Qwen3_5", "qwen3_5", False),
    "qwen3_5_moe_text": replace(
        _hybrid("Qwen3_5Moe", "qwen3_5_moe", True, "MoE with a gated shared expert"),
        experts=("Qwen3_5MoeExperts",),
        routers=("Qwen3_5MoeTopKRouter",),
    ),
    "qwen3_next": replace(
        _hybrid("Qwen3Next", "qwen3_next", True, "MoE with a gated shared expert"),
        experts=("Qwen3NextExperts",),
        routers=("Qwen3NextTopKRouter",),
    ),
    # Qwen2-MoE, GLM-4-MoE (partial rotary, optional per-head QK-norm) and DeepSeek-V3 (MLA, whose
    # q_a/kv_a latent norms are the same RMSNorm class): Llama-order norms (weight * x_hat rounded).
    "qwen2_moe": _moe(
        "Qwen2Moe",
        "qwen2_moe",
        load_balancing=True,
        experts=("Qwen2MoeExperts",),
        routers=("Qwen2MoeTopKRouter",),
    ),
    "glm4_moe": _moe("Glm4Moe", "glm4_moe", experts=("Glm4MoeExperts",), routers=("Glm4MoeTopkRouter",)),
    "deepseek_v3": _moe(
        "DeepseekV3",
        "deepseek_v3",
        experts=("DeepseekV3Experts",),
        routers=("DeepseekV3TopkRouter",),
        rotary=False,
        mla_attentions=("DeepseekV3Attention",),
        absent=(
            (
                "rope",
                "interleaved rotary (apply_rotary_pos_emb_interleave, config.rope_interleave=True "
                "by default): the mla forward rotates q and k of packed rows as it lays them out, "
                "other calls and rope_interleave=False models keep transformers' rotary",
            ),
        ),
    ),
}
"""``config.model_type`` -> :class:`Family`."""
