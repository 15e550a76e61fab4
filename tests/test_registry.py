"""The sloth_op factory: one registration path that works in eager, under compile, opcheck and FlopCounterMode."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops import registry
from lightning_sloth.ops.registry import TRITON_OPS, register_flops, sloth_op, use_triton


@sloth_op("registry_test_scale")
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


_scale.register_fake(lambda x, factor: torch.empty_like(x))
_scale.register_autograd(
    lambda ctx, grad: (_scale(grad, ctx.factor), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]),
)
register_flops(_scale, lambda x, factor, out_shape=None: math.prod(x))


def test_op_lives_in_the_sloth_namespace():
    x = torch.randn(3, 4)
    torch.testing.assert_close(torch.ops.sloth.registry_test_scale(x, 2.5), x * 2.5)


def test_triton_ops_only_with_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectation")
    assert TRITON_OPS is False
    assert not use_triton(torch.randn(2))


def test_interpreter_selects_the_custom_op_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry._triton_ops_usable() is False


def test_float64_never_goes_to_triton(monkeypatch):
    monkeypatch.setattr(registry, "TRITON_OPS", True)
    assert not use_triton(torch.randn(2, dtype=torch.float64))
    assert not use_triton(torch.randn(2))  # a CPU tensor


def test_namespaced_name_is_refused():
    with pytest.raises(ValueError, match="bare op name"):
        sloth_op("sloth::twice")


def test_opcheck_compile_and_flops():
    x = torch.randn(5, 7, requires_grad=True)
    torch.library.opcheck(_scale, (x, 3.0))

    compiled = torch.compile(lambda t: _scale(t, 3.0).sin(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), (x * 3.0).sin())

    with FlopCounterMode(display=False) as counter:
        _scale(x, 3.0).sum().backward()
    assert counter.get_flop_counts()["Global"][torch.ops.sloth.registry_test_scale] == 2 * 35
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_eager_calls_skip_the_library_path_and_match_it_exactly():
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_sloth.ops.registry import call
    from lightning_sloth.ops.rms_norm import _rms_norm, rms_norm

    x = torch.randn(5, 24, requires_grad=True)
    weight = torch.randn(24, requires_grad=True)
    grad = torch.randn(5, 24)

    fast = rms_norm(x, weight, 1e-6)
    assert "eager" in type(fast.grad_fn).__name__  # the autograd.Function, not the library's wrapper
    fast_grads = torch.autograd.grad(fast, (x, weight), grad)
    library = _rms_norm(x, weight, 1e-6, 0.0)[0]
    assert "eager" not in type(library.grad_fn).__name__
    library_grads = torch.autograd.grad(library, (x, weight), grad)
    assert torch.equal(fast, library)
    assert all(torch.equal(a, b) for a, b in zip(fast_grads, library_grads))

    # Anything that intercepts ops sees the op itself: FLOP counting, compile, fake tensors.
    with FlopCounterMode(display=False) as counter:
        call(_rms_norm, x, weight, 1e-6, 0.0)[0].sum().backward()
    assert counter.get_flop_counts()["Global"][torch.ops.sloth.rms_norm] > 0
    compiled = torch.compile(lambda a, b: rms_norm(a, b, 1e-6), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, weight), fast)


def test_eager_calls_bind_no_signature(monkeypatch):
    """An eager op call with autograd goes through the op's autograd.Function without binding its
    arguments through inspect.signature (host time per call, per op, per layer), and its backward
    is the op's registered formula."""
    import inspect

    from lightning_sloth.ops.rms_norm import rms_norm

    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(8, requires_grad=True)
    expected = rms_norm(x, weight, 1e-6)
    (gx_expected, gw_expected) = torch.autograd.grad(expected.square().sum(), (x, weight))
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or real(*a, **k))
    y = rms_norm(x, weight, 1e-6)
    grads = torch.autograd.grad(y.square().sum(), (x, weight))
    assert calls == []
    assert y.grad_fn is not None and "rms_norm_eager" in type(y.grad_fn).__name__
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(grads, (gx_expected, gw_expected), rtol=0, atol=0)
