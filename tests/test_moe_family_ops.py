"""The sloth ops of the Qwen2-MoE, GLM-4-MoE and DeepSeek-V3 rows, on CPU in float32.

Each family's tiny model has three layers (a dense one first, then two MoE layers with shared
experts), every parameter trainable and every norm weight moved off its init. Through
``transform_model(model, kernels=True)``: the report lists ``rms_norm`` on every RMSNorm (GLM's
per-head QK-norm and DeepSeek's MLA latent norms included) and ``rope`` on every attention of
Qwen2-MoE and GLM-4-MoE (GLM's partial rotary), and says why DeepSeek-V3 keeps transformers'
interleaved rotary; a packed row equals each document alone through the unmodified transformers
model, and an unpacked batch equals the unmodified model on the same batch (router load-balancing
loss included), in the loss and the gradient of every parameter.

On the CPU the ops run their plain-torch references (the Triton kernels are checked against the
same references in ``test_rms_norm.py`` / ``test_rope.py``, under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import packed_batch, random_documents
from test_families_moe import _COMMON as _FAMILIES_COMMON
from test_families_moe import _GROUPED, LENGTHS, PAD_TO, VOCAB, _doc_loss_sum, _rel
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_sloth.patching import FAMILIES, OPS
from lightning_sloth.patching import _forwards as forwards
from lightning_sloth.transform import transform_model

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

_COMMON = {**_FAMILIES_COMMON, "num_hidden_layers": 3}
CONFIGS = {
    # mlp_only_layers=[0]: a dense layer, then two MoE layers (gated shared expert)
    "qwen2_moe": dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
        shared_expert_intermediate_size=40, mlp_only_layers=[0],
    ),
    # partial rotary (partial_rotary_factor 0.5: 4 of 8 features rotate) and per-head QK-norm
    "glm4_moe": dict(
        head_dim=8, moe_intermediate_size=24, intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
        use_qk_norm=True, **_GROUPED,
    ),
    # MLA with q_a_layernorm and kv_a_layernorm; rope_interleave keeps its default (True)
    "deepseek_v3": dict(
        moe_intermediate_size=24, intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
        num_key_value_heads=4, **_GROUPED,
    ),
}  # fmt: skip
FAMILY_NAMES = list(CONFIGS)

# model_type -> report counts with kernels=True: 2 norms a layer (+ GLM's q/k norms, DeepSeek's
# q_a/kv_a norms) and the final norm; the dense layer's MLP and each MoE layer's shared expert.
COUNTS = {
    "qwen2_moe": dict(rms_norm=7, rope=3, glu=3, cross_entropy=1, add_rms_norm=3),
    "glm4_moe": dict(rms_norm=13, rope=3, glu=3, cross_entropy=1, add_rms_norm=3),
    "deepseek_v3": dict(rms_norm=13, glu=3, cross_entropy=1, add_rms_norm=3, mla=3),
}


def tiny(family: str, seed: int = 0, configs: dict | None = None, **overrides) -> nn.Module:
    """Random float32 causal LM of ``family`` (its entry of ``configs``, by default this file's
    :data:`CONFIGS`) in train mode, every parameter trainable, norm weights off their init and the
    score-correction biases spread so that they change the routing."""
    family_config = (CONFIGS if configs is None else configs)[family]
    config = AutoConfig.for_model(family, **{**_COMMON, **family_config, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    assert all(p.requires_grad for p in model.parameters())
    return model.train()


def _assert_same_gradients(model: nn.Module, reference: nn.Module) -> None:
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys()
    assert all(g is not None and g.abs().sum() > 0 for n, g in ref_grads.items() if "norm" in n)
    for name, ref_grad in ref_grads.items():
        if ref_grad is None:  # no token reached it
            assert grads[name] is None or not grads[name].any(), name
            continue
        assert _rel(grads[name], ref_grad) <= 1e-5, name


def _modules_of(model: nn.Module, names: tuple[str, ...]) -> set[str]:
    return {name for name, module in model.named_modules() if type(module).__name__ in names}


# ------------------------------------------------------------------------------------ the report
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_report_lists_rms_norm_and_rope_on_every_module_of_the_family(family):
    model = tiny(family)
    report = transform_model(model, kernels=True).kernels
    row = FAMILIES[family]

    assert report.counts == {op: 0 for op in OPS} | COUNTS[family]
    assert set(report.modules["rms_norm"]) == _modules_of(model, row.norms)
    assert set(report.modules["rope"]) == _modules_of(model, row.attentions)
    assert all(forwards.patched_op(model.get_submodule(n)) == "rms_norm" for n in report.modules["rms_norm"])
    assert all(report.skipped[op] for op in OPS if not report.counts[op]), report.skipped
    if family == "glm4_moe":
        assert "model.layers.2.self_attn.q_norm" in report.modules["rms_norm"]
    if family == "deepseek_v3":
        latent = {"model.layers.0.self_attn.q_a_layernorm", "model.layers.0.self_attn.kv_a_layernorm"}
        assert latent <= set(report.modules["rms_norm"])
        assert report.skipped["rope"].startswith("interleaved rotary (apply_rotary_pos_emb_interleave")


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_deepseek_v3_attention_gets_the_mla_forward_with_interleaved_rotary_only(rope_interleave):
    """The interleaved layout's attention runs the mla forward (its own rotary); the rotate-half
    layout keeps transformers' forward, and the report says why; neither takes ``rope``."""
    model = tiny("deepseek_v3", rope_interleave=rope_interleave)
    report = transform_model(model, kernels=True).kernels
    attentions = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention"]
    assert len(attentions) == 3
    assert report.modules["rope"] == [] and "rope_interleave" in report.skipped["rope"]
    if rope_interleave:
        assert all(forwards.patched_op(m) == "mla" for m in attentions) and report.counts["mla"] == 3
    else:
        assert all("forward" not in m.__dict__ for m in attentions)
        assert "rope_interleave=False" in report.skipped["mla"]


