"""Grouped projections on the GPU (``report.checkpointing.group_projections=True``): the q/k/v and
gate/up LoRA layers as one node give the layers' own losses and gradients through the Triton
kernels, in float32 and with bf16 base weights under autocast, eagerly and in CUDA-graph replays.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_grouped_projections_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_cuda_graphs_gpu import LAYERS, _assert_same, _batches, _model, _train

from lightning_sloth.ops.lora_groups import _SharedInputLora
from lightning_sloth.transform import transform_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _grouped_pair(family: str, dtype: torch.dtype, **settings):
    one_by_one = _model(family, dtype)
    grouped = copy.deepcopy(one_by_one)
    transform_model(one_by_one, kernels=True)
    report = transform_model(grouped, kernels=True, **settings)
    report.checkpointing.group_projections = True
    return one_by_one, grouped, report


def _count_nodes(monkeypatch) -> list[int]:
    calls: list[int] = []
    apply = _SharedInputLora.apply
    monkeypatch.setattr(_SharedInputLora, "apply", lambda *a: calls.append(len(a[1])) or apply(*a))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_projections_match_the_layers_in_float32(family, monkeypatch):
    one_by_one, grouped, _ = _grouped_pair(family, torch.float32)
    batches = _batches(3, seed=7)
    want = _train(one_by_one, batches)
    calls = _count_nodes(monkeypatch)
    got = _train(grouped, batches)
    # every step: each layer's forward and recompute, one q/k/v and one gate/up node each
    assert sorted(calls) == sorted([2, 3] * 2 * LAYERS * len(batches))
    _assert_same(got, want, rtol=1e-4, atol=1e-5)


def test_grouped_projections_with_bf16_weights_under_autocast():
    """Both ways round differently in bf16; the grouped gradients are as close to the float32
    gradients of the same weights as the layers' own (one step: AdamW would amplify the rounding
    of near-zero gradients into full-size updates)."""
    reference = _model("qwen3", torch.bfloat16)
    one_by_one, grouped = copy.deepcopy(reference), copy.deepcopy(reference)
    transform_model(reference.float(), kernels=True)  # the same weights in float32
    transform_model(one_by_one, kernels=True)
    transform_model(grouped, kernels=True).checkpointing.group_projections = True
    batch = _batches(1, seed=8)
    _, (want,) = _train(reference, batch)
    _, (one,) = _train(one_by_one, batch, autocast=torch.bfloat16)
    _, (got,) = _train(grouped, batch, autocast=torch.bfloat16)

    def error(grads):
        return torch.stack([(grads[n] - want[n]).norm() for n in want]).norm()

    scale = torch.stack([w.norm() for w in want.values()]).norm()
    assert all(g.dtype == torch.float32 for g in got.values())
    assert error(got) <= 1.5 * error(one) + 1e-3 * scale, (error(got), error(one), scale)
    for name in want:
        assert (got[name] - one[name]).norm() <= 1e-1 * one[name].norm() + 1e-6, name


def test_grouped_projections_in_graph_replays_with_offload():
    one_by_one, grouped, report = _grouped_pair("llama", torch.float32, cuda_graphs=True, offload="on")
    batches = _batches(4, seed=9)
    want = _train(one_by_one, batches)
    got = _train(grouped, batches)
    _assert_same(got, want, rtol=1e-4, atol=1e-5)
    assert report.checkpointing.graphs.replays > 0


def test_folded_b_products_in_bf16_are_as_close_to_float64_as_the_separate_ones(monkeypatch):
    """gate/up-shaped group large enough to fold (``[x | x A^T] [W | s B]^T``): in bf16 its outputs
    and gradients are as close to float64 as the separate products' (one rounding of the sum)."""
    from lightning_sloth.ops import lora_groups

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, inputs, outs, rank = 4096, 256, (1024, 1024), 16

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64) * scale

    x = rand(rows, inputs)
    weights = [rand(o, inputs, scale=inputs**-0.5) for o in outs]
    adapters_a = [rand(rank, inputs, scale=inputs**-0.5) for _ in outs]
    adapters_b = [rand(o, rank, scale=0.1) for o in outs]
    grads = [rand(rows, o) for o in outs]
    scales = (2.0, 2.0)

    def run(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (x, *adapters_a, *adapters_b)]
        ys = _SharedInputLora.apply(leaves[0], scales, *[w.to(dtype) for w in weights], *leaves[1:])
        gs = torch.autograd.grad(ys, leaves, [g.to(dtype) for g in grads])
        return [t.double() for t in (*ys, *gs)]

    want = run(torch.float64)
    folded_calls: list[int] = []
    extend = lora_groups._extended_weight
    monkeypatch.setattr(
        lora_groups, "_extended_weight", lambda w, *a: folded_calls.append(1) or extend(w, *a)
    )
    folded = run(torch.bfloat16)
    assert len(folded_calls) == 2  # the default thresholds fold this group
    monkeypatch.setattr(lora_groups, "WIDE_ROWS_PER_INPUT", float("inf"))
    separate = run(torch.bfloat16)
    assert len(folded_calls) == 2
    for got, one, ref in zip(folded, separate, want):
        err_folded, err_separate = (got - ref).norm(), (one - ref).norm()
        assert err_folded <= 1.05 * err_separate + 1e-6 * ref.norm(), (err_folded, err_separate)
