"""apply_kernels: per-family parity with the unpatched model, report, switches, idempotence, fallbacks."""

from __future__ import annotations

import copy
import logging
import warnings
from unittest import mock

import _models  # tests/_models.py: tests/ is on sys.path through tests/conftest.py
import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from test_quant_training import _OpNames  # the ops dispatched in a block

from lightning_sloth.patching import FAMILIES, OPS, KernelSettings, apply_kernels, unpatch
from lightning_sloth.patching import _forwards as forwards

VOCAB = _models.VOCAB
_COMMON = dict(
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
)
_WINDOWED = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.05, output_router_logits=True)

# model_type -> (config class, config overrides, attention implementation, expected report counts).
# Counts are per 2 layers: Gemma has 4 norms per layer, Qwen3/Gemma 3 add per-head q/k norms.
FAMILY_CASES = {
    "llama": ("LlamaConfig", {}, "sdpa", dict(rms_norm=5, rope=2, glu=2, add_rms_norm=2)),
    "mistral": (
        "MistralConfig",
        {"sliding_window": 8},
        "sdpa",
        dict(rms_norm=5, rope=2, glu=2, add_rms_norm=2),
    ),
    "qwen2": ("Qwen2Config", {}, "sdpa", dict(rms_norm=5, rope=2, glu=2, add_rms_norm=2)),
    "qwen3": ("Qwen3Config", {}, "sdpa", dict(rms_norm=9, rope=2, glu=2, add_rms_norm=2)),
    "gemma2": (
        "Gemma2Config",
        dict(_WINDOWED, final_logit_softcapping=3.0, attn_logit_softcapping=20.0, query_pre_attn_scalar=16),
        "eager",
        dict(rms_norm=9, rope=2, glu=2),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(_WINDOWED, query_pre_attn_scalar=16),
        "eager",
        dict(rms_norm=13, rope=2, glu=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(_MOE, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1]),
        "sdpa",
        dict(rms_norm=9, rope=2, glu=1, add_rms_norm=2),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(_MOE, num_local_experts=4),
        "sdpa",
        dict(rms_norm=5, rope=2, glu=0, add_rms_norm=2),
    ),
    "gpt_oss": (
        "GptOssConfig",
        {**_MOE, **_WINDOWED, "num_local_experts": 4, "intermediate_size": 32},
        "eager",
        dict(rms_norm=5, rope=2, glu=0),
    ),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    forwards._log_once.cache_clear()
    yield
    torch.set_num_threads(threads)


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Random float32 causal LM of the family, with every norm weight moved off its init value."""
    config_name, config_overrides, attn, _ = FAMILY_CASES[model_type]
    config = getattr(transformers, config_name)(**{**_COMMON, **config_overrides, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "sinks" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.train()


def batch(seed: int = 1, shape: tuple[int, int] = (2, 12)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, shape, generator=gen)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, 5] = -100
    return dict(input_ids=input_ids, labels=labels)


def lora(model: torch.nn.Module, seed: int = 0, **config) -> torch.nn.Module:
    """PEFT LoRA on the projections the model has, with non-zero random lora_B."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in names]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return peft_model


def loss_and_grads(model: torch.nn.Module, inputs: dict, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return out.loss.detach(), grads


def assert_same_training_step(patched, reference, inputs=None, **kwargs) -> None:
    inputs = batch() if inputs is None else inputs
    loss, grads = loss_and_grads(patched, inputs, **kwargs)
    ref_loss, ref_grads = loss_and_grads(reference, inputs, **kwargs)
    assert torch.isfinite(ref_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        assert scale > 0, f"{name} has a zero gradient: the test would not see it"
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("model_type", list(FAMILY_CASES))
def test_full_finetune_matches_unpatched(model_type):
    model = tiny_model(model_type)
    reference = copy.deepcopy(model)
    # With the opt-in add_rms_norm on: the LoRA test below covers the default set.
    report = apply_kernels(model, KernelSettings(lora=False, add_rms_norm=True))

    expected = {
        "add_rms_norm": 0,
        "linear_attention": 0,
        "rms_norm_gated": 0,
        "mla": 0,
        **FAMILY_CASES[model_type][3],
        "cross_entropy": 1,
        "lora": 0,
    }
    assert report.supported and report.model_type == model_type
    assert report.counts == {op: expected[op] for op in OPS}
    assert report.modules["cross_entropy"] == [""]  # the causal LM itself
    assert_same_training_step(model, reference)
    assert model(**batch()).logits is None  # the fused loss never builds them


@pytest.mark.parametrize("model_type", list(FAMILY_CASES))
def test_lora_matches_unpatched(model_type):
    model = lora(tiny_model(model_type))
    reference = copy.deepcopy(model)
    report = apply_kernels(model, KernelSettings())

    # peft adapts MoE experts' projections through target_parameters, not as lora.Linear modules.
    # Projections with a bias (Qwen2's q/k/v, GPT-OSS attention) fuse too, the bias added after.
    lora_linears = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(lora_linears) >= 2 * 4
    assert report.counts["lora"] == len(lora_linears) and "lora" not in report.skipped
    assert all(".lora_" not in name for name in report.modules["lora"])
    assert_same_training_step(model, reference)


def test_mlp_backward_reuses_its_buffers_and_respects_down_proj_hooks():
    """The patched MLP's activation and down_proj write their input gradients in place; a hook on
    down_proj makes it a plain module call again (the hook runs, the result is the same)."""
    model = lora(tiny_model("llama"))
    reference = copy.deepcopy(model)
    apply_kernels(model, KernelSettings())
    mlp = model.get_base_model().model.layers[0].mlp
    calls = []
    with (
        _OpNames() as names,
        mock.patch(
            "lightning_sloth.patching._forwards.fused_lora_forward", wraps=forwards.fused_lora_forward
        ) as fused,
    ):
        assert_same_training_step(model, reference)
    glu_calls = names.count("sloth.swiglu.default")
    assert glu_calls and names.count("sloth.swiglu_backward_.default") == glu_calls  # in place
    assert names.count("sloth.swiglu_backward.default") == 0
    assert sum(bool(call.kwargs.get("overwrite_input")) for call in fused.call_args_list) == glu_calls
    handle = mlp.down_proj.register_forward_hook(lambda module, args, out: calls.append(module))
    assert_same_training_step(model, reference)
    handle.remove()
    assert calls and all(module is mlp.down_proj for module in calls)


def test_packed_batch_with_num_items_matches_unpatched():
    """The user path: a LightningModule-like holder, a PackedBatch, a gradient-accumulation denominator."""
    model = lora(tiny_model("llama"))
    reference = copy.deepcopy(model)
    report = apply_kernels(torch.nn.ModuleDict({"model": model}))  # as SlothStrategy hands it over
    assert report.model_type == "llama" and report.counts["lora"] == 14
    packed = _models.packed_batch(_models.random_documents([5, 9, 4], seed=3), pad_to=20)
    inputs = dict(packed.model_inputs(), labels=packed.labels)
    assert_same_training_step(model, reference, inputs, num_items_in_batch=torch.tensor(31))


def test_without_labels_the_logits_are_unchanged():
    model = tiny_model("gemma2")
    reference = copy.deepcopy(model)
    apply_kernels(model)
    input_ids = batch()["input_ids"]
    torch.testing.assert_close(model(input_ids=input_ids).logits, reference(input_ids=input_ids).logits)


def test_return_dict_false_gives_a_tuple_without_logits():
    model = tiny_model("mixtral")
    reference = copy.deepcopy(model)
    apply_kernels(model)
    loss, aux_loss, *_ = model(**batch(), return_dict=False)
    ref = reference(**batch(), return_dict=False)
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(aux_loss, ref[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_each_switch_leaves_its_modules_unpatched(op):
    model = lora(tiny_model("qwen3"))
    reference = copy.deepcopy(model)
    everything = dict.fromkeys(OPS, True)
    apply_kernels(model, everything)  # all on first: switching off must also undo
    report = apply_kernels(model, KernelSettings(**{**everything, op: False}))

    assert report.counts[op] == 0 and report.skipped[op] == "switched off"
    # Qwen3 has no linear or latent attention, nor the gated norm after a delta rule
    present = set(OPS) - {"linear_attention", "rms_norm_gated", "mla"}
    assert all(report.counts[other] > 0 for other in present if other != op)
    patched = {forwards.patched_op(m) for m in model.modules()} - {None}
    assert patched == present - {op}
    assert_same_training_step(model, reference)


def test_patching_twice_is_idempotent():
    model = lora(tiny_model("llama"))
    reference = copy.deepcopy(model)
    first = apply_kernels(model)
    installed = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    second = apply_kernels(model)

    assert (first.modules, first.skipped) == (second.modules, second.skipped)
    for name, m in model.named_modules():
        again = m.__dict__.get("forward")
        assert (again is None) == (installed[name] is None)
        if again is not None:
            assert again.__func__ is installed[name].__func__
    assert_same_training_step(model, reference)


def test_other_models_and_classes_are_untouched():
    from transformers.models.llama import modeling_llama

    stock_rope, stock_forward = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaAttention.forward
    patched, other = tiny_model("llama"), tiny_model("llama", seed=1)
    apply_kernels(patched)

    assert modeling_llama.apply_rotary_pos_emb is stock_rope
    assert modeling_llama.LlamaAttention.forward is stock_forward
    assert all("forward" not in m.__dict__ for m in other.modules())
    assert patched.state_dict().keys() == other.state_dict().keys()
    assert other(**batch()).logits is not None


def test_unpatch_restores_the_class_forwards():
    model = lora(tiny_model("gemma3_text"))
    report = apply_kernels(model)
    assert unpatch(model) == sum(report.counts.values())
    assert all(forwards.patched_op(m) is None for m in model.modules())


def test_unsupported_architecture_warns_once_and_trains():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = apply_kernels(model)
    ours = [w for w in caught if "lightning_sloth" in str(w.message)]
    assert len(ours) == 1 and "'gpt2'" in str(ours[0].message)
    assert not report.supported and sum(report.counts.values()) == 0
    assert_same_training_step(model, reference)


def test_unsupported_activation_leaves_the_mlp():
    model = tiny_model("llama", hidden_act="gelu")
    reference = copy.deepcopy(model)
    report = apply_kernels(model)
    assert report.counts["glu"] == 0 and "hidden_act='gelu'" in report.skipped["glu"]
    assert report.counts["rms_norm"] == 5
    assert_same_training_step(model, reference)


def test_lora_fallback_is_logged_once_and_exact(caplog):
    # Dropout is outside the fused op's plain case; in eval mode it is the identity, so the
    # fallback's result is comparable.
    model = lora(tiny_model("qwen2"), lora_dropout=0.1).eval()
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger=forwards.__name__):
        report = apply_kernels(model)
        assert report.counts["lora"] == 0 and report.skipped["lora"].startswith("14 lora.Linear")
        assert_same_training_step(model, reference)
        assert_same_training_step(model, reference)
    assert sum("fused LoRA" in r.getMessage() for r in caplog.records) == 1


def test_custom_loss_function_falls_back_to_the_full_logits(caplog):
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    apply_kernels(model)
    model.loss_function = reference.loss_function = transformers.loss.loss_utils.ForMaskedLMLoss
    with caplog.at_level(logging.WARNING, logger=forwards.__name__):
        out = model(**batch())
    assert out.logits is not None and "custom loss_function" in caplog.text
    torch.testing.assert_close(out.loss, reference(**batch()).loss)


def test_kernel_settings_forms():
    assert KernelSettings.coerce(True) == KernelSettings()
    assert KernelSettings().enabled() == OPS  # every op by default
    assert "rms_norm_gated" not in KernelSettings.coerce({"rms_norm_gated": False}).enabled()
    assert "add_rms_norm" not in KernelSettings.coerce({"add_rms_norm": False}).enabled()
    assert KernelSettings.coerce(None).enabled() == ()
    assert KernelSettings.coerce(["rope", "lora"]).enabled() == ("rope", "lora")
    assert KernelSettings.coerce({"glu": False}) == KernelSettings(glu=False)
    with pytest.raises(ValueError, match="unknown kernel op"):
        KernelSettings.coerce(["rmsnorm"])
    with pytest.raises(TypeError, match="must be a bool"):
        KernelSettings(rope="yes")
    with pytest.raises(TypeError, match="kernel settings must be"):
        KernelSettings.coerce(3)
    with pytest.raises(TypeError, match="nn.Module"):
        apply_kernels("llama")


@pytest.mark.parametrize("model_type", list(FAMILY_CASES))
def test_norm_rounding_order_in_bfloat16(model_type):
    """bf16 shows the cast order that float32 hides (GPT-OSS's one rounding without offset included)."""
    family = FAMILIES[model_type]
    (norm_class,) = family.classes(family.norms)
    norm = norm_class(48, 1e-5).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48) * 2)
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16) * 3
    expected = norm(x)
    forwards.install(norm, forwards.rms_norm_forward(family.norm_style))
    torch.testing.assert_close(norm(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("model_type", "with_lora"), [("llama", True), ("qwen3", False), ("gemma2", True), ("gpt_oss", False)]
)
def test_bf16_autocast_is_as_close_to_float32_as_transformers(model_type, with_lora):
    """bf16-mixed: float32 weights, bf16 matmuls; the ops meet mixed dtypes (fp32 norms, bf16 q/k)."""
    model = tiny_model(model_type)
    model = lora(model) if with_lora else model
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    apply_kernels(ours)
    ref_loss, ref_grads = loss_and_grads(model, batch())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        their_loss, their_grads = loss_and_grads(theirs, batch())
        our_loss, our_grads = loss_and_grads(ours, batch())

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert abs(our_loss - ref_loss) <= 1e-2 * ref_loss
    for name, expected in ref_grads.items():
        assert rel(our_grads[name], expected) <= max(2 * rel(their_grads[name], expected), 2e-2), name
