"""GQA in the "varlen" backend without repeated K/V heads, on CPU.

The flash kernels need CUDA, so the two flash calls are replaced by a float64 reference with the
flash kernel's GQA contract (query head ``h`` reads K/V head ``h // groups``; ``dk``/``dv`` come back
with the K/V head count). What is checked is the wiring around them: which path runs, which head
counts reach the kernels, and that the gradients of q, k and v equal those of the repeat path.
"""

from __future__ import annotations

import math

import _processes
import pytest
import torch

from lightning_sloth.attention import get_varlen_kv_repeat, set_varlen_kv_repeat
from lightning_sloth.attention import varlen as attention

torch.set_num_threads(1)

SEGMENTS = [7, 1, 13, 5, 3]


def _reference_attention(q, k, v, cu, scale, window_left):
    """``[T, Hq, D]`` document-causal attention in float64 with K/V heads shared by query groups."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seq_len = q.shape[0]
    pos = torch.arange(seq_len)
    doc = torch.searchsorted(cu.long(), pos, right=True) - 1
    distance = pos[:, None] - pos[None, :]
    keep = (doc[:, None] == doc[None, :]) & (distance >= 0)
    if window_left >= 0:
        keep &= distance <= window_left
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    scores = scores.masked_fill(~keep, -math.inf)
    lse = scores.logsumexp(-1)
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v.double())
    return out, lse


class _FakeFlash:
    """Stands in for ``_flash_varlen_forward/_backward``; records the K/V head counts it is given."""

    def __init__(self):
        self.kv_heads: list[int] = []

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):
        self.kv_heads.append(k.shape[1])
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        out, lse = _reference_attention(q, k, v, cu_q, scale, window_left)
        return out.to(q.dtype), lse.float(), torch.zeros(2), torch.empty(0)

    def backward(
        self, grad, q, k, v, out, lse, rng_state, unused, cu_q, cu_k, max_q, max_k, scale, window_left
    ):
        self.kv_heads.append(k.shape[1])
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():  # autograd runs a backward with grad mode off
            ref, _ = _reference_attention(q64, k64, v64, cu_q, scale, window_left)
        dq, dk, dv = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def fake_flash(monkeypatch):
    fake = _FakeFlash()
    set_varlen_kv_repeat(False)  # the default: the direct path under test
    monkeypatch.setattr(attention, "_flash_varlen_forward", fake.forward)
    monkeypatch.setattr(attention, "_flash_varlen_backward", fake.backward)
    # The torch 2.11 situation: varlen_attn cannot take fewer K/V heads.
    monkeypatch.setattr(attention, "_VARLEN_HAS_GQA", False)
    yield fake
    set_varlen_kv_repeat(False)  # back to the default


def _inputs(heads_q=6, heads_kv=2, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_len = sum(SEGMENTS)

    def make(heads):
        return torch.randn(1, seq_len, heads, head_dim, generator=gen).transpose(1, 2).requires_grad_()

    return make(heads_q), make(heads_kv), make(heads_kv)


def _cu():
    return torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 4])
def test_direct_gqa_matches_float64_reference(fake_flash, window):
    q, k, v = _inputs()
    scale = 0.3
    out = attention.varlen_packed(q, k, v, _cu(), _cu(), max(SEGMENTS), max(SEGMENTS), scale, window)
    assert out.shape == (1, sum(SEGMENTS), 6, 16)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    window_left = -1 if window is None else window - 1
    ref, _ = _reference_attention(
        q64[0].transpose(0, 1), k64[0].transpose(0, 1), v64[0].transpose(0, 1), _cu(), scale, window_left
    )
    ref = ref.unsqueeze(0)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for got, exp in zip((dq, dk, dv), want):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)
    # Forward and backward both saw the 2 K/V heads, not 6 repeated ones.
    assert fake_flash.kv_heads == [2, 2]


def test_repeat_switch_gives_the_same_gradients(fake_flash, monkeypatch):
    """With the switch on, K/V are repeated and torch's varlen_attn runs (here: the reference)."""
    calls = []

    def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **extra):
        calls.append((k.shape[1], extra))
        return _reference_attention(q, k, v, cu_q, scale, window_size[0])[0].to(q.dtype)

    monkeypatch.setattr(attention, "varlen_attn", varlen_stand_in)
    args = (_cu(), _cu(), max(SEGMENTS), max(SEGMENTS), 0.25, None)
    grad = torch.randn(1, sum(SEGMENTS), 6, 16, generator=torch.Generator().manual_seed(2))

    q, k, v = _inputs(seed=3)
    direct = attention.varlen_packed(q, k, v, *args)
    direct_grads = torch.autograd.grad(direct, (q, k, v), grad)
    assert not calls and fake_flash.kv_heads == [2, 2]

    set_varlen_kv_repeat(True)
    assert get_varlen_kv_repeat()
    repeated = attention.varlen_packed(q, k, v, *args)
    repeated_grads = torch.autograd.grad(repeated, (q, k, v), grad)
    assert calls == [(6, {})]
    torch.testing.assert_close(direct, repeated, rtol=1e-6, atol=1e-6)
    for a, b in zip(direct_grads, repeated_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_with_enable_gqa_uses_it(monkeypatch):
    """Where varlen_attn takes enable_gqa, it gets the K/V heads as they are."""
    calls = []

    def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **extra):
        calls.append((k.shape[1], extra))
        return _reference_attention(q, k, v, cu_q, scale, window_size[0])[0].to(q.dtype)

    monkeypatch.setattr(attention, "varlen_attn", varlen_stand_in)
    monkeypatch.setattr(attention, "_VARLEN_HAS_GQA", True)
    q, k, v = _inputs()
    set_varlen_kv_repeat(True)  # the copy, switched back on
    try:
        attention.varlen_packed(q, k, v, _cu(), _cu(), max(SEGMENTS), max(SEGMENTS), 0.25, None)
    finally:
        set_varlen_kv_repeat(False)
    assert calls == [(6, {})]
    attention.varlen_packed(q, k, v, _cu(), _cu(), max(SEGMENTS), max(SEGMENTS), 0.25, None)  # the default
    assert calls[1:] == [(2, {"enable_gqa": True})]


def test_default_reads_kv_heads_in_place():
    """A fresh process starts without the K/V copy (other tests here switch it back and forth)."""
    import sys

    code = "from lightning_sloth.attention import get_varlen_kv_repeat as g; assert g() is False"
    _processes.run([sys.executable, "-c", code], check=True, timeout=120)


def test_switch_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        set_varlen_kv_repeat("yes")
