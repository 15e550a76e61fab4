"""Whole-model parity: a packed batch through "sloth" attention equals each document run alone.

The reference is the unmodified transformers model (SDPA) on the same weights, one document at a
time; the packed model is a deep copy switched to "sloth" attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import add_lora, packed_batch, random_documents, tiny_llama, tiny_qwen3

from lightning_sloth.attention import enable_packed_attention

torch.set_num_threads(1)
# transformers 5.23 renames gradient checkpointing helpers; the old names still work on 5.17-5.23.
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

LENGTHS = [9, 1, 17, 6]  # odd lengths and a one-token document
PAD_TO = 40  # 7 padding tokens as a trailing segment
BUILDERS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def packed_copy(model):
    """A deep copy of ``model`` (same weights) with packed attention enabled."""
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    return packed


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def document_loss_sum(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of one document from its ``[L, V]`` logits and ``[L]`` tokens."""
    return F.cross_entropy(logits[:-1].double(), tokens[1:], reduction="sum")


@pytest.mark.parametrize("family", BUILDERS)
def test_each_packed_document_matches_running_it_alone(family):
    model = BUILDERS[family]()
    packed_model = packed_copy(model)
    docs = random_documents(LENGTHS, seed=1)
    batch = packed_batch(docs, pad_to=PAD_TO)
    with torch.no_grad():
        logits = packed_model(**batch.model_inputs()).logits[0]
        for (start, end), doc in zip(spans(LENGTHS), docs):
            tokens = torch.tensor(doc)
            alone = model(input_ids=tokens[None]).logits[0]
            torch.testing.assert_close(logits[start:end], alone, rtol=1e-5, atol=1e-5)
            if end - start > 1:
                packed_loss = document_loss_sum(logits[start:end], tokens) / (end - start - 1)
                alone_loss = document_loss_sum(alone, tokens) / (end - start - 1)
                torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", BUILDERS)
def test_changing_one_document_leaves_the_others_unchanged(family):
    packed_model = packed_copy(BUILDERS[family]())
    docs = random_documents(LENGTHS, seed=2)
    edited = copy.deepcopy(docs)
    edited[2] = random_documents([LENGTHS[2]], seed=99)[0]
    with torch.no_grad():
        before = packed_model(**packed_batch(docs, pad_to=PAD_TO).model_inputs()).logits[0]
        after = packed_model(**packed_batch(edited, pad_to=PAD_TO).model_inputs()).logits[0]
    for index, (start, end) in enumerate(spans([*LENGTHS, PAD_TO - sum(LENGTHS)])):
        if index == 2:
            assert (before[start:end] - after[start:end]).abs().max() > 1e-2  # the edit is visible
        else:
            torch.testing.assert_close(after[start:end], before[start:end], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_loss_and_gradients_match_unpacked_model(family, checkpointing):
    reference = add_lora(BUILDERS[family](), r=8, seed=3).train()
    packed_model = packed_copy(reference)
    if checkpointing:
        packed_model.get_base_model().gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    docs = random_documents(LENGTHS, seed=4)
    batch = packed_batch(docs, pad_to=PAD_TO)

    loss = packed_model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()

    total = sum(
        document_loss_sum(reference(input_ids=torch.tensor([doc])).logits[0], torch.tensor(doc))
        for doc in docs
    )
    ref_loss = total / batch.num_target_tokens
    ref_loss.backward()

    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in packed_model.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, ref_grad in ref_grads.items():
        assert ref_grad.abs().max() > 0, name
        scale = ref_grad.abs().max().item()
        torch.testing.assert_close(grads[name], ref_grad, rtol=1e-4, atol=1e-6 * scale, msg=name)
