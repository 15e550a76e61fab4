"""The linear-attention room on the CPU: the packed short convolution and gated delta rule against
float64 token-by-token definitions (forward and backward, odd lengths, grouped value heads, strided
inputs), segments kept apart, the chunk table, bad input, the missing-extra error; and chunked
attention (Llama 4) in the packed softmax attention."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from lightning_sloth.attention import enable_packed_attention
from lightning_sloth.attention.masked import chunked_segments, document_causal_mask
from lightning_sloth.data import PackedBatch, host_cu_seqlens, inputs_to_device
from lightning_sloth.linear_attention import (
    EXTRA,
    fla_kernels,
    get_linear_attention_backend,
    packed_causal_conv1d,
    packed_gated_delta_rule,
    set_linear_attention_backend,
)
from lightning_sloth.linear_attention.fla_kernels import _ChunkTable, chunk_table

torch.set_num_threads(1)


def recurrent_delta_rule(q, k, v, g, beta, use_qk_l2norm):
    """Token by token, one ``[Dk, Dv]`` state per head, float64: ``q, k [T, H, Dk]``, ``v [T, H, Dv]``."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out)


def inputs(length, heads_k=2, heads_v=4, dk=8, dv=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads_k, dk, generator=gen, dtype=dtype)
    k = torch.randn(1, length, heads_k, dk, generator=gen, dtype=dtype)
    v = torch.randn(1, length, heads_v, dv, generator=gen, dtype=dtype)
    g = -torch.rand(1, length, heads_v, generator=gen, dtype=dtype)
    beta = torch.rand(1, length, heads_v, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("lengths", [[1], [63], [64, 1, 65], [130, 0, 7]], ids=str)
def test_delta_rule_matches_the_recurrence_forward_and_backward(lengths):
    q, k, v, g, beta = inputs(sum(lengths), seed=len(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    groups = v.shape[2] // q.shape[2]
    expected = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if end > start:
            rep = [x[0, start:end].repeat_interleave(groups, dim=1) for x in (q, k)]
            expected.append(
                recurrent_delta_rule(*rep, v[0, start:end], g[0, start:end], beta[0, start:end], True)
            )
    expected = torch.cat(expected)[None]
    assert out.dtype == torch.float64 and out.shape == v.shape
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, g, beta), grad)
    theirs = torch.autograd.grad(expected, (q, k, v, g, beta), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_delta_rule_reads_strided_inputs_and_keeps_float32():
    q, k, v, g, beta = (t.detach().float() for t in inputs(40, heads_k=2, heads_v=2))
    wide = torch.randn(1, 40, 2, 16)
    q_strided = wide[..., ::2].copy_(q)  # last-dimension stride 2
    cu = torch.tensor([0, 17, 40], dtype=torch.int64)
    out = packed_gated_delta_rule(q_strided, k, v, g, beta, cu, scale=0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, packed_gated_delta_rule(q.contiguous(), k, v, g, beta, cu, scale=0.5))


def test_conv_matches_its_definition_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 29, 5, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64).requires_grad_()
    bias = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_()
    lengths = [2, 0, 11, 1, 15]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = packed_causal_conv1d(x, weight, bias, "silu", cu)
    rows = []
    start = 0
    for n in lengths:
        for t in range(start, start + n):
            taps = [x[0, t - s] * weight[:, 3 - s] for s in range(4) if t - s >= start]
            rows.append(F.silu(torch.stack(taps).sum(0) + bias))
        start += n
    expected = torch.stack(rows)[None]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (x, weight, bias), grad),
        torch.autograd.grad(expected, (x, weight, bias), grad),
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_segments_are_independent():
    q, k, v, g, beta = (t.detach().float() for t in inputs(50))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    packed = packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    second = packed_gated_delta_rule(*(t[:, 20:] for t in (q, k, v, g, beta)), use_qk_l2norm=True)
    torch.testing.assert_close(packed[:, 20:], second, rtol=0, atol=0)
    x, w = torch.randn(1, 50, 3), torch.randn(3, 4)
    torch.testing.assert_close(
        packed_causal_conv1d(x, w, cu_seqlens=cu)[:, 20:], packed_causal_conv1d(x[:, 20:], w)
    )


def test_chunk_table_lists_every_chunk_of_every_segment():
    table = chunk_table([0, 64, 65, 65, 200], torch.device("cpu"), torch.int32)
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
    assert chunk_table([0, 0], torch.device("cpu"), torch.int64).shape == (0, 2)


