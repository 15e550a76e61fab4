"""The per-layer memory plan on the new families' layers: a layer kept (no checkpoint) and a layer
recomputed give the same loss and every LoRA gradient bit for bit, with the family's sloth ops on
(Gemma 4's sandwich norms and per-layer head dims, Qwen3.5's linear-attention layers, DeepSeek-V3's
MLA forward and MoE layer, Qwen2-MoE's experts with the token permutation fused into the grouped
GEMMs)."""

from __future__ import annotations

import pytest
import torch
from _families import tiny as tiny_dense
from _models import add_lora, packed_batch, random_documents
from test_families_moe import VOCAB as MOE_VOCAB
from test_families_moe import tiny as tiny_moe

from lightning_sloth.offload.checkpoint import apply_checkpointing
from lightning_sloth.offload.planner import plan_peak_bytes
from lightning_sloth.transform import transform_model


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    loss = model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "family, fused",
    [("gemma4_text", False), ("qwen3_5_text", False), ("deepseek_v3", False), ("qwen2_moe", True)],
)
def test_kept_and_recomputed_layers_give_the_same_gradients(family, fused, monkeypatch):
    """``fused``: the MoE layers with the token permutation fused into the grouped GEMMs."""
    from lightning_sloth.moe import switch

    monkeypatch.setattr(switch, "_ENABLED", [fused])
    moe = family in ("deepseek_v3", "qwen2_moe")
    model = add_lora(tiny_moe(family) if moe else tiny_dense(family, attn="sdpa"), r=4)
    transform_model(model, kernels=True)
    checkpointing = apply_checkpointing(model, memory_budget=1 << 40)
    batch = packed_batch(random_documents([20, 33, 11], seed=2, **({"vocab": MOE_VOCAB} if moe else {})))
    model.train()
    _step(model, batch)  # measures each layer's activations for the plan
    layers = len(checkpointing.plan)
    act, inp, workspace = (
        checkpointing.activation_bytes,
        checkpointing.input_bytes,
        checkpointing.workspace_bytes,
    )
    runs = {}
    for name, budget in (
        ("recompute", 1),
        ("keep", plan_peak_bytes(["keep"] * layers, act, inp, workspace) + 1),
    ):
        assert checkpointing.replan(budget) == [name] * layers
        runs[name] = _step(model, batch)
    (loss_r, grads_r), (loss_k, grads_k) = runs["recompute"], runs["keep"]
    assert torch.equal(loss_r, loss_k) and grads_r.keys() == grads_k.keys() and grads_r
    for name, grad in grads_r.items():
        assert torch.equal(grads_k[name], grad), name
