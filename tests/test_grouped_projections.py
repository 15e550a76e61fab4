"""LoRA layers that read one input (q/k/v, gate/up) as one node (``group_projections``, on by
default): x read once for all ``x A^T`` and ``dA``, ``dx`` accumulated in the products' epilogues,
and for large groups the ``B`` products folded into the base products; the same losses and
gradients as the layers one by one, within float rounding."""

from __future__ import annotations

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama, tiny_qwen3

from lightning_sloth.data import PackedCollator
from lightning_sloth.ops import lora_groups
from lightning_sloth.ops.lora import lora_linear
from lightning_sloth.ops.lora_groups import _SharedInputLora
from lightning_sloth.transform import transform_model


def _step(make, grouped: bool, autocast: bool = False):
    docs = random_documents([7, 3, 12, 5, 9], seed=1)
    batch = PackedCollator(64, 0, pad_to="max_tokens")([(d, d) for d in docs])
    model = add_lora(make(seed=0)).train()
    report = transform_model(model, kernels=True)
    report.checkpointing.group_projections = grouped
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_grouped_projections_train_like_the_layers_one_by_one(make, monkeypatch):
    calls = []
    apply = _SharedInputLora.apply
    monkeypatch.setattr(_SharedInputLora, "apply", lambda *a: calls.append(len(a[1])) or apply(*a))
    want_loss, want = _step(make, grouped=False)
    assert calls == []
    loss, got = _step(make, grouped=True)
    # two layers, forward and recompute, a q/k/v and a gate/up group each
    assert sorted(calls) == [2] * 4 + [3] * 4
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(), msg=name)


def test_grouped_projections_under_bf16_autocast_with_float32_adapters():
    want_loss, want = _step(tiny_qwen3, grouped=False, autocast=True)
    loss, got = _step(tiny_qwen3, grouped=True, autocast=True)
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
    for name, g in want.items():
        assert got[name].dtype == torch.float32
        assert (got[name] - g).norm() <= 2e-2 * g.norm() + 1e-6, name