def test_bad_input_is_refused_by_name():
    q, k, v, g, beta = (t.detach() for t in inputs(10))
    with pytest.raises(ValueError, match="rise from 0"):
        packed_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch size 1"):
        packed_gated_delta_rule(
            *(t.expand(2, *t.shape[1:]) for t in (q, k, v, g, beta)), torch.tensor([0, 10])
        )
    with pytest.raises(ValueError, match="g and beta"):
        packed_gated_delta_rule(q, k, v, g[..., :1], beta)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        packed_gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match="int32/int64"):
        packed_gated_delta_rule(q, k, v, g, beta, torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match="activation"):
        packed_causal_conv1d(torch.randn(1, 4, 3), torch.randn(3, 4), activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        packed_causal_conv1d(torch.randn(1, 4, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="unknown linear attention backend"):
        set_linear_attention_backend("triton")


def test_cuda_without_the_extra_names_it():
    with mock.patch.object(fla_kernels.importlib.util, "find_spec", return_value=None):
        assert not fla_kernels.fla_available()
        with pytest.raises(ImportError, match=r"lightning-sloth\[linear\]"):
            fla_kernels.causal_conv1d_fla(torch.randn(1, 4, 3), torch.randn(3, 4), None, None, None)
    assert EXTRA == "lightning-sloth[linear]" and get_linear_attention_backend() == "auto"


def test_reference_backend_is_a_switch():
    try:
        set_linear_attention_backend("reference")
        assert get_linear_attention_backend() == "reference"
        x, w = torch.randn(1, 6, 2), torch.randn(2, 4)
        torch.testing.assert_close(packed_causal_conv1d(x, w), packed_causal_conv1d(x, w))
    finally:
        set_linear_attention_backend("auto")


# ------------------------------------------------------------------------ chunked attention
def test_chunked_segments_cut_every_document_into_pieces():
    cu = torch.tensor([0, 9, 10, 27, 33], dtype=torch.int32)
    cut = chunked_segments(cu, 33, 8)
    assert cut.shape == (4 + 33 // 8 + 1,) and cut.dtype == torch.int32
    assert cut.tolist() == [0, 8, 9, 10, 18, 26, 27, 33, 33]
    mask = document_causal_mask(cut, 33)
    assert mask[17, 10] and not mask[18, 17] and mask[25, 18] and not mask[26, 25]


def test_chunked_attention_without_packing_matches_transformers():
    from _families import tiny

    reference = tiny("llama4_text").eval()
    model = copy.deepcopy(reference)
    enable_packed_attention(model)
    tokens = torch.randint(0, 128, (1, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)


def test_chunk_table_reads_the_batchs_host_bounds_not_the_device_tensor():
    """A batch moved by PackedBatch.to (or inputs_to_device) keeps its host cu_seqlens beside the
    device one, and the chunk table is built from it: no device read (a meta tensor has no values,
    so reading it would fail)."""
    cu = torch.tensor([0, 70, 75, 200], dtype=torch.int32)
    ids = torch.zeros(1, 200, dtype=torch.long)
    batch = PackedBatch(
        ids, ids, ids, cu, max_seqlen=125, num_tokens=200, num_target_tokens=197, capacity=200
    )
    moved = batch.to("meta")
    assert moved.cu_seqlens.is_meta and host_cu_seqlens(moved.cu_seqlens) is cu
    assert host_cu_seqlens(cu) is cu and host_cu_seqlens(torch.zeros(2, device="meta")) is None
    inputs = inputs_to_device(batch.model_inputs(), "meta")
    assert host_cu_seqlens(inputs["cu_seq_lens_q"]) is cu and inputs["max_length_q"] == 125
    table = _ChunkTable().get(moved.cu_seqlens)
    assert table.is_meta and table.shape == chunk_table(cu.tolist(), torch.device("cpu"), cu.dtype).shape


def test_chunk_table_serves_validation_batches_made_under_inference_mode():
    """Lightning's validation moves its batches under ``torch.inference_mode``: their ``cu_seqlens``
    keep no version counter, and the table is keyed on the tensor alone."""
    cu = torch.tensor([0, 70, 75, 200], dtype=torch.int32)
    tables = _ChunkTable()
    with torch.inference_mode():
        inference_cu = cu.clone()
        first = tables.get(inference_cu)
        assert tables.get(inference_cu) is first
    assert torch.equal(first, chunk_table(cu.tolist(), torch.device("cpu"), cu.dtype))
    assert tables.get(cu) is not first  # another batch


def test_the_conv_forward_of_transformers_5_25_runs_over_the_segments_and_falls_back_with_a_cache():
    """transformers 5.25 calls ``causal_conv1d_forward(conv1d, x, cache, layer_idx, ...)`` where
    earlier releases called ``causal_conv1d_fn``: the rebuilt forward replaces either."""
    import types

    from lightning_sloth.patching.linear_forwards import _packed_conv_forward, linear_attention_forward

    calls = []

    def original(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
        calls.append((cache, layer_idx, activation, state_idx))
        return "original"

    conv = torch.nn.Conv1d(5, 5, 4, groups=5, padding=3, dtype=torch.float64)
    x = torch.randn(1, 5, 29, dtype=torch.float64)  # [B, D, T], as transformers passes it
    cu = torch.tensor([0, 2, 13, 14, 29], dtype=torch.int32)
    forward = _packed_conv_forward(original)
    out = forward(conv, x, None, 0, activation="silu", cu_seq_lens_q=cu)
    expected = packed_causal_conv1d(x.transpose(1, 2), conv.weight.squeeze(1), conv.bias, "silu", cu)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
    alone = packed_causal_conv1d(x[:, :, 14:].transpose(1, 2), conv.weight.squeeze(1), conv.bias, "silu")
    torch.testing.assert_close(out[:, :, 14:], alone.transpose(1, 2))
    assert forward(conv, x, "cache", 3, activation="silu", cu_seq_lens_q=cu) == "original"
    assert forward(conv, x, None, 4) == "original"
    assert calls == [("cache", 3, "silu", 0), (None, 4, None, 0)]

    source = (
        "def causal_conv1d_forward(*args, **kwargs): pass\n"
        "def causal_conv1d_fn(*args, **kwargs): pass\n"
        "def torch_chunk_gated_delta_rule(*args, **kwargs): pass\n"
        "class New:\n"
        "    def forward(self, x):\n"
        "        return torch_chunk_gated_delta_rule(causal_conv1d_forward(x))\n"
        "class Old:\n"
        "    def forward(self, x):\n"
        "        return torch_chunk_gated_delta_rule(causal_conv1d_fn(x))\n"
        "class Neither:\n"
        "    def forward(self, x):\n"
        "        return x\n"
    )
    module = types.ModuleType("fake_modeling")
    exec(compile(source, "fake_modeling.py", "exec"), module.__dict__)
    for cls in (module.New, module.Old):
        rebuilt = linear_attention_forward(cls)
        assert rebuilt is not None and rebuilt.__code__ is cls.forward.__code__
    assert linear_attention_forward(module.Neither) is None
