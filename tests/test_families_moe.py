"""The MoE families beyond Qwen3-MoE/Mixtral/GPT-OSS, on CPU in float32 with tiny configs.

Per family (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE, GLM-4-MoE, DeepSeek-V3, Llama 4): a packed row
through ``transform_model`` (kernels, "sloth" experts and routers, packed attention, checkpointing)
equals each document alone through the unmodified transformers model, in the loss and the
gradient of every parameter (all trainable); PEFT ``target_parameters`` LoRA on the experts equals
PEFT's own path without folding a delta weight. Then the routers against transformers' (the
group-limited rule really limiting), QLoRA on DeepSeek-V3, a DeepSeek-V3 block compiled whole,
and the Llama 4 layers refused on packed rows where the row would change them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import packed_batch, random_documents
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_sloth.moe import register
from lightning_sloth.moe import switch as fused_switch_module
from lightning_sloth.moe.routing import ROUTERS
from lightning_sloth.patching import apply_experts
from lightning_sloth.transform import transform_model

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

VOCAB = 96
LENGTHS = [9, 1, 17, 6]  # odd lengths and a one-token document
PAD_TO = 40
EXPERT_LORA = ["experts.gate_up_proj", "experts.down_proj"]
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    initializer_range=0.2,
    attn_implementation="sdpa",
)
_GROUPED = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
CONFIGS = {
    "qwen2_moe": dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
        shared_expert_intermediate_size=40, norm_topk_prob=False,
    ),
    "qwen3_next": dict(
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
        shared_expert_intermediate_size=40, norm_topk_prob=True, layer_types=["full_attention"] * 2,
    ),
    "qwen3_5_moe_text": dict(
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, layer_types=["full_attention"] * 2,
    ),
    # first_k_dense_replace=1: a dense layer, then a MoE layer (shared experts, group-limited routing)
    "glm4_moe": dict(
        head_dim=8, moe_intermediate_size=24, intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=False, **_GROUPED,
    ),
    "deepseek_v3": dict(
        moe_intermediate_size=24, intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=12, num_key_value_heads=4, **_GROUPED,
    ),  # MLA: query/key heads of 16, value heads of 12
    # interleave_moe_layer_step=2: a dense layer, then a MoE layer; top-1 sigmoid routing
    "llama4_text": dict(
        head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size=24, intermediate_size_mlp=48,
        interleave_moe_layer_step=2, attention_chunk_size=64,
    ),
}  # fmt: skip
FAMILIES = list(CONFIGS)


def tiny(family: str, seed: int = 0, **overrides) -> nn.Module:
    """Random-weight float32 causal LM of ``family``, hidden 32, 2 layers, eval mode.

    Qwen3-Next/Qwen3.5-MoE keep full attention in both layers (their Gated DeltaNet layers are
    the hybrid attention's part); GLM/DeepSeek score-correction biases are spread so that they
    change the choice.
    """
    config = AutoConfig.for_model(family, **{**_COMMON, **CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _doc_loss_sum(model: nn.Module, doc: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([doc])).logits[0]
    return F.cross_entropy(logits[:-1].double(), torch.tensor(doc[1:], dtype=torch.int64), reduction="sum")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------------- packed parity
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_each_document_alone_in_loss_and_every_gradient(family):
    reference = tiny(family).train()
    packed = copy.deepcopy(reference)
    report = transform_model(packed, kernels=True)
    assert sum(report.kernels.counts.values()) > 0  # sloth ops installed (shared experts' MLP, loss)
    assert report.experts.implementation == "sloth"
    assert report.experts.routers or report.experts.blocks
    docs = random_documents(LENGTHS, seed=1, vocab=VOCAB)
    batch = packed_batch(docs, pad_to=PAD_TO)

    loss = packed(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    ref_loss = sum(_doc_loss_sum(reference, doc) for doc in docs) / batch.num_target_tokens
    ref_loss.backward()

    assert _rel(loss, ref_loss) <= 1e-5
    grads, ref_grads = _grads(packed), _grads(reference)
    assert grads.keys() == ref_grads.keys()
    experts = [n for n in ref_grads if ".experts." in n]
    routers = [n for n in ref_grads if ".gate.weight" in n or ".router." in n]
    assert experts and routers and all(ref_grads[n].abs().sum() > 0 for n in experts + routers)
    for name, ref_grad in ref_grads.items():
        assert _rel(grads[name], ref_grad) <= 1e-5, name


# --------------------------------------------------------------------------- LoRA on the experts
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_experts_equals_peft(family, fused, monkeypatch):
    """PEFT's own path (delta weights through a parametrization, transformers' experts) against the
    factors inside the grouped GEMMs: loss and every LoRA gradient, and no delta weight folded in; with
    the separate gather/combine passes and with the permutation fused into the GEMMs."""
    register()
    monkeypatch.setattr(fused_switch_module, "_ENABLED", [fused])
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=EXPERT_LORA, init_lora_weights=False
    )
    peft_model = get_peft_model(tiny(family, seed=2), config).train()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    folds = []
    register_parametrization = nn.utils.parametrize.register_parametrization
    monkeypatch.setattr(
        nn.utils.parametrize,
        "register_parametrization",
        lambda *args, **kwargs: folds.append(args[1]) or register_parametrization(*args, **kwargs),
    )

    def run():
        folds.clear()
        peft_model.zero_grad(set_to_none=True)
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}

    loss_ref, grads_ref = run()
    assert folds  # PEFT folded its delta weights
    report = apply_experts(peft_model)
    assert report.lora or report.blocks  # Llama 4's block reads the factors itself
    loss, grads = run()
    assert folds == []
    assert _rel(loss, loss_ref) <= 1e-5
    assert sum(".experts." in n for n in grads) >= 4  # A and B of gate_up_proj and down_proj
    for name, grad in grads_ref.items():
        assert grad.abs().sum() > 0, name
        assert _rel(grads[name], grad) <= 1e-5, name


# ------------------------------------------------------------------------------------- routers
def _router_case(family: str):
    model = tiny(family)
    layer = model.model.layers[-1]
    block = getattr(layer, "mlp", None) or layer.feed_forward
    router = getattr(block, "gate", None) or block.router
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    return model, block, router, x


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama4_text"])
def test_routers_equal_transformers(family):
    model, block, router, x = _router_case(family)
    logits, weights, index = router(x)
    ours_weights, ours_index = ROUTERS[family](logits.float(), block.experts.config, router)
    assert torch.equal(ours_index.sort(-1).values, index.sort(-1).values)
    order = lambda w, i: w.gather(1, i.argsort(-1))  # noqa: E731  (transformers' k order may differ)
    torch.testing.assert_close(
        order(ours_weights, ours_index), order(weights.float(), index), rtol=1e-6, atol=0
    )
    report = apply_experts(model)
    assert report.routers
    got = router(x)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[2].sort(-1).values, index.sort(-1).values)


def test_llama4_router_equals_transformers_scores():
    model, block, router, x = _router_case("llama4_text")
    scores, logits = router(x)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
    weights, index = ROUTERS["llama4_text"](logits.float(), model.config)
    dense = torch.zeros_like(scores).scatter_(1, index, weights)
    torch.testing.assert_close(dense, scores, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_group_limited_routing_limits_and_scales(family):
    """The rule is not vacuous here: the group limit and the correction bias change some tokens'
    experts, and the weights are the uncorrected sigmoid scores times routed_scaling_factor."""
    model, block, router, x = _router_case(family)
    config = block.experts.config
    logits = F.linear(x, router.weight)
    weights, index = ROUTERS[family](logits, config, router)
    scores = logits.sigmoid()
    plain = torch.topk(scores, config.num_experts_per_tok, dim=-1).indices
    corrected = torch.topk(
        scores + router.e_score_correction_bias, config.num_experts_per_tok, dim=-1
    ).indices
    groups = index // (config.n_routed_experts // config.n_group)
    assert (groups[:, :, None] != torch.arange(config.n_group)).all(1).sum(1).min() >= 1  # masked groups
    assert not torch.equal(index.sort(-1).values, plain.sort(-1).values)
    assert not torch.equal(index.sort(-1).values, corrected.sort(-1).values)  # the group limit bites
    expected = scores.gather(1, index)
    if config.norm_topk_prob:
        expected = expected / (expected.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, expected * config.routed_scaling_factor)


def test_group_limited_routing_rejects_a_bad_grouping():
    from lightning_sloth.moe.routing import route_sigmoid_group_topk

    with pytest.raises(ValueError, match="n_group \\(3\\) to divide the 8 experts"):
        route_sigmoid_group_topk(torch.randn(4, 8), 2, torch.zeros(8), 3, 2, True, 1.0)


# -------------------------------------------------------------------------------------- QLoRA
def test_qlora_nf4_deepseek_v3_equals_peft_on_the_dequantised_weights():
    """``SlothPrecision(quantize="nf4")`` on DeepSeek-V3 (linear layers and experts in 4 bits) with
    LoRA on attention and experts, packed, against PEFT + transformers on the dequantised weights,
    each document alone."""
    from lightning_sloth import SlothPrecision
    from lightning_sloth.quant import dequantize_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj", "o_proj"], target_parameters=EXPERT_LORA,
        init_lora_weights=False,
    )  # fmt: skip
    ours = get_peft_model(tiny("deepseek_v3", seed=4), config).train()
    SlothPrecision("32-true", quantize="nf4").convert_module(ours)
    experts = ours.base_model.model.model.layers[1].mlp.experts.get_base_layer()
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.down_proj.dtype == torch.uint8
    reference = copy.deepcopy(ours)
    assert len(dequantize_model(reference)) > 2
    reference.base_model.model.set_experts_implementation("eager")
    transform_model(ours, kernels=True)
    docs = random_documents(LENGTHS, seed=5, vocab=VOCAB)
    batch = packed_batch(docs, pad_to=PAD_TO)
    loss = ours(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    ref_loss = sum(_doc_loss_sum(reference, doc) for doc in docs) / batch.num_target_tokens
    ref_loss.backward()
    assert _rel(loss, ref_loss) <= 1e-5
    grads, ref_grads = _grads(ours), _grads(reference)
    assert grads.keys() == ref_grads.keys() and sum(".experts." in n for n in grads) == 4
    for name, ref_grad in ref_grads.items():
        assert _rel(grads[name], ref_grad) <= 1e-5, name


# ------------------------------------------------------------------------------- whole block
def test_deepseek_v3_block_compiles_fullgraph_with_the_same_result():
    """Router (group-limited, float32), grouping, grouped GEMMs and shared experts trace as one graph:
    nothing in them reads a device value on the host."""
    register()
    model = tiny("deepseek_v3").train()
    apply_experts(model)
    block = model.model.layers[1].mlp
    x = torch.randn(1, 13, 32, requires_grad=True)
    grad = torch.randn(1, 13, 32)
    expected = block(x)
    expected_grads = torch.autograd.grad(expected, [x, *block.parameters()], grad)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grads = torch.autograd.grad(out, [x, *block.parameters()], grad)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_moe_false_gives_transformers_blocks_back():
    model = tiny("llama4_text")
    block = model.model.layers[1].feed_forward
    report = transform_model(model, packed_attention=False, gradient_checkpointing=False)
    assert report.experts.blocks == ["model.layers.1.feed_forward"] and "forward" in block.__dict__
    report = transform_model(model, packed_attention=False, gradient_checkpointing=False, moe=False)
    assert "forward" not in block.__dict__ and report.experts.blocks == []


def test_qwen3_5_moe_multimodal_wrapper_finds_its_text_experts():
    """The released Qwen3.5-MoE class (``qwen3_5_moe``, vision + text) routes its text experts by the
    ``qwen3_5_moe_text`` row."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = {k: v for k, v in {**_COMMON, **CONFIGS["qwen3_5_moe_text"]}.items() if k != "attn_implementation"}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
        spatial_merge_size=1, temporal_patch_size=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(
        Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    ).eval()
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("eager")
    report = apply_experts(model)
    assert report.model_type == "qwen3_5_moe" and report.implementation == "sloth"
    assert len(report.experts) == 2 and len(report.routers) == 2
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert _rel(model(input_ids=ids).logits, reference(input_ids=ids).logits) <= 1e-5


