"""sloth::add_rms_norm: the residual add fused into RMSNorm, against float64 and the unfused modules.

The Triton kernels run on CPU under the Triton interpreter (fresh process, see tests/_interpreter.py).
"""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.rms_norm import (
    _add_rms_norm,
    _add_rms_norm_backward,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm_backward_reference,
)

EPS = 1e-6


def _make(shape, layout, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(shape, generator=gen).to(dtype)
    if layout == "transposed":
        return torch.randn(shape[1], shape[0], *shape[2:], generator=gen).to(dtype).transpose(0, 1)
    return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., ::2]


def _weight(n, dtype=torch.float32):
    return (1.0 + 0.5 * torch.randn(n, generator=torch.Generator().manual_seed(7))).to(dtype)


def _reference64(x, residual, weight, offset):
    s = x.double() + residual.double()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * (weight.double() + offset)
    return y, s


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_forward_and_backward_match_float64(offset, layout):
    x = _make((3, 37, 123), layout, seed=1).requires_grad_()
    residual = _make((3, 37, 123), "contiguous", seed=2).requires_grad_()
    weight = _weight(123).requires_grad_()
    y, s = add_rms_norm(x, residual, weight, EPS, offset)
    assert y.shape == s.shape == x.shape and y.is_contiguous() and s.is_contiguous()
    grad_y, grad_s = torch.randn_like(y), torch.randn_like(s)
    grads = torch.autograd.grad((y, s), (x, residual, weight), (grad_y, grad_s))

    leaves64 = [t.detach().double().requires_grad_() for t in (x, residual, weight)]
    y64, s64 = _reference64(*leaves64, offset)
    grads64 = torch.autograd.grad((y64, s64), leaves64, (grad_y.double(), grad_s.double()))
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.double(), s64, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, grads64):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_only_the_norm_output_used():
    """A sum nobody reads: its gradient is zero, the norm's gradient reaches both summands."""
    x = torch.randn(4, 33, requires_grad=True)
    residual = torch.randn(4, 33, requires_grad=True)
    weight = _weight(33)
    y, _ = add_rms_norm(x, residual, weight, EPS)
    grad_y = torch.randn_like(y)
    gx, gr = torch.autograd.grad(y, (x, residual), grad_y)
    s = (x + residual).detach()
    rstd = torch.rsqrt(s.pow(2).mean(-1) + EPS)
    want, _ = rms_norm_backward_reference(grad_y, s, weight, rstd, 0.0)
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gr, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_unfused_add_and_llama_norm_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(123, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(_weight(123))
    module.to(dtype)
    x, residual = _make((3, 37, 123), "contiguous", dtype, 3), _make((3, 37, 123), "contiguous", dtype, 4)
    y, s = add_rms_norm(x, residual, module.weight, module.variance_epsilon)
    want_s = residual + x
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(y, module(want_s), rtol=0, atol=0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_opcheck(offset):
    x = _make((3, 7, 33), "transposed").requires_grad_()
    residual = _make((3, 7, 33), "contiguous", seed=5).requires_grad_()
    weight = _weight(33).requires_grad_()
    torch.library.opcheck(_add_rms_norm, (x, residual, weight, EPS, offset))
    summed = (x + residual).detach()
    rstd = torch.rand(3, 7) + 0.5
    torch.library.opcheck(
        _add_rms_norm_backward,
        (torch.randn(3, 7, 33), torch.randn(3, 7, 33), summed, weight.detach(), rstd, offset),
    )


def test_compiles_fullgraph():
    def block(x, residual, w):
        y, s = add_rms_norm(x, residual, w, EPS)
        return y * 2 + s

    x, residual = torch.randn(3, 5, 48, requires_grad=True), torch.randn(3, 5, 48, requires_grad=True)
    w = _weight(48).requires_grad_()
    grad = torch.randn(3, 5, 48)
    out = torch.compile(block, fullgraph=True)(x, residual, w)
    grads = torch.autograd.grad(out, (x, residual, w), grad)
    eager = block(x, residual, w)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(grads, torch.autograd.grad(eager, (x, residual, w), grad))


def test_flops_are_counted():
    x, residual = torch.randn(6, 50, requires_grad=True), torch.randn(6, 50)
    with FlopCounterMode(display=False) as counter:
        y, s = add_rms_norm(x, residual, _weight(50), EPS)
        (y.sum() + s.sum()).backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.sloth.add_rms_norm] == 5 * 300
    assert counts[torch.ops.sloth.add_rms_norm_backward] == 10 * 300


@pytest.mark.parametrize(
    ("residual", "weight", "match"),
    [
        (torch.randn(2, 7), torch.ones(8), "residual must match x"),
        (torch.randn(2, 8, dtype=torch.float64), torch.ones(8), "residual must match x"),
        (torch.randn(2, 8), torch.ones(7), r"weight must have shape \(8,\)"),
    ],
)
def test_bad_input_is_named(residual, weight, match):
    with pytest.raises(ValueError, match=match):
        add_rms_norm(torch.randn(2, 8), residual, weight, EPS)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize(
    ("shape", "layout"),
    [((3, 37, 123), "transposed"), ((2, 3, 5, 64), "contiguous"), ((5, 8, 1000), "strided")],
)
def test_kernels_interpreted(dtype, offset, shape, layout):
    from lightning_sloth.kernels.rms_norm import add_rms_norm_forward, rms_norm_backward

    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    x, residual = _make(shape, layout, dtype, 1), _make(shape, "contiguous", dtype, 2)
    weight = _weight(shape[-1], dtype)
    y, s, rstd = add_rms_norm_forward(x, residual, weight, EPS, offset, cast_before_weight=offset == 0.0)
    y_ref, s_ref, rstd_ref = add_rms_norm_reference(x, residual, weight, EPS, offset)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(y, y_ref, **tolerance)

    grad_y, grad_s = _make(shape, layout, dtype, 3), _make(shape, "strided", dtype, 4)
    grad_x, grad_w = rms_norm_backward(grad_y, s, weight, rstd, offset, grad_sum=grad_s)
    want_x, want_w = rms_norm_backward_reference(grad_y, s, weight, rstd_ref, offset)
    want_x = (want_x.float() + grad_s.float()).to(dtype)
    torch.testing.assert_close(grad_x, want_x, **tolerance)
    torch.testing.assert_close(grad_w, want_w, **tolerance)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
