"""Packed hybrid linear attention on CUDA (flash-linear-attention's kernels, ``pip install
'lightning-sloth[linear]'``): bf16 parity of the packed row with each document run alone, for the
short convolution, the gated delta rule and whole Qwen3.5 / Qwen3-Next models; the float32
reference agrees; the chunk table is built once per batch and a warmed-up step reads nothing back.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_linear_attention_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _bf16_parity import assert_as_close_as_transformers_bf16, document_loss
from _families import VOCAB, tiny
from _models import packed_batch, random_documents

from lightning_sloth import transform_model
from lightning_sloth.linear_attention import (
    fla_available,
    fla_kernels,
    gated_delta_rule_reference,
    packed_causal_conv1d,
    packed_gated_delta_rule,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not fla_available(), reason="needs fla-core: pip install 'lightning-sloth[linear]'"),
]

LENGTHS = [1, 63, 64, 65, 700, 1107, 2]  # chunk edges (64), a one-token document, long ones


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def mixer_inputs(total: int, heads_k=4, heads_v=8, dk=128, dv=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(1, total, heads_k, dk, **bf16)
    k = torch.randn(1, total, heads_k, dk, **bf16)
    v = torch.randn(1, total, heads_v, dv, **bf16)
    g = (
        F.logsigmoid(torch.randn(1, total, heads_v, device="cuda", generator=gen)) * 0.5
    )  # float32, as the modules
    beta = torch.rand(1, total, heads_v, **bf16)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def test_delta_rule_packed_equals_each_document_alone_bf16():
    q, k, v, g, beta = mixer_inputs(sum(LENGTHS))
    cu = cu_seqlens(LENGTHS)
    out = packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    grad = torch.randn_like(out)
    packed_grads = torch.autograd.grad(out, (q, k, v, g, beta), grad)
    start = 0
    for n in LENGTHS:
        part = [t[:, start : start + n].detach().requires_grad_() for t in (q, k, v, g, beta)]
        alone = packed_gated_delta_rule(*part, use_qk_l2norm=True)
        assert rel(out[:, start : start + n], alone) < 1e-2, n
        alone_grads = torch.autograd.grad(alone, part, grad[:, start : start + n])
        for name, packed_grad, alone_grad in zip(["q", "k", "v", "g", "beta"], packed_grads, alone_grads):
            # Relative to the document's gradient, or to its share of the row's where that is ~0: a
            # document's first gate multiplies the zero initial state, so a one-token document's gate
            # gradient is 0 in exact arithmetic and rounding noise in both runs.
            share = packed_grad.float().norm() * (n / sum(LENGTHS)) ** 0.5
            error = (packed_grad[:, start : start + n].float() - alone_grad.float()).norm()
            assert error <= 2e-2 * max(alone_grad.float().norm(), share), (n, name)
        # the float32 plain-torch reference of the same document
        expected = gated_delta_rule_reference(*(t.detach().float() for t in part), use_qk_l2norm=True)
        assert rel(alone, expected) < 1e-2, n
        start += n


@pytest.mark.parametrize("dk", [64, 128])
def test_delta_rule_gradients_match_the_float32_reference(dk):
    """Every gradient of the packed gated delta rule (bf16, fla's kernels) against autograd through the
    float32 plain-torch reference: on Hopper with Triton 3.4-3.7.0 this is the wide-tile backward
    (``fla_hopper``), which fla would otherwise refuse."""
    lengths = [1, 63, 64, 65, 300, 2]
    q, k, v, g, beta = mixer_inputs(sum(lengths), dk=dk, seed=dk)
    cu = cu_seqlens(lengths)
    out = packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, g, beta), grad)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    expected = gated_delta_rule_reference(*ref_inputs, cu_seqlens=cu, use_qk_l2norm=True)
    assert rel(out, expected) < 1e-2
    theirs = torch.autograd.grad(expected, ref_inputs, grad.float())
    for name, a, b in zip(["q", "k", "v", "g", "beta"], ours, theirs):
        assert rel(a, b) < 3e-2, (name, rel(a, b))


def test_conv_packed_equals_each_document_alone_bf16():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, sum(LENGTHS), 384, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = torch.randn(384, 4, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    out = packed_causal_conv1d(x, weight, None, "silu", cu_seqlens(LENGTHS))
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (x, weight), grad)
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    start, rows = 0, []
    for n in LENGTHS:
        seg = x32[:, start : start + n].transpose(1, 2)
        rows.append(F.silu(F.conv1d(seg, w32[:, None], padding=3, groups=384)[..., :n]).transpose(1, 2))
        start += n
    expected = torch.cat(rows, dim=1)
    assert rel(out, expected) < 1e-2
    theirs = torch.autograd.grad(expected, (x32, w32), grad.float())
    for a, b in zip(ours, theirs):
        assert rel(a, b) < 2e-2


def test_chunk_table_is_built_once_per_batch_and_a_warm_step_reads_nothing_back():
    q, k, v, g, beta = mixer_inputs(sum(LENGTHS))
    cu = cu_seqlens(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        out = packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
        conv = packed_causal_conv1d(x, weight, None, "silu", cu)
        (out.float().sum() + conv.float().sum()).backward()

    step()  # builds the table and lets the kernels autotune
    table = fla_kernels._TABLE.get(cu)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fla_kernels._TABLE.get(cu) is table
    assert table.shape[0] == sum(-(-n // 64) for n in LENGTHS)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_model_packed_row_equals_each_document_alone_bf16(model_type):
    overrides = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                     head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                     linear_num_value_heads=4, initializer_range=0.02,
                     layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
    reference = tiny(model_type, **overrides).cuda().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    truth = copy.deepcopy(reference).float()
    report = transform_model(model, kernels=True, moe=False)
    assert report.kernels.counts["linear_attention"] == 3
    docs = random_documents([300, 1, 65, 500, 127], seed=3, vocab=VOCAB)
    batch = packed_batch(docs).to("cuda")
    loss = model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    document_loss(reference, docs, batch.num_target_tokens).backward()
    true_loss = document_loss(truth, docs, batch.num_target_tokens)
    true_loss.backward()
    assert abs(loss.item() - true_loss.item()) / true_loss.item() < 1e-2
    assert_as_close_as_transformers_bf16(model, reference, truth)


def test_capture_in_a_cuda_graph_is_refused():
    q, k, v, g, beta = (t.detach() for t in mixer_inputs(200))
    cu = cu_seqlens([120, 80])
    packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)  # the table exists for cu
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(NotImplementedError, match="cuda_graphs=False"), torch.cuda.graph(graph):
        packed_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
