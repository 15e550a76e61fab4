"""``KernelSettings(glu_lora=True)`` in a model: where gate and up are LoRA layers over FP8 bases, the
activation adds their LoRA parts (``sloth::swiglu_lora``) and no pass adds them into the base
products; the loss and every gradient are those of the unfused path (up to the one rounding of gate
and up it skips); elsewhere the setting changes nothing."""

from __future__ import annotations

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama
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


def test_glu_lora_is_a_setting_off_by_default_and_named_when_asked_for():
    assert KernelSettings().glu_lora is False
    assert KernelSettings.coerce(True).glu_lora is False
    assert KernelSettings.coerce(["glu", "lora", "glu_lora"]).glu_lora is True
    assert KernelSettings.coerce({"glu_lora": True}).glu_lora is True
    assert "glu_lora" not in KernelSettings.coerce({"glu_lora": True}).enabled()  # not an op
    with pytest.raises(ValueError, match="glu_lora"):
        KernelSettings.coerce(["glu_lorax"])


def test_a_block_with_glu_lora_compiles_to_one_graph():
    """A patched decoder block over FP8 bases with ``glu_lora`` under ``torch.compile`` (fullgraph):
    no graph break, ``sloth::swiglu_lora`` in the graph and its in-place backward in the backward
    graph, and the output and every gradient equal to eager's."""
    import test_patching as tp
    from test_compile import forward_backward
    from torch._dynamo.backends.common import aot_autograd

    from lightning_sloth.patching import apply_kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    try:
        model = tp.lora(tp.tiny_model("llama"))
        fp8_base_model(model, grad_format="e4m3")
        apply_kernels(model, KernelSettings(glu_lora=True))
        base = model.get_base_model()
        hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
        positions = torch.arange(12).expand(2, -1)
        kwargs = dict(
            attention_mask=None,
            position_ids=positions,
            position_embeddings=base.model.rotary_emb(hidden, positions),
        )
        block = base.model.layers[0]
        explained = torch._dynamo.explain(block)(hidden, **kwargs)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        assert "sloth.swiglu_lora" in explained.graphs[0].code
        grad_out = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
        expected = forward_backward(block, hidden, kwargs, grad_out)
        torch._dynamo.reset()
        backward_graphs = []

        def keep_backward(graph, _inputs):
            backward_graphs.append(graph.code)
            return graph

        backend = aot_autograd(fw_compiler=lambda graph, _inputs: graph, bw_compiler=keep_backward)
        actual = forward_backward(
            block, hidden, kwargs, grad_out, call=torch.compile(block, fullgraph=True, backend=backend)
        )
        (code,) = backward_graphs
        assert code.count("sloth.swiglu_lora_backward_") == 1, code
        torch.testing.assert_close(actual[:2], expected[:2], rtol=0, atol=0)
        assert actual[2].keys() == expected[2].keys() and actual[2]
        for name, grad in expected[2].items():
            torch.testing.assert_close(actual[2][name], grad, rtol=0, atol=0, msg=name)
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