def _group_leaves(seed: int, lead: tuple[int, ...], outs=(8, 4, 4), ranks=(3, 2, 3), inputs: int = 12):
    """float64 ``(x, weights, adapters_a, adapters_b, output grads)`` of a q/k/v-like group."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape, grad=True):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(grad)

    x = leaf(*lead, inputs)
    weights = [leaf(o, inputs, grad=False) for o in outs]
    adapters_a = [leaf(r, inputs) for r in ranks]
    adapters_b = [leaf(o, r) for o, r in zip(outs, ranks)]
    grads = [torch.randn(*lead, o, generator=gen, dtype=torch.float64) for o in outs]
    return x, weights, adapters_a, adapters_b, grads


@pytest.mark.parametrize("scales", [(0.5, 0.5, 0.5), (0.3, 2.0, 0.7)], ids=["uniform", "mixed"])
def test_shared_input_node_has_the_layers_gradients(scales):
    x, weights, adapters_a, adapters_b, grads = _group_leaves(0, (2, 5))
    grads[1] = None  # an output nothing uses
    inputs = (x, *adapters_a, *adapters_b)

    ys = [lora_linear(x, w, a, b, s) for w, a, b, s in zip(weights, adapters_a, adapters_b, scales)]
    used = [(y, g) for y, g in zip(ys, grads) if g is not None]
    want = torch.autograd.grad([y for y, _ in used], inputs, [g for _, g in used], allow_unused=True)
    outs = _SharedInputLora.apply(x, scales, *weights, *adapters_a, *adapters_b)
    for y, o in zip(ys, outs):
        torch.testing.assert_close(o, y, rtol=1e-12, atol=1e-12)
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    got = torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used], allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.abs().any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_groups_are_found_per_layer_and_on_by_default():
    model = add_lora(tiny_llama(seed=0))
    report = transform_model(model, kernels=True)
    assert report.checkpointing.group_projections is True
    groups = report.checkpointing._groups
    assert [[len(g) for g in layer] for layer in groups] == [[3, 2], [3, 2]]
    assert lora_groups.shared_input_groups(torch.nn.Linear(2, 2)) == []


def test_layers_that_are_not_plain_lora_run_one_by_one(monkeypatch):
    """LoRA dropout (like DoRA, biases, several adapters) leaves each layer its own call."""
    from _models import LORA_TARGETS
    from peft import LoraConfig, get_peft_model

    calls = []
    apply = _SharedInputLora.apply
    monkeypatch.setattr(_SharedInputLora, "apply", lambda *a: calls.append(len(a[1])) or apply(*a))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=list(LORA_TARGETS))
    model = get_peft_model(tiny_llama(seed=0), config).train()
    transform_model(model, kernels=True)
    docs = random_documents([7, 3, 12], seed=2)
    batch = PackedCollator(32, 0, pad_to="max_tokens")([(d, d) for d in docs])
    model(**batch.model_inputs(), labels=batch.labels).loss.backward()
    assert calls == []


def _fold_everything(monkeypatch) -> list[int]:
    """Fold the ``B`` products of every group, whatever its size; returns the extended-weight calls."""
    monkeypatch.setattr(lora_groups, "WIDE_ROWS_PER_INPUT", 0)
    monkeypatch.setattr(lora_groups, "WIDE_OUTPUTS_PER_INPUT", 0)
    calls: list[int] = []
    extend = lora_groups._extended_weight
    monkeypatch.setattr(
        lora_groups, "_extended_weight", lambda w, *a: calls.append(w.shape[0]) or extend(w, *a)
    )
    return calls


@pytest.mark.parametrize(
    "scales, folds",
    [((0.5, 0.5, 0.5), True), ((2.0, 0.25, 1.0), True), ((0.3, 2.0, 0.7), False)],
    ids=["uniform", "mixed-powers-of-two", "not-powers-of-two"],
)
def test_folded_b_products_give_the_layers_values(scales, folds, monkeypatch):
    """``[x | x A^T] [W | s B]^T`` per layer: the values of ``x W^T + s (x A^T) B^T`` and the same
    gradients; scales that are not powers of two (``s B`` would round) keep the separate products."""
    calls = _fold_everything(monkeypatch)
    x, weights, adapters_a, adapters_b, grads = _group_leaves(3, (3, 7))
    inputs = (x, *adapters_a, *adapters_b)
    ys = [lora_linear(x, w, a, b, s) for w, a, b, s in zip(weights, adapters_a, adapters_b, scales)]
    want = torch.autograd.grad(ys, inputs, grads)
    outs = _SharedInputLora.apply(x, scales, *weights, *adapters_a, *adapters_b)
    assert calls == ([8, 4, 4] if folds else [])
    got = torch.autograd.grad(outs, inputs, grads)
    for o, y in zip(outs, ys):
        assert o.shape == y.shape and o.is_contiguous()
        torch.testing.assert_close(o, y, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_extended_weight_places_each_layers_b():
    weight = torch.arange(12.0).view(3, 4)
    lora_b = torch.ones(3, 2)
    extended = lora_groups._extended_weight(weight, lora_b, 0.5, 1, 5)
    assert extended.shape == (3, 9)
    torch.testing.assert_close(extended[:, :4], weight)
    torch.testing.assert_close(extended[:, 4:], torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]] * 3))


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_folded_b_products_train_like_the_layers_one_by_one(make, monkeypatch):
    want_loss, want = _step(make, grouped=False)
    calls = _fold_everything(monkeypatch)
    loss, got = _step(make, grouped=True)
    assert len(calls) == 2 * 2 * 5  # two layers, forward and recompute, q/k/v + gate/up each
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    # float32 rounding of one sum instead of two (a few 1e-7 of the largest gradient)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=name)


def test_small_groups_keep_the_separate_products(monkeypatch):
    """By default the tiny models' groups are too small to fold (fewer rows than four per input)."""
    calls: list[int] = []
    extend = lora_groups._extended_weight
    monkeypatch.setattr(lora_groups, "_extended_weight", lambda w, *a: calls.append(1) or extend(w, *a))
    _step(tiny_llama, grouped=True)
    assert calls == []
    rows = torch.empty(64, 16)
    wide = [torch.empty(32, 16)]
    assert lora_groups._wide_products(rows, wide, (2.0,))
    assert not lora_groups._wide_products(rows[:63], wide, (2.0,))  # rows < 4 per input
    assert not lora_groups._wide_products(rows, [torch.empty(31, 16)], (2.0,))  # outputs < 2 per input
    assert not lora_groups._wide_products(rows, wide, (0.3,))  # s B would round
