"""``KernelSettings(glu_lora=True)`` (the default) in a model: where gate and up are LoRA layers over FP8 bases, the
activation adds their LoRA parts (``sloth::swiglu_lora``) and no pass adds them into the base
products; the loss and every gradient are those of the unfused path (up to the one rounding of gate
and up it skips); elsewhere the setting changes nothing."""

from __future__ import annotations

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama
from test_fp8_overwrite import check_block_compiles
from test_quant_training import _OpNames  # the ops dispatched in a block

from lightning_sloth.data import PackedCollator
from lightning_sloth.patching import KernelSettings
from lightning_sloth.quant.fp8 import fp8_base_model
from lightning_sloth.transform import transform_model


def _run(glu_lora: bool, fp8: bool, checkpointing: bool = True):
    docs = random_documents([7, 3, 12, 5, 9], seed=1)
    batch = PackedCollator(64, 0, pad_to="max_tokens")([(d, d) for d in docs])
    model = add_lora(tiny_llama(seed=0)).train()
    if fp8:
        fp8_base_model(model, grad_format="bf16")
    transform_model(model, kernels={"glu_lora": glu_lora}, gradient_checkpointing=checkpointing)
    with _OpNames() as names:
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, names, len(model.base_model.model.model.layers)


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "kept"])
def test_over_fp8_bases_the_activation_adds_gate_and_ups_lora_parts(checkpointing):
    loss, grads, names, layers = _run(True, fp8=True, checkpointing=checkpointing)
    want_loss, want_grads, want_names, _ = _run(False, fp8=True, checkpointing=checkpointing)
    passes = 2 if checkpointing else 1  # the forward, and the checkpointed layer's recompute
    assert names.count("sloth.swiglu_lora.default") == passes * layers
    assert names.count("sloth.swiglu_lora_backward_.default") == layers  # in place
    assert names.count("sloth.swiglu.default") == 0
    assert want_names.count("sloth.swiglu.default") == passes * layers
    if checkpointing:  # o_proj in the forward and the recompute, down_proj in the forward alone:
        # the recompute skips the down projection's FP8 product with the setting as without it
        fp8_products = "sloth.lora_linear_fp8.default"
        assert names.count(fp8_products) == want_names.count(fp8_products) == 3 * layers
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() and any("gate_proj.lora_B" in n for n in grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_over_16_bit_bases_the_setting_changes_nothing():
    loss, grads, names, _ = _run(True, fp8=False)
    want_loss, want_grads, _, _ = _run(False, fp8=False)
    assert names.count("sloth.swiglu_lora.default") == 0
    assert torch.equal(loss, want_loss)
    for name, grad in want_grads.items():
        assert torch.equal(grads[name], grad), name


def test_glu_lora_is_a_setting_on_by_default_and_switched_off_by_name():
    assert KernelSettings().glu_lora is True
    assert KernelSettings.coerce(True).glu_lora is True
    assert KernelSettings.coerce(["glu", "lora"]).glu_lora is True  # a modifier, not an op to name
    assert KernelSettings.coerce(["glu", "lora", "glu_lora"]).glu_lora is True
    assert KernelSettings.coerce({"glu_lora": False}).glu_lora is False
    assert KernelSettings.coerce({"glu_lora": False}).glu is True
    assert "glu_lora" not in KernelSettings.coerce(True).enabled()  # not an op
    with pytest.raises(ValueError, match="glu_lora"):
        KernelSettings.coerce(["glu_lorax"])


def test_by_default_fp8_bases_take_the_activation_with_the_lora_parts():
    docs = random_documents([7, 3, 12], seed=2)
    batch = PackedCollator(32, 0, pad_to="max_tokens")([(d, d) for d in docs])
    model = add_lora(tiny_llama(seed=0)).train()
    fp8_base_model(model)
    transform_model(model, kernels=True)
    with _OpNames() as names:
        model(**batch.model_inputs(), labels=batch.labels).loss.backward()
    assert names.count("sloth.swiglu_lora.default") and not names.count("sloth.swiglu.default")


def test_a_block_with_glu_lora_compiles_to_one_graph():
    """A patched decoder block over FP8 bases with ``glu_lora`` under ``torch.compile`` (fullgraph):
    no graph break, ``sloth::swiglu_lora`` in the graph and its in-place backward in the backward
    graph, and the output and every gradient equal to eager's."""
    check_block_compiles(KernelSettings(glu_lora=True), "sloth.swiglu_lora", "sloth.swiglu_lora_backward_")
