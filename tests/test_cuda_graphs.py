"""CPU checks around the layers' CUDA graphs: the static-shape packing they need (empty segments
change nothing), the refusals (no CUDA, no checkpointing, dropout, several devices, compile), and
the walk over the bound arguments of a layer call. Replays themselves: tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama

from lightning_sloth.data import PackedCollator
from lightning_sloth.offload.graphs import _bound_values, _map_callable, check_graphable
from lightning_sloth.plugins import SlothDDPStrategy
from lightning_sloth.transform import transform_model


def _documents():
    return random_documents([7, 3, 12, 5, 9], seed=1)


def test_segments_bucket_pads_cu_seqlens_with_empty_segments():
    docs = _documents()
    exact = PackedCollator(64, 0, pad_to="max_tokens")([(d, d) for d in docs])
    pow2 = PackedCollator(64, 0, pad_to="max_tokens", segments_bucket="pow2")([(d, d) for d in docs])
    # five documents and the padding: six segments, padded to eight
    assert exact.cu_seqlens.tolist() == [0, 7, 10, 22, 27, 36, 64]
    assert pow2.cu_seqlens.tolist() == [0, 7, 10, 22, 27, 36, 64, 64, 64]
    assert pow2.num_documents == exact.num_documents == 6
    assert pow2.empty_segments == 2
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(pow2, name), getattr(exact, name))
    assert pow2.max_seqlen == exact.max_seqlen


def test_segments_bucket_keeps_a_power_of_two_and_rejects_unknown_values():
    collate = PackedCollator(32, 0, segments_bucket="pow2")
    batch = collate([(d, d) for d in random_documents([10, 6, 16], seed=2)])  # three, no padding
    assert batch.cu_seqlens.tolist() == [0, 10, 16, 32, 32]
    with pytest.raises(ValueError, match="segments_bucket"):
        PackedCollator(32, 0, segments_bucket="pow3")


def test_empty_segments_change_no_loss_or_gradient():
    docs = _documents()
    results = []
    for bucket in ("exact", "pow2"):
        model = add_lora(tiny_llama(seed=0)).train()
        transform_model(model)
        batch = PackedCollator(64, 0, pad_to="max_tokens", segments_bucket=bucket)([(d, d) for d in docs])
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_cuda_graphs_refusals():
    model = add_lora(tiny_llama(seed=0))
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        transform_model(model, cuda_graphs=True, gradient_checkpointing=False)
    with pytest.raises(ValueError, match="checkpoint_impl='node'"):
        transform_model(add_lora(tiny_llama(seed=0)), cuda_graphs=True, checkpoint_impl="torch")
    with pytest.raises(ValueError, match="compile"):
        transform_model(add_lora(tiny_llama(seed=0)), cuda_graphs=True, compile=True)
    with pytest.raises(ValueError, match="one device"):
        SlothDDPStrategy(cuda_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            transform_model(add_lora(tiny_llama(seed=0)), cuda_graphs=True)


def test_dropout_is_refused_before_any_graph():
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        check_graphable(tiny_llama(seed=0, attention_dropout=0.1))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))
    with pytest.raises(ValueError, match="dropout with p=0.2"):
        check_graphable(model)
    check_graphable(tiny_llama(seed=0))  # no dropout: accepted


def test_bound_values_walk_nested_partials_and_map_each_tensor_once():
    a, b = torch.ones(2), torch.zeros(3)

    def layer(x, *, emb, cu_q, cu_k, max_len):
        return x, emb, cu_q, cu_k, max_len

    inner = partial(layer, emb=(a, a * 2), cu_q=b, cu_k=b, max_len=7)
    outer = partial(lambda fn, mods, x: fn(x), inner, [torch.nn.Identity()])
    values = _bound_values(outer, [])
    assert [v is b for v in values].count(True) == 2 and [v for v in values if isinstance(v, int)] == [7]
    copies = {}
    mapped = _map_callable(outer, lambda t: copies.setdefault(id(t), t.clone()))
    x, emb, cu_q, cu_k, max_len = mapped("x")
    assert cu_q is cu_k is copies[id(b)] and cu_q is not b
    assert torch.equal(emb[0], a) and emb[0] is not a and max_len == 7
