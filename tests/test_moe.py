"""lightning_sloth.moe in whole models: parity with transformers' eager experts, LoRA on the experts
against PEFT's own path (and its saved adapter), edge cases, the strategy switch, packed batches and
the expert-load callback. Tiny float32/float64 models of the three families, on CPU.
"""

from __future__ import annotations

import copy
import re

import _processes
import pytest
import torch
import torch.nn.functional as F
from _models import packed_batch, random_documents
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lightning_sloth.moe import ENDS_ATTR, counts_from_ends, experts_forward, group_by_expert, register
from lightning_sloth.moe.routing import ROUTERS
from lightning_sloth.patching import apply_experts, apply_kernels, moe_families
from lightning_sloth.plugins import ExpertLoadMonitor
from lightning_sloth.transform import transform_model

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
    initializer_range=0.2,
)
EXPERT_LORA = ["experts.gate_up_proj", "experts.down_proj"]


def tiny_moe(family: str, seed: int = 0, experts: int = 6, top_k: int = 2, **overrides) -> nn.Module:
    """Random-weight float32 MoE causal LM, hidden 32, 2 layers, eval mode."""
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **_COMMON, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=24,
            intermediate_size=48, norm_topk_prob=True, **overrides,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    elif family == "mixtral":
        config = MixtralConfig(
            **_COMMON, num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=24, **overrides
        )
        model = MixtralForCausalLM(config)
    else:
        common = {**_COMMON, "attn_implementation": "eager"}  # no SDPA path for attention sinks
        config = GptOssConfig(
            **common, num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=24, **overrides
        )
        model = GptOssForCausalLM(config)
        with torch.no_grad():  # transformers initialises GPT-OSS experts and sinks small; spread them
            for name, param in model.named_parameters():
                if "experts" in name or "router" in name:
                    param.normal_(0.0, 0.3)
    return model.float().eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _loss_and_grads(model, ids, impl):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_loss_and_every_gradient_match_eager_experts(family):
    register()
    model = tiny_moe(family).train()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    loss_ref, grads_ref = _loss_and_grads(model, ids, "eager")
    loss, grads = _loss_and_grads(model, ids, "sloth")
    assert _rel(loss, loss_ref) <= 1e-5
    assert grads.keys() == grads_ref.keys()
    routers = [n for n in grads if ".gate." in n or ".router." in n]
    assert routers and all(grads[n].abs().sum() > 0 for n in routers)  # the router trains
    for name, grad in grads_ref.items():
        assert _rel(grads[name], grad) <= 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_auxiliary_loss_with_router_logits_matches_transformers(family):
    """The fused-loss forward adds the family's load-balancing loss exactly as transformers does."""
    register()
    model = tiny_moe(family, output_router_logits=True, router_aux_loss_coef=0.1)
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids)
    patched = copy.deepcopy(model)
    apply_kernels(patched)
    apply_experts(patched)
    with torch.no_grad():
        got = patched(input_ids=ids, labels=ids)
    assert expected.aux_loss is not None and float(expected.aux_loss) > 0
    assert _rel(got.aux_loss, expected.aux_loss) <= 1e-5
    assert _rel(got.loss, expected.loss) <= 1e-5


# --------------------------------------------------------------------------------- edge cases
def _experts_case(family, index, seed=0, experts=6):
    """float64 experts module of ``family`` and routing weights for ``index``."""
    model = tiny_moe(family, experts=experts, top_k=index.shape[1]).double()
    module = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(index.shape, generator=gen, dtype=torch.float64)
    x = torch.randn(index.shape[0], 32, generator=gen, dtype=torch.float64)
    return module, x, weights


def _compare_experts(module, x, index, weights):
    results = []
    for impl in ("eager", "sloth"):
        module.config._experts_implementation = impl
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xx, index, ww)
        grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        params = list(module.parameters())
        grads = torch.autograd.grad(out, [xx, ww, *params], grad)
        results.append((out, grads))
    (out_ref, grads_ref), (out, grads) = results
    torch.testing.assert_close(out, out_ref)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "case",
    ["top_k_equals_experts", "one_token", "all_tokens_to_one_pair", "zero_token_experts"],
)
def test_edge_cases_match_eager_in_float64(family, case):
    register()
    if case == "top_k_equals_experts":
        index = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(i)) for i in range(5)])
        experts = 4
    elif case == "one_token":
        index, experts = torch.tensor([[3, 1]]), 6
    elif case == "all_tokens_to_one_pair":
        index, experts = torch.tensor([[2, 4]] * 7), 6
    else:  # experts 0 and 5 receive nothing
        index, experts = torch.tensor([[1, 2], [3, 4], [2, 1], [4, 3]]), 6
    module, x, weights = _experts_case(family, index, experts=experts)
    _compare_experts(module, x, index, weights)
    counts = counts_from_ends(getattr(module, ENDS_ATTR))
    assert counts.tolist() == torch.bincount(index.reshape(-1), minlength=experts).tolist()


