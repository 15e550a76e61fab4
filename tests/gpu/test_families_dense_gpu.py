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
from _bf16_parity import assert_as_close_as_transformers_bf16, document_loss
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


@pytest.mark.parametrize("model_type", ["phi3", "gemma4_text", "granite", "llama4_text", "olmo2", "olmo3"])
def test_packed_row_equals_each_document_alone_bf16(model_type):
    _check_packed_row(model_type, [700, 1, 65, 300, 129])


def test_gemma4_global_heads_run_sdpa_in_query_tiles_bf16():
    """Many short documents: the 512-dim global heads, past the varlen kernel, take SDPA in query
    tiles (``masked.band_reach``), and still equal each document alone."""
    from lightning_sloth.attention import masked

    lengths = torch.randint(1, 120, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    assert masked.band_reach(sum(lengths), max(lengths), None, None) is not None
    _check_packed_row("gemma4_text", lengths)


def _check_packed_row(model_type, lengths):
    reference = tiny(model_type, **WIDE, **OVERRIDES.get(model_type, {})).cuda().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    report = transform_model(model, kernels=True, moe=False).kernels
    assert {op: n for op, n in report.counts.items() if n} == CASES[model_type][2]
    docs = random_documents(lengths, seed=4, vocab=VOCAB)
    batch = packed_batch(docs).to("cuda")
    truth = copy.deepcopy(reference).float()
    loss = model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    ref_loss = document_loss(reference, docs, batch.num_target_tokens)
    ref_loss.backward()
    true_loss = document_loss(truth, docs, batch.num_target_tokens)
    true_loss.backward()
    assert abs(loss.item() - true_loss.item()) / true_loss.item() < 1e-2
    assert_as_close_as_transformers_bf16(model, reference, truth)
