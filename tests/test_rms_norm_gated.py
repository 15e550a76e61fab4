"""sloth::rms_norm_gated: float64 agreement, transformers' Qwen3.5 module, op checks, compile, FLOPs,
bad input, and the Triton kernels under the interpreter (``test_kernels_under_triton_interpreter``
reruns the ``interpreted`` cases in a fresh process)."""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from test_rms_norm import EPS, _make, _weight  # the inputs' layouts and the weights
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.rms_norm_gated import (
    _rms_norm_gated,
    _rms_norm_gated_backward,
    rms_norm_gated,
    rms_norm_gated_backward_reference,
    rms_norm_gated_reference,
)


def _reference64(x, gate, weight):
    x = x.double()
    return (
        x
        * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        * weight.double()
        * torch.nn.functional.silu(gate.double())
    )


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_forward_and_backward_match_float64(layout):
    x = _make((3, 37, 4, 24), layout).requires_grad_()
    gate = _make((3, 37, 4, 24), layout).requires_grad_()
    weight = _weight(24).requires_grad_()
    y = rms_norm_gated(x, gate, weight, EPS)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    grad_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, gate, weight), grad_y)
    inputs64 = [t.detach().double().requires_grad_() for t in (x, gate, weight)]
    y64 = _reference64(*inputs64)
    grads64 = torch.autograd.grad(y64, inputs64, grad_y.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for ours, want in zip(grads, grads64):
        torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_qwen3_5_module_and_its_gradients(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    module = Qwen3_5RMSNormGated(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(_weight(32))
    x = torch.randn(5, 11, 32, dtype=dtype, requires_grad=True)
    gate = torch.randn(5, 11, 32, dtype=dtype, requires_grad=True)
    y_hf = module(x, gate)
    y = rms_norm_gated(x, gate, module.weight, module.variance_epsilon)
    assert torch.equal(y, y_hf)  # the same operations in the same order
    grad_y = torch.randn_like(y)
    theirs = torch.autograd.grad(y_hf, (x, gate, module.weight), grad_y)
    ours = torch.autograd.grad(y, (x, gate, module.weight), grad_y)
    # fp32: the same math up to the order of sums; bf16: autograd rounds each step's gradient to bf16.
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), **tolerance)


def test_a_float32_weight_over_bf16_activations_keeps_the_product_in_float32():
    """Lightning's bf16-mixed keeps fp32 parameters: ``weight * x_hat`` is then fp32, not rounded."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    module = Qwen3_5RMSNormGated(64)
    with torch.no_grad():
        module.weight.copy_(_weight(64))
    x, gate = torch.randn(7, 64).bfloat16(), torch.randn(7, 64).bfloat16()
    assert torch.equal(rms_norm_gated(x, gate, module.weight, 1e-6), module(x, gate))


def test_frozen_weight_gets_no_gradient():
    x = torch.randn(5, 16, requires_grad=True)
    gate = torch.randn(5, 16, requires_grad=True)
    weight = _weight(16)
    rms_norm_gated(x, gate, weight, EPS).sum().backward()
    assert x.grad is not None and gate.grad is not None and weight.grad is None


def test_opcheck():
    x = _make((3, 7, 2, 16), "transposed").requires_grad_()
    gate = torch.randn(3, 7, 2, 16, requires_grad=True)
    weight = _weight(16).requires_grad_()
    torch.library.opcheck(_rms_norm_gated, (x, gate, weight, EPS))
    rstd = torch.rand(3, 7, 2) + 0.5
    torch.library.opcheck(
        _rms_norm_gated_backward,
        (torch.randn(3, 7, 2, 16), x.detach(), gate.detach(), weight.detach(), rstd),
    )


def test_compiles_fullgraph():
    x = torch.randn(3, 5, 2, 16, requires_grad=True)
    gate = torch.randn(3, 5, 2, 16, requires_grad=True)
    weight = _weight(16).requires_grad_()
    compiled = torch.compile(lambda a, b, c: rms_norm_gated(a, b, c, EPS), fullgraph=True)
    y = compiled(x, gate, weight)
    grad_y = torch.randn_like(y)
    y_eager = rms_norm_gated(x, gate, weight, EPS)
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(
        torch.autograd.grad(y, (x, gate, weight), grad_y),
        torch.autograd.grad(y_eager, (x, gate, weight), grad_y),
    )


def test_flops_are_counted():
    x = torch.randn(6, 50, requires_grad=True)
    gate = torch.randn(6, 50, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        rms_norm_gated(x, gate, _weight(50).requires_grad_(), EPS).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.sloth.rms_norm_gated] == 7 * 300
    assert counts[torch.ops.sloth.rms_norm_gated_backward] == 16 * 300


@pytest.mark.parametrize(
    ("gate", "weight", "match"),
    [
        (torch.randn(2, 7), torch.ones(8), "gate must have x's shape"),
        (torch.randn(2, 8), torch.ones(7), r"weight must have shape \(8,\)"),
        (torch.randn(2, 8), torch.ones(8, dtype=torch.int64), "must be floating point"),
    ],
)
def test_bad_input_is_named(gate, weight, match):
    with pytest.raises(ValueError, match=match):
        rms_norm_gated(torch.randn(2, 8), gate, weight, EPS)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("shape", "layout"),
    [((3, 37, 2, 24), "transposed"), ((2, 3, 5, 64), "contiguous"), ((5, 8, 128), "strided")],
)
def test_kernels_interpreted(dtype, shape, layout):
    from lightning_sloth.kernels.rms_norm_gated import rms_norm_gated_backward, rms_norm_gated_forward

    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    x, gate = _make(shape, layout, dtype), _make(shape, layout, dtype)
    for weight in (_weight(shape[-1], dtype), _weight(shape[-1])):  # the product rounded, or fp32
        round_product = weight.dtype == dtype and dtype != torch.float32
        y, rstd = rms_norm_gated_forward(x, gate, weight, EPS, round_product)
        y_ref, rstd_ref = rms_norm_gated_reference(x, gate, weight, EPS)
        torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(y, y_ref, **tolerance)
        grad_y = _make(shape, layout, dtype)
        got = rms_norm_gated_backward(grad_y, x, gate, weight, rstd, round_product)
        want = rms_norm_gated_backward_reference(grad_y, x, gate, weight, rstd_ref)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **tolerance)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
