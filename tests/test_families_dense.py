"""The 2026 families in the table (dense, hybrid linear attention, and the attention side of the hybrid
MoE families): one packed row through ``transform_model(model, kernels=True)`` equals each document
run alone through the unmodified transformers model — loss and the gradient of every parameter, all
parameters trainable — with the family's ops installed and every absent op explained in the report;
LoRA through the fused op; QLoRA on a new dense family; an unknown family's one INFO line.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from _families import CASES, LINEAR_ATTENTION_FAMILIES, VOCAB, tiny
from _models import packed_batch, random_documents

from lightning_sloth import transform_model
from lightning_sloth.patching import FAMILIES, OPS, KernelSettings, apply_kernels
from lightning_sloth.patching import _forwards as forwards

# A one-token document, one longer than the sliding windows (6) and Llama 4's attention chunk (8),
# and a padding segment at the end.
LENGTHS = [9, 1, 17, 6]
PAD_TO = 40


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    forwards._log_once.cache_clear()
    yield
    torch.set_num_threads(threads)


def _document_loss_sum(model, doc: list[int]) -> torch.Tensor:
    tokens = torch.tensor([doc])
    logits = model(input_ids=tokens).logits[0]
    return F.cross_entropy(logits[:-1].double(), tokens[0, 1:], reduction="sum")


def _assert_packed_matches_documents(packed_model, reference, docs, rtol=1e-5, pad_to=PAD_TO):
    batch = packed_batch(docs, pad_to=pad_to)
    loss = packed_model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    ref_loss = sum(_document_loss_sum(reference, doc) for doc in docs) / batch.num_target_tokens
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=rtol, atol=0)
    grads = {n: p.grad for n, p in packed_model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys()
    checked = 0
    for name, ref_grad in ref_grads.items():
        if ref_grad is None:  # a parameter no document reaches (an expert no token was routed to)
            assert grads[name] is None or not grads[name].any(), name
            continue
        scale = ref_grad.abs().max().item()
        torch.testing.assert_close(grads[name], ref_grad, rtol=rtol, atol=rtol * scale, msg=name)
        checked += 1
    assert checked >= 0.9 * len(ref_grads)


@pytest.mark.parametrize("model_type", list(CASES))
def test_packed_row_matches_each_document_alone(model_type):
    reference = tiny(model_type)
    model = copy.deepcopy(reference)
    report = transform_model(model, kernels=True, moe=False).kernels

    expected = {op: 0 for op in OPS} | CASES[model_type][2]
    assert report.supported and report.counts == expected
    assert set(report.installed) - {"lora"}, "at least one sloth op"
    assert all(report.skipped[op] for op in OPS if not report.counts[op]), report.skipped
    _assert_packed_matches_documents(model, reference, random_documents(LENGTHS, seed=1, vocab=VOCAB))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_the_gated_norm_op_matches_each_document_alone(model_type):
    """By default the gated RMSNorm after the delta rule runs ``sloth::rms_norm_gated``; the packed
    row still equals each document alone, every gradient included. Switched off, the report says so
    and the rest is patched as before."""
    reference = tiny(model_type)
    off = transform_model(copy.deepcopy(reference), kernels={"rms_norm_gated": False}, moe=False).kernels
    assert off.counts["rms_norm_gated"] == 0 and off.skipped["rms_norm_gated"] == "switched off"
    model = copy.deepcopy(reference)
    report = transform_model(model, kernels=True, moe=False).kernels
    gated_layers = model.config.layer_types.count("linear_attention")
    assert report.counts == off.counts | {"rms_norm_gated": gated_layers} and gated_layers
    assert all(name.endswith("linear_attn.norm") for name in report.modules["rms_norm_gated"])
    from test_quant_training import _OpNames  # the ops dispatched in a block

    with _OpNames() as names:
        _assert_packed_matches_documents(model, reference, random_documents(LENGTHS, seed=1, vocab=VOCAB))
    # the forward and the checkpointed layer's recompute; one backward
    assert names.count("sloth.rms_norm_gated.default") == 2 * gated_layers
    assert names.count("sloth.rms_norm_gated_backward.default") == gated_layers


@pytest.mark.parametrize("model_type", ["gemma4_text", "llama4_text", "phi3"])
def test_many_short_documents_take_sdpa_in_query_tiles(model_type, monkeypatch):
    """A row of many short documents (SDPA in query tiles against the keys they reach: global,
    sliding-window and chunked layers) equals each document alone."""
    from lightning_sloth.attention import masked

    lengths = torch.randint(1, 12, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    pad_to = sum(lengths) + 5
    assert masked.band_reach(pad_to, max(lengths), None, None) is not None
    reference = tiny(model_type)
    model = copy.deepcopy(reference)
    transform_model(model, kernels=True, moe=False)
    tiled = []
    banded = masked._sdpa_banded
    monkeypatch.setattr(masked, "_sdpa_banded", lambda *a: tiled.append(a[-2:]) or banded(*a))
    docs = random_documents(lengths, seed=8, vocab=VOCAB)
    # 48 documents' float32 sums: Gemma 4's scaled embedding gradient differs from the per-document
    # one by 3.6e-5 of its largest entry, with the whole-row mask as with the tiles.
    _assert_packed_matches_documents(model, reference, docs, rtol=5e-5, pad_to=pad_to)
    assert tiled, "no layer took the tiles"


@pytest.mark.parametrize("model_type", LINEAR_ATTENTION_FAMILIES)
def test_linear_attention_keeps_documents_apart(model_type):
    """Changing one document changes nothing of the others' outputs (the conv and the delta-rule state
    restart at every boundary); the packed model without the op is refused by transformers."""
    model = tiny(model_type).eval()
    refused = copy.deepcopy(model)
    transform_model(model, kernels=True, moe=False, gradient_checkpointing=False)
    docs = random_documents(LENGTHS, seed=2, vocab=VOCAB)
    edited = copy.deepcopy(docs)
    edited[0] = random_documents([LENGTHS[0]], seed=99, vocab=VOCAB)[0]
    with torch.no_grad():
        before = model(**packed_batch(docs, pad_to=PAD_TO).model_inputs()).logits[0]
        after = model(**packed_batch(edited, pad_to=PAD_TO).model_inputs()).logits[0]
    assert (before[:9] - after[:9]).abs().max() > 1e-2
    torch.testing.assert_close(after[9:], before[9:], rtol=0, atol=1e-6)

    transform_model(refused, kernels=KernelSettings(linear_attention=False), moe=False)
    with pytest.raises(ValueError, match="packed sequences apart"):
        refused(**packed_batch(docs, pad_to=PAD_TO).model_inputs())


@pytest.mark.parametrize(
    ("model_type", "targets"),
    [
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("gemma4_text", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("qwen3_5_text", ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                          "gate_proj", "up_proj", "down_proj"]),
    ],
)  # fmt: skip
def test_lora_through_the_fused_op_matches_unpatched(model_type, targets):
    from peft import LoraConfig, get_peft_model

    reference = get_peft_model(tiny(model_type), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    model = copy.deepcopy(reference)
    report = transform_model(model, kernels=True, moe=False).kernels
    assert report.counts["lora"] == sum(1 for n, _ in reference.named_modules() if n.endswith(tuple(targets)))
    _assert_packed_matches_documents(model, reference, random_documents(LENGTHS, seed=3, vocab=VOCAB))


# A row names a class under each transformers release's name; the tiny model has one of the pair.
RENAMED = {
    "Llama4TextL2Norm": "Llama4TextWeightlessRMSNorm",
    "Llama4TextWeightlessRMSNorm": "Llama4TextL2Norm",
}


def test_every_new_family_has_a_table_row_with_its_classes():
    for model_type in CASES:
        family = FAMILIES[model_type]
        model = tiny(model_type)
        names = {type(m).__name__ for m in model.modules()}
        for column in ("norms", "mlps", "attentions", "causal_lms", "linear_attentions"):
            for cls in getattr(family, column):
                assert cls in names or RENAMED.get(cls) in names, (model_type, column, cls)


def test_unknown_family_trains_on_transformers_modules_with_one_info_line(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with caplog.at_level(logging.INFO, logger="lightning_sloth.patching._apply"), pytest.warns(UserWarning):
        report = apply_kernels(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_sloth.patching._apply"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("lightning_sloth kernels: gpt2: nothing; not patched: ")
    for op in OPS:
        assert f"{op} (" in lines[0], op
    assert report.skipped["rms_norm"] == "no table row for 'gpt2'"
    assert report.skipped["lora"] == "no PEFT lora.Linear layer in the model"
    assert not report.supported and report.installed == ()


def test_each_absent_op_is_said_in_the_report_line(caplog):
    model = tiny("olmo2")
    with caplog.at_level(logging.INFO, logger="lightning_sloth.patching._apply"):
        report = apply_kernels(model)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "lightning_sloth.patching._apply"]
    assert "add_rms_norm (post-norm decoder layers" in line
    assert "linear_attention (the table lists no linear-attention layers for this family)" in line
    assert report.installed == ("rms_norm", "rope", "glu", "cross_entropy")


def test_qlora_trains_a_new_dense_family_through_the_trainer():
    from _trainer import fit_recording_losses
    from lightning.pytorch import seed_everything

    from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision
    from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
    from lightning_sloth.hf_model import find_hf_model
    from lightning_sloth.quant import Linear4bit

    seed_everything(0)
    tokenizer = build_char_tokenizer()
    model = tiny("olmo2", vocab_size=len(tokenizer), initializer_range=0.02)
    data = PackedDataModule(tokenizer, train=SyntheticTask(64, seed=1), max_tokens=256)
    module = CausalLMModule(model, lora=LoraSettings(r=8), optimizer=OptimizerSettings(lr=2e-2))
    losses = fit_recording_losses(module, data, SlothPrecision("32-true", quantize="nf4"), max_steps=8)
    hf = find_hf_model(module)
    assert sum(isinstance(m, Linear4bit) for m in hf.modules()) == 14  # 7 projections x 2 layers
    assert forwards.patched_op(hf.model.layers[0].self_attn.q_norm) == "rms_norm"
    assert forwards.patched_op(hf.model.layers[0].self_attn) == "rope"
    assert sum(losses[-2:]) < sum(losses[:2])


def test_attention_width_counts_softmax_layers_with_their_own_head_dims():
    from lightning_sloth.attention import attention_width

    gemma = tiny("gemma4_text").config  # reading config.head_dim raises for Gemma 4
    assert attention_width(gemma) == 4 * 16 + 4 * 32  # a sliding layer of 16, a global one of 32
    assert attention_width(tiny("qwen3_5_text").config) == 4 * 16  # the linear-attention layer counts 0
    assert attention_width(tiny("phi3").config) == 2 * 4 * 16


def test_the_norm_reads_eps_under_either_name():
    """transformers 5.25 renamed Gemma 4's and Llama 4's ``eps`` to ``variance_epsilon``."""
    from lightning_sloth.patching._forwards import norm_eps

    old, new = torch.nn.Module(), torch.nn.Module()
    old.eps, new.variance_epsilon = 1e-5, 1e-6
    assert norm_eps(old, "eps") == 1e-5 and norm_eps(new, "eps") == 1e-6
