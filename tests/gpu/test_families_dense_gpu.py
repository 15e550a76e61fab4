"""The 2026 dense families on CUDA in bf16, through the Triton kernels and the varlen attention: a
packed row equals each document run alone through the unmodified transformers model (Phi-3's fused
gate-up MLP, Gemma 4's single-tensor rope with 512-dim global heads, Granite's logit scaling, Llama 4's
chunked attention and document temperature, OLMo 2's whole-projection QK-norm).

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_families_dense_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _families import CASES, VOCAB, tiny
from _models import packed_batch, random_documents

from lightning_sloth import transform_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            initializer_range=0.02, max_position_embeddings=4096)  # fmt: skip
OVERRIDES = {
    "gemma4_text": dict(global_head_dim=512, sliding_window=128),
    "llama4_text": dict(attention_chunk_size=256, floor_scale=128),
    "olmo3": dict(sliding_window=128),
}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def assert_close_gradients(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """bf16 against bf16 through other kernels: every weight matrix's gradient within 5% (relative
    norm), and all gradients together within 3%."""
    ref = dict(reference.named_parameters())
    ours, theirs = [], []
    for name, param in model.named_parameters():
        if param.grad is None or ref[name].grad is None:
            assert param.grad is None and ref[name].grad is None, name
            continue
        ours.append(param.grad.float().flatten())
        theirs.append(ref[name].grad.float().flatten())
        if param.dim() >= 2 and ref[name].grad.norm() > 0:
            assert rel(param.grad, ref[name].grad) < 5e-2, name
    assert rel(torch.cat(ours), torch.cat(theirs)) < 3e-2


@pytest.mark.parametrize("model_type", ["phi3", "gemma4_text", "granite", "llama4_text", "olmo2", "olmo3"])
def test_packed_row_equals_each_document_alone_bf16(model_type):
    reference = tiny(model_type, **WIDE, **OVERRIDES.get(model_type, {})).cuda().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    report = transform_model(model, kernels=True, moe=False).kernels
    assert {op: n for op, n in report.counts.items() if n} == CASES[model_type][2]
    docs = random_documents([700, 1, 65, 300, 129], seed=4, vocab=VOCAB)
    batch = packed_batch(docs).to("cuda")
    loss = model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    total = 0.0
    for doc in docs:
        tokens = torch.tensor([doc], device="cuda")
        logits = reference(input_ids=tokens).logits[0].float()
        total = total + F.cross_entropy(logits[:-1], tokens[0, 1:], reduction="sum")
    ref_loss = total / batch.num_target_tokens
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert_close_gradients(model, reference)
