"""``add_rms_norm`` on the decoder layers of the MoE rows, on CPU in float32.

Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4-MoE and DeepSeek-V3 have Llama's pre-norm decoder layer with an
MoE block (or, in the leading layers, a dense MLP) as ``mlp``; the block returns the hidden states
alone, the router logits reaching the load-balancing loss through transformers' hook on the router.
Each tiny model has three layers (a dense one first where the family has them), every parameter
trainable and every norm weight off its init. Through ``transform_model(model, kernels=True)``: the
report lists ``add_rms_norm`` on every decoder layer and the op runs once per layer; a packed row
equals each document alone through the unmodified transformers model, and an unpacked batch equals
the unmodified model on the same batch, with the router load-balancing loss (value and gradients)
where the family has one, in the loss and the gradient of every parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _models import packed_batch, random_documents
from test_moe_family_ops import CONFIGS as _SHARED_EXPERT_CONFIGS
from test_moe_family_ops import (
    LENGTHS,
    PAD_TO,
    VOCAB,
    _assert_same_gradients,
    _doc_loss_sum,
    _rel,
)
from test_moe_family_ops import tiny as _tiny
from torch import nn

from lightning_sloth.patching import FAMILIES
from lightning_sloth.patching import _forwards as forwards
from lightning_sloth.transform import transform_model

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

_ROUTER_LOSS = dict(router_aux_loss_coef=0.5)  # large enough that its gradient shows in every router
CONFIGS = {
    # mlp_only_layers=[0]: a dense layer, then two MoE layers; per-head QK-norm
    "qwen3_moe": dict(
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
        mlp_only_layers=[0], norm_topk_prob=True, **_ROUTER_LOSS,
    ),
    # every layer MoE
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, **_ROUTER_LOSS),
    "qwen2_moe": {**_SHARED_EXPERT_CONFIGS["qwen2_moe"], **_ROUTER_LOSS},
    "glm4_moe": _SHARED_EXPERT_CONFIGS["glm4_moe"],
    "deepseek_v3": _SHARED_EXPERT_CONFIGS["deepseek_v3"],
}  # fmt: skip
FAMILY_NAMES = list(CONFIGS)
ROUTER_LOSS_FAMILIES = [family for family in FAMILY_NAMES if FAMILIES[family].moe]
LAYERS = 3


def tiny(family: str, seed: int = 0, **overrides) -> nn.Module:
    """:func:`test_moe_family_ops.tiny` with this file's :data:`CONFIGS`."""
    return _tiny(family, seed, configs=CONFIGS, **overrides)


def _counting_add_rms_norm(monkeypatch) -> list[int]:
    calls = []
    fused = forwards.add_rms_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(forwards, "add_rms_norm", counted)
    return calls


# ------------------------------------------------------------------------------------ the report
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_report_lists_add_rms_norm_on_every_decoder_layer(family):
    model = tiny(family)
    report = transform_model(model, kernels=True).kernels
    layers = model.model.layers
    assert len(layers) == LAYERS
    mlps = [type(layer.mlp).__name__ for layer in layers]
    assert sum(name in FAMILIES[family].mlps for name in mlps) == (0 if family == "mixtral" else 1)
    assert not any(name in FAMILIES[family].mlps for name in mlps[1:])  # MoE blocks after the first

    assert report.modules["add_rms_norm"] == [f"model.layers.{i}" for i in range(LAYERS)]
    assert "add_rms_norm" not in report.skipped
    assert all(forwards.patched_op(layer) == "add_rms_norm" for layer in layers)


# --------------------------------------------------------------------------------- packed parity
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_row_equals_each_document_alone_in_loss_and_every_gradient(family, monkeypatch):
    reference = tiny(family, seed=1)
    packed = copy.deepcopy(reference)
    report = transform_model(packed, kernels=True)
    assert report.kernels.counts["add_rms_norm"] == LAYERS
    assert report.experts.implementation == "sloth"
    calls = _counting_add_rms_norm(monkeypatch)
    docs = random_documents(LENGTHS, seed=2, vocab=VOCAB)
    batch = packed_batch(docs, pad_to=PAD_TO)

    loss = packed(**batch.model_inputs(), labels=batch.labels).loss
    assert len(calls) == LAYERS
    loss.backward()
    ref_loss = sum(_doc_loss_sum(reference, doc) for doc in docs) / batch.num_target_tokens
    ref_loss.backward()

    assert _rel(loss, ref_loss) <= 1e-5
    _assert_same_gradients(packed, reference)


# ----------------------------------------------------------------------- same input, same result
def _same_batch(family: str, monkeypatch, router_loss: bool = False, seed: int | None = None, **transform):
    """The transformed model against transformers on two unpadded rows (labels on every token):
    loss and every gradient, and with ``router_loss`` the load-balancing loss's value and its own
    gradients. ``seed`` reseeds before each forward (Mixtral's router jitter noise)."""
    reference = tiny(family, seed=3, **({"router_jitter_noise": 0.2} if seed is not None else {}))
    model = copy.deepcopy(reference)
    transform_model(model, kernels=True, **transform)
    calls = _counting_add_rms_norm(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
    kwargs = dict(output_router_logits=True) if router_loss else {}

    def step(m: nn.Module):
        if seed is not None:
            torch.manual_seed(seed)
        return m(input_ids=ids, labels=ids, **kwargs)

    if router_loss:  # the load-balancing loss alone: its gradient reaches every router
        aux, ref_aux = step(model).aux_loss, step(reference).aux_loss
        params, ref_params = list(model.parameters()), list(reference.parameters())
        grads = torch.autograd.grad(aux, params, allow_unused=True)
        ref_grads = torch.autograd.grad(ref_aux, ref_params, allow_unused=True)
        names = [name for name, _ in reference.named_parameters()]
        routers = [i for i, name in enumerate(names) if name.endswith("mlp.gate.weight")]
        assert routers and all(ref_grads[i].abs().sum() > 0 for i in routers)
        assert _rel(aux, ref_aux) <= 1e-5
        for name, grad, ref_grad in zip(names, grads, ref_grads, strict=True):
            if ref_grad is None:
                assert grad is None or not grad.any(), name
            else:
                assert _rel(grad, ref_grad) <= 1e-5, name
        calls.clear()

    out = step(model)
    assert len(calls) == LAYERS
    out.loss.backward()
    ref = step(reference)
    ref.loss.backward()

    if router_loss:
        assert ref.aux_loss is not None and _rel(out.aux_loss, ref.aux_loss) <= 1e-5
    assert _rel(out.loss, ref.loss) <= 1e-5
    _assert_same_gradients(model, reference)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_transformed_model_equals_transformers_on_the_same_batch(family, monkeypatch):
    _same_batch(family, monkeypatch)


@pytest.mark.parametrize("checkpoint_impl", ["torch", "node"])
@pytest.mark.parametrize("family", ROUTER_LOSS_FAMILIES)
def test_router_loss_equals_transformers(family, checkpoint_impl, monkeypatch):
    """``output_router_logits=True``: the router logits recorded from inside the patched layers
    carry their gradient, under either checkpoint."""
    _same_batch(family, monkeypatch, router_loss=True, checkpoint_impl=checkpoint_impl)


def test_mixtral_router_jitter_noise_multiplies_the_fused_norm_output_in_place(monkeypatch):
    """Mixtral's block scales its input in place in training (``router_jitter_noise``): its input is
    now ``add_rms_norm``'s output, which the op's backward does not read."""
    _same_batch("mixtral", monkeypatch, router_loss=True, seed=5)
