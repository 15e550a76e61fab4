"""LoRA layers over FP8 bases whose input is quantised and multiplied by the adapters' A in one pass
(``ops.fp8.quantize_activation_lora``, on the FP8 tensor cores): the path gives the products of the
path without it. Here on a CPU, with the kernel's choice forced and ``_scaled_mm`` emulated, so the
plumbing of every op that takes it is checked (the kernel itself: ``tests/test_fp8_kernels.py``
under the interpreter and ``tests/gpu/test_fp8_gpu.py``)."""

import pytest
import torch

from lightning_sloth.ops import fp8_lora
from lightning_sloth.ops.fp8_formats import quantize_rows
from lightning_sloth.ops.fp8_lora import SharedInputLoraFP8, lora_linear_fp8
from lightning_sloth.ops.fp8_qlora import lora_linear_4bit_fp8
from lightning_sloth.quant import quantize_4bit

CALLS = {"fused": 0}


def _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, out=None):
    product = ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
    return product if out is None else out.copy_(product)


def _fused_quantisation(x, adapters, codes=True):
    CALLS["fused"] += 1
    xa = torch.cat([x @ a.t() for a in adapters], dim=1)
    if not codes:
        return None, None, xa
    return (*quantize_rows(x, "e4m3"), xa)


def force(monkeypatch):
    """Take the fused input path on a CPU from here on: its choice forced, the kernel's plain-torch
    equal and ``_scaled_mm`` emulated (float32 products of the dequantised codes, as the emulation
    computes them)."""
    CALLS["fused"] = 0
    monkeypatch.setattr(fp8_lora, "runs_fused_lora_input", lambda x, n, adapters: x.shape[0] > 0)
    monkeypatch.setattr(fp8_lora, "quantize_activation_lora", _fused_quantisation)
    monkeypatch.setattr(fp8_lora, "scaled_mm", _emulated_scaled_mm)
    monkeypatch.setattr(fp8_lora, "scaled_mm_applies", lambda x, n: True)


def _layer(gen, n=48, k=64, r=8):
    codes, scale = quantize_rows(torch.randn(n, k, generator=gen), "e4m3")
    a = (torch.randn(r, k, generator=gen) / k**0.5).requires_grad_()
    b = (torch.randn(n, r, generator=gen) / r**0.5).requires_grad_()
    return codes, scale, a, b


def _run(fn, x, params):
    """Outputs and the gradients of x and ``params`` under a loss linear in the outputs (weights
    that do not depend on their values: an unread sum's values are never computed)."""
    x = x.clone().requires_grad_()
    y = fn(x)
    y = y if isinstance(y, tuple) else (y,)
    gen = torch.Generator().manual_seed(7)
    sum((t * torch.randn(t.shape, generator=gen)).sum() for t in y).backward()
    return [t.detach() for t in y], [x.grad, *(p.grad.clone() for p in params)]


def _clear(params):
    for p in params:
        p.grad = None


def test_one_layer_and_the_unread_sum_take_the_fused_input_with_the_same_products(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    codes, scale, a, b = _layer(gen)
    x = torch.randn(2, 5, 64, generator=gen)

    def layer(t):
        return lora_linear_fp8(t, codes, scale, a, b, 2.0)

    plain = _run(layer, x, [a, b])
    _clear([a, b])
    force(monkeypatch)
    fused = _run(layer, x, [a, b])
    assert CALLS["fused"] == 1
    for got, want in zip(fused[0] + fused[1], plain[0] + plain[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    # a checkpoint's recompute that reads no output value: x A^T from the same kernel, no codes
    _clear([a, b])
    residual = torch.zeros(2, 5, 48)
    unread = _run(lambda t: lora_linear_fp8(t, codes, scale, a, b, 2.0, unread_sum_with=residual), x, [a, b])
    assert CALLS["fused"] == 2
    for got, want in zip(unread[1], fused[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_layers_sharing_an_input_take_it_once_with_each_layers_products(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    layers = [_layer(gen, n=n) for n in (48, 32)]
    x = torch.randn(7, 64, generator=gen)
    bits = [c.view(torch.uint8) for c, *_ in layers]
    scales = [s for _, s, *_ in layers]
    adapters_a = [a for *_, a, _ in layers]
    adapters_b = [b for *_, b in layers]
    params = adapters_a + adapters_b
    plain = _run(
        lambda t: SharedInputLoraFP8.apply(t, (2.0, 0.5), "e4m3", False, *bits, *scales, *params), x, params
    )
    _clear(params)
    force(monkeypatch)
    group = _run(
        lambda t: SharedInputLoraFP8.apply(t, (2.0, 0.5), "e4m3", False, *bits, *scales, *params), x, params
    )
    assert CALLS["fused"] == 1
    for got, want in zip(group[0] + group[1], plain[0] + plain[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    _clear(params)
    alone_outputs = []
    for (codes, scale, a, b), s in zip(layers, (2.0, 0.5)):
        alone_outputs.append(lora_linear_fp8(x, codes, scale, a, b, s).detach())
    for got, want in zip(group[0], alone_outputs):
        assert torch.equal(got, want)  # each output the layer's alone, bit for bit


def test_4bit_storage_with_fp8_compute_takes_the_fused_input(monkeypatch):
    """QLoRA with FP8 compute (``sloth::lora_linear_4bit_fp8``): the same outputs and gradients."""
    storage = quantize_4bit(torch.randn(48, 64, generator=torch.Generator().manual_seed(2)) * 0.1, "nf4")
    bits = (storage.packed, storage.block_absmax(), storage.code, storage.blocksize)
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(8, 64, generator=gen) / 8).requires_grad_()
    b = (torch.randn(48, 8, generator=gen) / 3).requires_grad_()
    x = torch.randn(6, 64, generator=gen)

    def layer(t):
        return lora_linear_4bit_fp8(t, *bits, a, b, 2.0)

    plain = _run(layer, x, [a, b])
    _clear([a, b])
    force(monkeypatch)
    fused = _run(layer, x, [a, b])
    assert CALLS["fused"] == 1
    for got, want in zip(fused[0] + fused[1], plain[0] + plain[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_fused_input_is_off_by_default_and_switched_from_the_environment(monkeypatch):
    from lightning_sloth.ops import fp8 as fp8_ops

    monkeypatch.delenv("LIGHTNING_SLOTH_FP8_FUSED_INPUT", raising=False)
    assert fp8_ops._fused_input_from_environment() is False
    for value, expected in (("1", True), (" 0 ", False)):
        monkeypatch.setenv("LIGHTNING_SLOTH_FP8_FUSED_INPUT", value)
        assert fp8_ops._fused_input_from_environment() is expected
    monkeypatch.setenv("LIGHTNING_SLOTH_FP8_FUSED_INPUT", "yes")
    with pytest.raises(ValueError, match="must be 1 or 0, got 'yes'"):
        fp8_ops._fused_input_from_environment()
    monkeypatch.setattr(fp8_ops, "FUSED_LORA_INPUT", False)  # off: never taken, whatever the device
    assert not fp8_ops.runs_fused_lora_input(torch.zeros(4, 32), 16, [torch.zeros(2, 32)])
