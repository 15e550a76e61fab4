"""sloth::rms_norm: float64 agreement, Hugging Face modules, op checks, compile, and the Triton kernels.

The Triton kernels run on CPU under the Triton interpreter. ``TRITON_INTERPRET`` must be set before
triton is imported, so ``test_kernels_under_triton_interpreter`` reruns this file's ``interpreted``
cases in a fresh process with it set (they skip in the normal run).
"""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.rms_norm import (
    _rms_norm,
    _rms_norm_backward,
    rms_norm,
    rms_norm_backward_reference,
    rms_norm_reference,
)

EPS = 1e-6


def _make(shape, layout, dtype=torch.float32):
    """Fresh random input of ``shape`` laid out contiguous, with permuted leading dims, or with a strided last dim."""
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype)
    if layout == "transposed":
        return torch.randn(shape[1], shape[0], *shape[2:], dtype=dtype).transpose(0, 1)
    return torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


def _weight(n, dtype=torch.float32):
    return (1.0 + 0.5 * torch.randn(n)).to(dtype)


def _reference64(x, weight, offset):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (weight.double() + offset)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_forward_and_backward_match_float64(offset, layout):
    x = _make((3, 37, 123), layout).requires_grad_()
    weight = _weight(123).requires_grad_()
    y = rms_norm(x, weight, EPS, offset)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    grad_y = torch.randn_like(y)
    grad_x, grad_w = torch.autograd.grad(y, (x, weight), grad_y)

    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y64 = _reference64(x64, w64, offset)
    grad_x64, grad_w64 = torch.autograd.grad(y64, (x64, w64), grad_y.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_x.double(), grad_x64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w.double(), grad_w64, rtol=1e-5, atol=1e-4)


def test_rstd_is_saved_by_the_forward():
    x = torch.randn(4, 9, 33)
    _, rstd = _rms_norm(x, _weight(33), EPS, 0.0)
    assert rstd.dtype == torch.float32 and rstd.shape == (4, 9)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(x.double().pow(2).mean(-1) + EPS))


def test_frozen_weight_gets_no_gradient():
    x = torch.randn(5, 40, requires_grad=True)
    weight = _weight(40)
    rms_norm(x, weight, EPS).sum().backward()
    assert x.grad is not None and weight.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_llama_rms_norm_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(123, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(_weight(123))
    module.to(dtype)
    x = torch.randn(3, 37, 123, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, module.weight, module.variance_epsilon), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_gemma3_rms_norm_exactly(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    module = Gemma3RMSNorm(123, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(0.3 * torch.randn(123))
    module.to(dtype)
    x = torch.randn(3, 37, 123, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, module.weight, module.eps, offset=1.0), module(x), rtol=0, atol=0)


def test_matches_qwen3_per_head_norm_and_its_gradients():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    module = Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(_weight(64))
    x = torch.randn(2, 11, 5, 64, requires_grad=True)  # [B, T, heads, head_dim], as q_norm sees it
    grad_y = torch.randn(2, 11, 5, 64)
    y = rms_norm(x, module.weight, module.variance_epsilon)
    y_hf = module(x)
    torch.testing.assert_close(y, y_hf, rtol=0, atol=0)
    ours = torch.autograd.grad(y, (x, module.weight), grad_y)
    theirs = torch.autograd.grad(y_hf, (x, module.weight), grad_y)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_opcheck(offset):
    x = _make((3, 7, 33), "transposed").requires_grad_()
    weight = _weight(33).requires_grad_()
    torch.library.opcheck(_rms_norm, (x, weight, EPS, offset))
    rstd = torch.rand(3, 7) + 0.5
    torch.library.opcheck(
        _rms_norm_backward, (torch.randn(3, 7, 33), x.detach(), weight.detach(), rstd, offset)
    )


def test_compiles_fullgraph():
    def norm_twice(x, w, w_gemma):
        return rms_norm(rms_norm(x, w, EPS), w_gemma, EPS, offset=1.0)

    x = torch.randn(3, 5, 48, requires_grad=True)
    w = _weight(48).requires_grad_()
    w_gemma = (0.1 * torch.randn(48)).requires_grad_()
    grad_y = torch.randn(3, 5, 48)
    compiled = torch.compile(norm_twice, fullgraph=True)
    y = compiled(x, w, w_gemma)
    grads = torch.autograd.grad(y, (x, w, w_gemma), grad_y)
    y_eager = norm_twice(x, w, w_gemma)
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(grads, torch.autograd.grad(y_eager, (x, w, w_gemma), grad_y))


def test_flops_are_counted():
    x = torch.randn(6, 50, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        rms_norm(x, _weight(50).requires_grad_(), EPS).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.sloth.rms_norm] == 4 * 300
    assert counts[torch.ops.sloth.rms_norm_backward] == 9 * 300


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        (torch.ones(7), r"weight must have shape \(8,\)"),
        (torch.ones(8, dtype=torch.int64), "must be floating point"),
    ],
)
def test_bad_input_is_named(weight, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(torch.randn(2, 8), weight, EPS)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize(
    ("shape", "layout"),
    [((3, 37, 123), "transposed"), ((2, 3, 5, 64), "contiguous"), ((5, 8, 1000), "strided")],
)
def test_kernels_interpreted(dtype, offset, shape, layout):
    from lightning_sloth.kernels.rms_norm import rms_norm_backward, rms_norm_forward

    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    x = _make(shape, layout, dtype)
    weight = _weight(shape[-1], dtype)
    y, rstd = rms_norm_forward(x, weight, EPS, offset, cast_before_weight=offset == 0.0)
    y_ref, rstd_ref = rms_norm_reference(x, weight, EPS, offset)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(y, y_ref, **tolerance)

    grad_y = _make(shape, layout, dtype)
    grad_x, grad_w = rms_norm_backward(grad_y, x, weight, rstd, offset)
    grad_x_ref, grad_w_ref = rms_norm_backward_reference(grad_y, x, weight, rstd_ref, offset)
    torch.testing.assert_close(grad_x, grad_x_ref, **tolerance)
    torch.testing.assert_close(grad_w, grad_w_ref, **tolerance)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
