"""The node checkpoint's recompute skips what only the layer output's values need: the fused LoRA
``down_proj``'s base product and the residual add (``skip_unread_output``, on by default). Losses
and gradients are bitwise those of the full recompute; one LoRA forward product per layer fewer."""

from __future__ import annotations

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama, tiny_qwen3
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sloth.data import PackedCollator
from lightning_sloth.ops.fp8_formats import quantize_rows
from lightning_sloth.ops.fp8_lora import lora_linear_fp8
from lightning_sloth.ops.fp8_qlora import lora_linear_4bit_fp8
from lightning_sloth.ops.lora import UnreadSum, lora_linear
from lightning_sloth.ops.nf4 import lora_linear_4bit
from lightning_sloth.quant import quantize_4bit, quantize_model
from lightning_sloth.quant.fp8 import fp8_base_model, fp8_compute_4bit
from lightning_sloth.transform import transform_model


class _CountLoraForwards(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.sloth.lora_linear.default,
            torch.ops.sloth.lora_linear_4bit.default,
            torch.ops.sloth.lora_linear_fp8.default,
            torch.ops.sloth.lora_linear_4bit_fp8.default,
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _step(make, skip: bool, autocast: bool = False, nf4: bool = False, fp8: bool = False, **settings):
    docs = random_documents([7, 3, 12, 5, 9], seed=1)
    batch = PackedCollator(64, 0, pad_to="max_tokens")([(d, d) for d in docs])
    model = add_lora(make(seed=0)).train()
    if nf4:
        quantize_model(model, "nf4")
    if fp8 and nf4:
        fp8_compute_4bit(model)  # 4-bit storage, FP8 compute
    elif fp8:
        fp8_base_model(model)
    report = transform_model(model, **settings)
    report.checkpointing.skip_unread_output = skip
    counter = _CountLoraForwards()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, counter.count


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_recompute_skips_the_last_product_with_the_same_gradients(make):
    loss_full, grads_full, calls_full = _step(make, skip=False, kernels=True)
    loss, grads, calls = _step(make, skip=True, kernels=True)
    layers = 2
    # forward and recompute: o_proj and down_proj per layer (q/k/v and gate/up are grouped nodes)
    assert calls_full == 2 * 2 * layers
    assert calls == calls_full - layers  # down_proj's recompute takes the gradient-only path
    assert torch.equal(loss, loss_full)
    assert grads.keys() == grads_full.keys()
    for name, g in grads_full.items():
        assert torch.equal(grads[name], g), name


def test_a_float32_residual_stream_under_bf16_autocast():
    # The sum promotes to float32 and the LoRA product's gradient comes back in bf16, as autograd's add.
    loss_full, grads_full, calls_full = _step(tiny_qwen3, skip=False, autocast=True, kernels=True)
    loss, grads, calls = _step(tiny_qwen3, skip=True, autocast=True, kernels=True)
    assert calls == calls_full - 2
    assert torch.equal(loss, loss_full)
    for name, g in grads_full.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
def test_a_4bit_base_skips_the_decode_and_product_with_the_same_gradients(autocast):
    """QLoRA: the recompute's down projection decodes no weight and multiplies nothing
    (``UnreadSum4bit``); loss and every gradient bitwise those of the full recompute."""
    loss_full, grads_full, calls_full = _step(
        tiny_llama, skip=False, autocast=autocast, nf4=True, kernels=True
    )
    loss, grads, calls = _step(tiny_llama, skip=True, autocast=autocast, nf4=True, kernels=True)
    assert calls == calls_full - 2  # one per layer
    assert torch.equal(loss, loss_full)
    assert grads.keys() == grads_full.keys() and grads
    for name, g in grads_full.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("nf4", [False, True], ids=["fp8_bases", "nf4_storage_fp8_compute"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
def test_fp8_bases_skip_the_quantisation_and_product_with_the_same_gradients(nf4, autocast):
    """FP8 bases (and QLoRA with FP8 compute): the recompute's down projection quantises and
    multiplies nothing (``UnreadSumFP8``); loss and every gradient bitwise those of the full recompute."""
    loss_full, grads_full, calls_full = _step(
        tiny_llama, skip=False, autocast=autocast, nf4=nf4, fp8=True, kernels=True
    )
    loss, grads, calls = _step(tiny_llama, skip=True, autocast=autocast, nf4=nf4, fp8=True, kernels=True)
    assert calls == calls_full - 2  # one per layer
    assert torch.equal(loss, loss_full)
    assert grads.keys() == grads_full.keys() and grads
    for name, g in grads_full.items():
        assert torch.equal(grads[name], g), name


def test_without_the_fused_mlp_the_recompute_is_unchanged():
    kernels = {"glu": False}  # the MLP keeps transformers' forward: nothing to skip
    _, grads_full, calls_full = _step(tiny_llama, skip=False, kernels=kernels)
    _, grads, calls = _step(tiny_llama, skip=True, kernels=kernels)
    assert calls == calls_full
    for name, g in grads_full.items():
        assert torch.equal(grads[name], g), name


def test_unread_sum_has_the_gradients_of_residual_plus_lora_linear():
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    residual, x, a, b = leaf(2, 5, 6), leaf(2, 5, 12), leaf(4, 12), leaf(6, 4)
    weight = torch.randn(6, 12, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(residual + lora_linear(x, weight, a, b, 0.5), (residual, x, a, b), grad)
    out = UnreadSum.apply(residual, x, weight, a, b, 0.5, False)
    assert out.shape == residual.shape
    got = torch.autograd.grad(out, (residual, x, a, b), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("overwrite_input", [False, True])
def test_unread_sum_4bit_has_the_gradients_of_residual_plus_lora_linear_4bit(overwrite_input):
    gen = torch.Generator().manual_seed(1)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    q = quantize_4bit(torch.randn(6, 64, generator=gen), "nf4")
    residual, a, b = leaf(2, 5, 6), leaf(4, 64), leaf(6, 4)
    base = torch.randn(2, 5, 64, generator=gen, requires_grad=True)
    grad = torch.randn(2, 5, 6, generator=gen)
    storage = (q.packed, q.absmax, q.code, 64)
    want = torch.autograd.grad(
        residual + lora_linear_4bit(base * 1, *storage, a, b, 0.5), (residual, base, a, b), grad
    )
    out = lora_linear_4bit(
        base * 1, *storage, a, b, 0.5, overwrite_input=overwrite_input, unread_sum_with=residual
    )
    assert out.shape == residual.shape
    got = torch.autograd.grad(out, (residual, base, a, b), grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match="unread_sum_with"):
        lora_linear_4bit(base, *storage, a, b, 0.5, unread_sum_with=residual[..., :3])


@pytest.mark.parametrize("grad_format", ["e4m3", "bf16"])
def test_unread_sum_fp8_has_the_gradients_of_residual_plus_the_fp8_lora_ops(grad_format):
    gen = torch.Generator().manual_seed(2)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    w = torch.randn(6, 64, generator=gen)
    codes, scale = quantize_rows(w, "e4m3")
    q = quantize_4bit(w, "nf4")
    residual, a, b = leaf(2, 5, 6), leaf(4, 64), leaf(6, 4)
    x = torch.randn(2, 5, 64, generator=gen, requires_grad=True)
    grad = torch.randn(2, 5, 6, generator=gen)
    for op, base in (
        (lora_linear_fp8, (codes, scale)),
        (lora_linear_4bit_fp8, (q.packed, q.absmax, q.code, 64)),
    ):
        want = torch.autograd.grad(
            residual + op(x * 1, *base, a, b, 0.5, grad_format), (residual, x, a, b), grad
        )
        out = op(x * 1, *base, a, b, 0.5, grad_format, unread_sum_with=residual)
        assert out.shape == residual.shape
        got = torch.autograd.grad(out, (residual, x, a, b), grad)
        for g, w_ in zip(got, want):
            assert torch.equal(g, w_), op.__name__
        with pytest.raises(ValueError, match="unread_sum_with"):
            op(x, *base, a, b, 0.5, unread_sum_with=residual[..., :3])