# --------------------------------------------------------------------------------- packed parity
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_row_equals_each_document_alone_in_loss_and_every_gradient(family):
    reference = tiny(family, seed=1)
    packed = copy.deepcopy(reference)
    report = transform_model(packed, kernels=True)
    assert report.kernels.counts == {op: 0 for op in OPS} | COUNTS[family]
    assert report.experts.implementation == "sloth"
    docs = random_documents(LENGTHS, seed=2, vocab=VOCAB)
    batch = packed_batch(docs, pad_to=PAD_TO)

    loss = packed(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    ref_loss = sum(_doc_loss_sum(reference, doc) for doc in docs) / batch.num_target_tokens
    ref_loss.backward()

    assert _rel(loss, ref_loss) <= 1e-5
    _assert_same_gradients(packed, reference)


# ----------------------------------------------------------------------- same input, same result
def _counting(monkeypatch) -> dict[str, int]:
    """Calls of ``sloth::rms_norm`` and ``sloth::rope`` from the installed forwards."""
    calls = {"rms_norm": 0, "rope": 0}

    def counted(op, fn):
        def call(*args, **kwargs):
            calls[op] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(forwards, "rms_norm", counted("rms_norm", forwards.rms_norm))
    monkeypatch.setattr(forwards, "apply_rope", counted("rope", forwards.apply_rope))
    return calls


def _same_batch(family: str, monkeypatch, router_loss: bool = False, **transform) -> None:
    reference = tiny(family, seed=3)
    model = copy.deepcopy(reference)
    transform_model(model, kernels=True, **transform)
    calls = _counting(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
    kwargs = dict(output_router_logits=True) if router_loss else {}

    out = model(input_ids=ids, labels=ids, **kwargs)
    fused = COUNTS[family]["add_rms_norm"]  # the post-attention norms run inside add_rms_norm
    assert calls == {"rms_norm": COUNTS[family]["rms_norm"] - fused, "rope": COUNTS[family].get("rope", 0)}
    out.loss.backward()
    ref = reference(input_ids=ids, labels=ids, **kwargs)
    ref.loss.backward()

    if router_loss:
        assert _rel(out.aux_loss, ref.aux_loss) <= 1e-5
    assert _rel(out.loss, ref.loss) <= 1e-5
    _assert_same_gradients(model, reference)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_transformed_model_equals_transformers_on_the_same_batch(family, monkeypatch):
    """Two unpadded rows, labels on every token: the same loss and gradients, with the sloth ops
    really called in the forward (once per patched module)."""
    _same_batch(family, monkeypatch)


@pytest.mark.parametrize("checkpoint_impl", ["torch", "node"])
def test_qwen2_moe_router_loss_equals_transformers(checkpoint_impl, monkeypatch):
    """Qwen2-MoE's load-balancing loss (``output_router_logits``) through the fused-loss forward,
    its gradient included: under the one-node checkpoint the recorded router logits would carry
    none, so a forward that records outputs runs the layers under torch's checkpoint."""
    _same_batch("qwen2_moe", monkeypatch, router_loss=True, checkpoint_impl=checkpoint_impl)