def test_top_k_above_the_number_of_experts_is_a_clear_error():
    register()
    module, x, weights = _experts_case("qwen3_moe", torch.zeros(3, 2, dtype=torch.int64), experts=6)
    with pytest.raises(ValueError, match="top_k=7 .* 6 experts"):
        experts_forward(
            module, x, torch.zeros(3, 7, dtype=torch.int64), torch.ones(3, 7, dtype=torch.float64)
        )
    model = tiny_moe("mixtral", experts=4, top_k=2)
    model.config.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds the 4 experts"):
        apply_experts(model)


def test_unsupported_moe_family_names_itself_and_the_supported_list():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    model = OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        )
    )  # fmt: skip
    supported = sorted(
        ["deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text", "mixtral", "qwen2_moe", "qwen3_5_moe_text",
         "qwen3_moe", "qwen3_next"]
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"'olmoe'.*" + re.escape(str(supported))):
        apply_experts(model)
    assert moe_families() == supported
    apply_experts(model, enabled=False)  # moe=False keeps transformers' own, no error


def test_routers_match_transformers():
    for family in FAMILIES:
        model = tiny_moe(family)
        mlp = model.model.layers[0].mlp
        router = getattr(mlp, "gate", None) or mlp.router
        x = torch.randn(9, 32)
        logits, weights, index = router(x)
        ours_weights, ours_index = ROUTERS[family](logits, model.config)
        assert torch.equal(ours_index, index) and ours_weights.dtype == weights.dtype
        torch.testing.assert_close(ours_weights, weights)


# ----------------------------------------------------------------------------- strategy switch
def test_transform_model_selects_sloth_and_moe_false_keeps_transformers():
    model = tiny_moe("qwen3_moe")
    report = transform_model(model, packed_attention=False, gradient_checkpointing=False, moe=False)
    assert model.config._experts_implementation != "sloth"
    assert not any(a.startswith("moe experts") for a in report.applied)
    report = transform_model(model, packed_attention=False, gradient_checkpointing=False)
    assert model.config._experts_implementation == "sloth"
    assert "moe experts, permutation fused on CUDA" in report.applied  # the switch's default
    assert report.experts.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    transform_model(model, packed_attention=False, gradient_checkpointing=False, moe=False)
    assert model.config._experts_implementation == "grouped_mm"


# ------------------------------------------------------------------------------- LoRA on experts
def _peft_moe(family, seed=0):
    model = tiny_moe(family, seed=seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=EXPERT_LORA,
        init_lora_weights=False,
    )
    return get_peft_model(model, config)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_experts_matches_peft_target_parameters(family, monkeypatch):
    """Same adapters: PEFT's own path (delta weights through a parametrization) vs the factors in the
    grouped GEMMs; loss and every LoRA gradient, and no delta weight folded in on our path."""
    register()
    peft_model = _peft_moe(family).train()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
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

    loss_ref, grads_ref = run()  # PEFT's forward, transformers' default experts
    assert len(folds) == 4  # two parameters in each of two layers
    report = apply_experts(peft_model)
    assert len(report.lora) == 2
    loss, grads = run()
    assert folds == []  # no delta weight was folded in
    assert _rel(loss, loss_ref) <= 1e-5
    assert any("lora" in n and "experts" in n for n in grads)
    for name, grad in grads_ref.items():
        assert _rel(grads[name], grad) <= 1e-5, name


def test_saved_adapter_reproduces_the_logits_on_the_unpatched_model(tmp_path):
    register()
    peft_model = _peft_moe("qwen3_moe", seed=3).train()
    apply_experts(peft_model)
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path)

    fresh = PeftModel.from_pretrained(tiny_moe("qwen3_moe", seed=3), tmp_path).eval()
    with torch.no_grad():
        expected = fresh(input_ids=ids).logits
    assert fresh.base_model.model.config._experts_implementation != "sloth"
    assert _rel(logits, expected) <= 1e-5