# ------------------------------------------------------------------------- Llama 4's row checks
@pytest.mark.parametrize(
    "overrides",
    [
        # layer 1 without RoPE, its query temperature moving off 1 at row position floor_scale - 1
        dict(no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=16),
        # chunked attention with chunks shorter than the longest document (17)
        dict(attention_chunk_size=16),
        # the same layers on a row whose positions they do not change
        dict(no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=64),
    ],
)
def test_llama4_layers_that_depend_on_the_row_position_equal_each_document_alone(overrides):
    """Llama 4's temperature-tuned NoPE layers and its chunked attention count positions from each
    document's start on a packed row, as the document run alone does."""
    docs = random_documents(LENGTHS, seed=6, vocab=VOCAB)
    batch = packed_batch(docs, pad_to=PAD_TO)
    model = tiny("llama4_text", **overrides)
    reference = copy.deepcopy(model)
    transform_model(model, gradient_checkpointing=False)
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits[0]
        start = 0
        for doc in docs:
            alone = reference(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(logits[start : start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc)


# ----------------------------------------------------------------------------- bench scenarios
@pytest.mark.parametrize("scenario", ["qwen3_5_moe_8l", "deepseek_v3_4l"])
def test_bench_scenarios_build_at_their_shapes_with_every_lora_target_found(scenario):
    """The GPU scenarios' inline configs build (on the meta device) as the family's causal LM, and
    every LoRA target of the scenario names modules (or expert parameters) of it."""
    from pathlib import Path

    import yaml
    from peft.tuners.tuners_utils import check_target_module_exists

    from lightning_sloth.bench.workload import SHAPE_LORA, register_scenario, shape_config

    path = Path(__file__).resolve().parents[1] / "conf" / "bench" / "scenario" / f"{scenario}.yaml"
    workload = register_scenario(yaml.safe_load(path.read_text()))
    config = shape_config(workload.shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert config.model_type in ("qwen3_5_moe_text", "deepseek_v3") and workload.tokens_per_step == 16384
    lora = SHAPE_LORA[workload.shape]
    names = [name for name, _ in model.named_modules()]
    for target in lora["target_modules"]:
        single = LoraConfig(target_modules=[target])
        assert any(check_target_module_exists(single, name) for name in names), target
    params = {name for name, p in model.named_parameters() if p.dim() == 3}
    for target in lora["target_parameters"]:
        assert any(name.endswith(target) for name in params), target
    with pytest.raises(ValueError, match="unknown lora keys"):
        register_scenario({"name": "x", "shape": "tiny", "lora": {"target_module": ["q_proj"]}})