# ------------------------------------------------------------------------------------- packing
def _doc_loss(logits, tokens):
    return F.cross_entropy(logits[:-1].double(), tokens[1:], reduction="mean")


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
    ],
)
def test_packed_batch_through_a_moe_model_equals_each_document_alone(family):
    model = tiny_moe(family)
    packed = copy.deepcopy(model)
    transform_model(packed, gradient_checkpointing=False)
    assert packed.config._experts_implementation == "sloth"
    lengths = [7, 1, 12, 5]
    docs = random_documents(lengths, seed=4, vocab=VOCAB)
    batch = packed_batch(docs, pad_to=30)
    with torch.no_grad():
        logits = packed(**batch.model_inputs()).logits[0]
        start = 0
        for doc in docs:
            tokens = torch.tensor(doc)
            alone = model(input_ids=tokens[None]).logits[0]
            torch.testing.assert_close(logits[start : start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            if len(doc) > 1:
                assert (
                    abs(float(_doc_loss(logits[start : start + len(doc)], tokens) - _doc_loss(alone, tokens)))
                    < 1e-5
                )
            start += len(doc)


# --------------------------------------------------------------------------------- callback
def test_expert_load_monitor_reads_the_counts_of_every_layer():
    register()
    model = tiny_moe("mixtral")
    apply_experts(model)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(input_ids=ids)
    counts = ExpertLoadMonitor.expert_counts(model)
    assert len(counts) == 2 and all(int(c.sum()) == 10 * 2 for c in counts)
    ratios = ExpertLoadMonitor.load_ratios(counts)
    expected = torch.stack([c.float().max() / c.float().mean() for c in counts])
    torch.testing.assert_close(ratios, expected)
    assert group_by_expert(torch.tensor([[0, 1]]), 6).counts.tolist() == [1, 1, 0, 0, 0, 0]


# ------------------------------------------------------------------------------------- the app
@pytest.mark.parametrize(
    ("preset", "extra"),
    [
        ("qwen3_moe_tiny", []),
        ("gpt_oss_tiny", []),
    ],
)
def test_app_trains_the_moe_presets_with_lora_on_experts(tmp_path, preset, extra):
    import json
    import os
    import sys
    from pathlib import Path

    script = str(Path(sys.executable).parent / "lightning-sloth")
    args = [
        f"model={preset}", "lora=moe_experts", "trainer=cpu_debug", "trainer.max_steps=3",
        "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", "data.num_train=32",
        "data.num_val=8", "data.max_tokens=256", f"hydra.run.dir={tmp_path}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    result = _processes.run(
        [script, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["train_loss_last"] == metrics["train_loss_last"]  # finite
    log = result.stdout + result.stderr
    assert "(2 with LoRA inside the grouped GEMMs)" in log
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == sorted(EXPERT_LORA)


def test_moe_block_compiles_fullgraph_with_the_same_result():
    """The experts path is made of torch.library ops with fake and autograd implementations, so
    Dynamo traces a whole MoE block (router, grouping, ops) in one graph."""
    register()
    model = tiny_moe("qwen3_moe").train()
    apply_experts(model)  # sloth experts and float32 routers
    block = model.model.layers[0].mlp
    x = torch.randn(1, 9, 32, requires_grad=True)
    grad = torch.randn(1, 9, 32)
    expected = block(x)
    expected_grads = torch.autograd.grad(expected, [x, *block.parameters()], grad)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grads = torch.autograd.grad(out, [x, *block.parameters()], grad)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_moe_example_runs(tmp_path):
    """examples/moe_lora.py as a user runs it (reduced step count)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "moe_lora.py"
    spec = importlib.util.spec_from_file_location("moe_lora", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = example.main(max_steps=5, out=str(tmp_path))
    assert {"train/loss", "val/loss", "moe/load_max_over_mean"} <= set(metrics)
    assert 1.0 <= metrics["moe/load_max_over_mean"] <= 8 / 2
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == sorted(EXPERT_LORA)


@pytest.mark.parametrize("family", FAMILIES)
def test_routers_get_float32_logits_with_the_family_rule(family):
    register()
    model = tiny_moe(family)
    mlp = model.model.layers[0].mlp
    router = getattr(mlp, "gate", None) or mlp.router
    x = torch.randn(9, 32)
    expected = router(x)
    report = apply_experts(model)
    assert len(report.routers) == 2
    got = router(x)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    apply_kernels(model)  # the kernels' patching leaves the routers to apply_experts
    model.to(torch.bfloat16)
    logits, weights, index = router(x.bfloat16())
    assert logits.dtype == torch.float32
    exact = F.linear(
        x.bfloat16().float(), router.weight.float(), None if family != "gpt_oss" else router.bias.float()
    )
    torch.testing.assert_close(logits, exact)
    apply_experts(model, enabled=False)
    assert router(x.bfloat16())[0].dtype == torch.bfloat16  # transformers' own router again
