"""sloth::lora_linear on CPU: float64 reference, PEFT parity and fallbacks, opcheck, compile, FLOPs."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.lora import lora_linear
from lightning_sloth.ops.lora_layers import fused_lora_forward

N, IN, OUT, R = 37, 48, 40, 5
SCALE = 1.7


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(4321)


def _weights(dtype=torch.float32):
    weight = torch.randn(OUT, IN, dtype=dtype) / IN**0.5
    lora_a = (torch.randn(R, IN, dtype=dtype) / IN**0.5).requires_grad_()
    lora_b = torch.randn(OUT, R, dtype=dtype).requires_grad_()
    return weight, lora_a, lora_b


def _reference(x, weight, lora_a, lora_b, scale):
    leaves = [t.detach().double().requires_grad_() for t in (x, lora_a, lora_b)]
    xd, a, b = leaves
    return xd @ weight.double().t() + scale * (xd @ a.t()) @ b.t(), leaves


@pytest.mark.parametrize("scale", [SCALE, 2.0, 1.0, 0.25])
@pytest.mark.parametrize("shape", [(N, IN), (3, 7, IN)])
def test_forward_backward_match_float64(shape, scale):
    weight, lora_a, lora_b = _weights()
    x = torch.randn(shape).requires_grad_()
    y = lora_linear(x, weight, lora_a, lora_b, scale)
    grad_y = torch.randn(y.shape)
    y.backward(grad_y)

    ref, (xd, a, b) = _reference(x, weight, lora_a, lora_b, scale)
    ref.backward(grad_y.double())
    assert y.shape == (*shape[:-1], OUT) and y.dtype == torch.float32
    for got, expected in [(y, ref), (x.grad, xd.grad), (lora_a.grad, a.grad), (lora_b.grad, b.grad)]:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * max(1.0, scale))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_overwrite_input_gives_the_same_gradients_in_the_inputs_memory(layout):
    weight, lora_a, lora_b = _weights()
    leaf = (
        torch.randn(N, IN, requires_grad=True)
        if layout == "contiguous"
        else torch.randn(IN, N).requires_grad_()
    )
    grad_y = torch.randn(N, OUT)

    def fresh():  # a fresh intermediate, as the activation's output is
        return leaf * 1 if layout == "contiguous" else (leaf * 1).t()

    expected = torch.autograd.grad(
        lora_linear(fresh(), weight, lora_a, lora_b, SCALE), (leaf, lora_a, lora_b), grad_y
    )
    x = fresh()
    seen = []
    x.register_hook(lambda grad: seen.append(grad.data_ptr()))
    y = lora_linear(x, weight, lora_a, lora_b, SCALE, overwrite_input=True)
    got = torch.autograd.grad(y, (leaf, lora_a, lora_b), grad_y)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert seen == [x.data_ptr()]  # x's gradient was written where x was


@pytest.mark.parametrize("scale", [SCALE, 2.0])
@pytest.mark.parametrize("needs", [(True, True), (False, True), (True, False)])
def test_inplace_backward_opcheck(needs, scale):
    weight, lora_a, lora_b = _weights()
    x = torch.randn(2, 5, IN)
    xa = x.reshape(-1, IN) @ lora_a.detach().t()
    args = (torch.randn(2, 5, OUT), x, xa, weight, lora_a.detach(), lora_b.detach(), scale, *needs)
    torch.library.opcheck(torch.ops.sloth.lora_linear_backward_.default, args)


def test_noncontiguous_input_and_partial_gradients():
    weight, lora_a, lora_b = _weights()
    lora_a.requires_grad_(False)
    x = torch.randn(IN, N).t()  # [N, IN] transposed view, no grad
    y = lora_linear(x, weight, lora_a, lora_b, SCALE)
    y.backward(torch.ones_like(y).expand_as(y))  # a stride-0 gradient
    ref, (_, _, b) = _reference(x, weight, lora_a, lora_b, SCALE)
    ref.sum().backward()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora_b.grad.double(), b.grad, rtol=1e-5, atol=1e-5)
    assert lora_a.grad is None


def test_bad_inputs_raise_clear_errors():
    weight, lora_a, lora_b = _weights()
    x = torch.randn(N, IN)
    with pytest.raises(TypeError, match="floating-point"):
        lora_linear(x.long(), weight, lora_a, lora_b, SCALE)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_linear(x, weight, lora_a, lora_b.t(), SCALE)
    with pytest.raises(TypeError, match="share a dtype"):
        lora_linear(x, weight.double(), lora_a, lora_b, SCALE)
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, weight.requires_grad_(), lora_a, lora_b, SCALE)


@pytest.mark.parametrize("scale", [SCALE, 2.0])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, True), (True, False, False)])
def test_opcheck(needs, scale):
    weight, lora_a, lora_b = _weights()
    x = torch.randn(2, 5, IN, requires_grad=needs[0])
    lora_a.requires_grad_(needs[1])
    lora_b.requires_grad_(needs[2])
    torch.library.opcheck(torch.ops.sloth.lora_linear.default, (x, weight, lora_a, lora_b, scale))
    grad_y = torch.randn(2, 5, OUT)
    xa = x.detach().reshape(-1, IN) @ lora_a.detach().t()
    torch.library.opcheck(
        torch.ops.sloth.lora_linear_backward.default,
        (grad_y, x.detach(), xa, weight, lora_a.detach(), lora_b.detach(), scale, *needs),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0, 0.5, 1.0, 8.0])
@pytest.mark.parametrize("overwrite_input", [False, True])
def test_power_of_two_scale_as_alpha_gives_the_scaled_operands_values(dtype, scale, overwrite_input):
    """A power-of-two scale is applied as the backward products' alpha (no [N, r] multiplies); the
    gradients equal, bit for bit, those of scaling the small operands first (the general path)."""
    from lightning_sloth.ops import lora as lora_ops

    weight, lora_a, lora_b = (t.detach().to(dtype) for t in _weights())
    x, xa = torch.randn(N, IN, dtype=dtype), None
    xa = x @ lora_a.t()
    dy = torch.randn(N, OUT, dtype=dtype)
    g = (dy @ lora_b) * scale
    want = ((dy @ weight).addmm_(g, lora_a), g.t() @ x, dy.t() @ (xa * scale))
    assert lora_ops.exact_alpha(scale) and not lora_ops.exact_alpha(SCALE)
    if overwrite_input:
        target = x.clone()
        da, db = lora_ops._lora_linear_backward_inplace_op(
            dy, target, xa, weight, lora_a, lora_b, scale, True, True
        )
        got = (target, da, db)
    else:
        got = lora_ops._lora_linear_backward_op(dy, x, xa, weight, lora_a, lora_b, scale, True, True, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_flop_count():
    weight, lora_a, lora_b = _weights()
    x = torch.randn(N, IN, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        lora_linear(x, weight, lora_a, lora_b, SCALE).sum().backward()
    forward = 2 * N * (IN * OUT + IN * R + R * OUT)
    backward = 2 * N * (OUT * R + OUT * IN + R * IN + R * IN + OUT * R)
    assert counter.get_total_flops() == forward + backward


def test_compile_fullgraph_matches_eager():
    weight, lora_a, lora_b = _weights()
    x = torch.randn(3, 7, IN)
    y_eager = lora_linear(x, weight, lora_a, lora_b, SCALE)
    y_eager.square().sum().backward()
    expected = (lora_a.grad.clone(), lora_b.grad.clone())
    lora_a.grad = lora_b.grad = None

    compiled = torch.compile(lambda t: lora_linear(t, weight, lora_a, lora_b, SCALE), fullgraph=True)
    # The on-disk compile caches key on a graph that holds only a call to the op, so an entry compiled
    # before an edit of the op's backward would be reused: compile afresh.
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        y = compiled(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close((lora_a.grad, lora_b.grad), expected)


class _Block(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=bias)


def _peft_layer(dtype=torch.float32, bias=False, **config):
    settings = {"r": R, "lora_alpha": 8, "target_modules": ["proj"], "lora_dropout": 0.0, **config}
    model = get_peft_model(_Block(bias).to(dtype), LoraConfig(**settings))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # PEFT initialises B to zero
    return layer


def test_fused_lora_forward_matches_peft_module():
    torch.manual_seed(0)
    layer = _peft_layer(use_rslora=True)
    x = torch.randn(2, 9, IN)
    x_peft, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_y = torch.randn(2, 9, OUT)

    expected = layer(x_peft)
    expected.backward(grad_y)
    expected_grads = [
        p.grad.clone() for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    ]
    layer.zero_grad()

    got = fused_lora_forward(layer, x_fused)
    got.backward(grad_y)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_fused.grad, x_peft.grad, rtol=1e-5, atol=1e-5)
    # PEFT scales the product, the op an operand (rsLoRA's scale is no power of two): float32
    # rounding apart, relative to the gradient's size.
    for p, g in zip((layer.lora_A["default"].weight, layer.lora_B["default"].weight), expected_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5 * g.abs().max().item())
    assert layer.base_layer.weight.grad is None


@pytest.mark.parametrize("bias_trainable", [False, True])
def test_fused_lora_forward_adds_the_base_bias(bias_trainable):
    """A base layer with a bias (Qwen2's q/k/v) fuses: the op's output plus the bias equals PEFT's
    layer, with the input's, the adapter's and (where trainable) the bias's gradients."""
    torch.manual_seed(0)
    layer = _peft_layer(bias=True)
    bias = layer.base_layer.bias
    with torch.no_grad():
        bias.normal_()
    bias.requires_grad_(bias_trainable)
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight] + (
        [bias] if bias_trainable else []
    )
    x = torch.randn(2, 9, IN)
    grad_y = torch.randn(2, 9, OUT)
    results = []
    for forward in (layer, lambda inputs: fused_lora_forward(layer, inputs)):
        inputs = x.clone().requires_grad_()
        y = forward(inputs)
        assert y is not None
        grads = torch.autograd.grad(y, [inputs, *params], grad_y)
        results.append((y.detach(), grads))
    (expected, expected_grads), (got, got_grads) = results
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_the_unread_sum_takes_a_frozen_base_bias_and_refuses_a_trainable_one():
    """The recompute's unread sum (``residual + layer(x)`` for its backward only): a frozen bias
    changes no gradient, so it fuses; a trainable one needs its own, so the caller's path runs."""
    torch.manual_seed(0)
    layer = _peft_layer(bias=True)
    x, residual = torch.randn(2, 9, IN).requires_grad_(), torch.randn(2, 9, OUT).requires_grad_()
    grad_y = torch.randn(2, 9, OUT)
    lora_b = layer.lora_B["default"].weight
    out = fused_lora_forward(layer, x, unread_sum_with=residual)
    got = torch.autograd.grad(out, (x, residual, lora_b), grad_y)
    expected = torch.autograd.grad(residual + layer(x), (x, residual, lora_b), grad_y)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    layer.base_layer.bias.requires_grad_(True)
    assert fused_lora_forward(layer, x, unread_sum_with=residual) is None


def test_fused_lora_forward_bf16_base_with_fp32_adapters():
    layer = _peft_layer(dtype=torch.bfloat16)  # PEFT keeps the adapters in float32
    lora_a = layer.lora_A["default"].weight
    assert layer.base_layer.weight.dtype == torch.bfloat16 and lora_a.dtype == torch.float32
    x = torch.randn(2, 9, IN, dtype=torch.bfloat16)
    expected = layer(x)
    expected.float().square().sum().backward()
    expected_grad = lora_a.grad.clone()
    lora_a.grad = None
    got = fused_lora_forward(layer, x)
    got.float().square().sum().backward()
    assert got.dtype == expected.dtype == torch.bfloat16 and lora_a.grad.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    # PEFT runs the adapter product in float32, this op in bf16: compare the whole gradient's error.
    assert (lora_a.grad - expected_grad).norm() < 1e-2 * expected_grad.norm()


def test_fused_lora_forward_under_autocast():
    layer = _peft_layer()
    x = torch.randn(2, 9, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
        got = fused_lora_forward(layer, x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _peft_layer(lora_dropout=0.1),
        lambda: _peft_layer(use_dora=True),
        lambda: _peft_layer(lora_bias=True),
    ],
    ids=["dropout", "dora", "lora-bias"],
)
def test_fused_lora_forward_falls_back(make):
    assert fused_lora_forward(make(), torch.randn(3, IN)) is None


def test_fused_lora_forward_falls_back_when_disabled_or_merged():
    layer = _peft_layer()
    x = torch.randn(3, IN)
    layer.enable_adapters(False)
    assert fused_lora_forward(layer, x) is None
    layer.enable_adapters(True)
    assert fused_lora_forward(layer, x) is not None
    layer.merge()
    assert fused_lora_forward(layer, x) is None
    assert fused_lora_forward(nn.Linear(IN, OUT), x) is None


def test_fused_lora_forward_decides_again_when_the_layer_changes():
    """Every change of what the plain-case decision depends on, made after a first fused call, takes
    effect on the next call (never a stale fused product)."""
    model = get_peft_model(_Block(), LoraConfig(r=R, lora_alpha=8, target_modules=["proj"]))
    model.add_adapter("other", LoraConfig(r=2 * R, lora_alpha=4, target_modules=["proj"]))
    layer = model.base_model.model.proj
    with torch.no_grad():
        for adapter in ("default", "other"):
            layer.lora_B[adapter].weight.normal_()
    x = torch.randn(3, IN)

    def fused_equals_peft():
        got = fused_lora_forward(layer, x)
        assert got is not None
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)

    fused_equals_peft()
    layer.set_adapter("other")
    fused_equals_peft()  # the other adapter's weights and scaling, not the cached ones
    layer.set_adapter(["default", "other"])
    assert fused_lora_forward(layer, x) is None
    layer.set_adapter("default")
    fused_equals_peft()
    layer.scaling["default"] = 0.5  # PEFT's set_scale writes this dict
    fused_equals_peft()
    with model.disable_adapter():
        assert fused_lora_forward(layer, x) is None
    fused_equals_peft()
    layer.merge(adapter_names=["default"])
    assert fused_lora_forward(layer, x) is None
    layer.unmerge()
    fused_equals_peft()
    layer.lora_dropout["default"] = nn.Dropout(0.1)
    assert fused_lora_forward(layer, x) is None
    layer.lora_dropout["default"] = nn.Identity()
    fused_equals_peft()
    layer.lora_B["default"] = nn.Linear(R, OUT, bias=True)  # a new module, with a bias
    assert fused_lora_forward(layer, x) is None
    layer.base_layer.weight.requires_grad_(True)  # full fine-tuning of the base: PEFT's path
    layer.lora_B["default"] = nn.Linear(R, OUT, bias=False)
    assert fused_lora_forward(layer, x) is None
    layer.base_layer.weight.requires_grad_(False)
    fused_equals_peft()


def test_fused_lora_forward_compiles_without_graph_breaks():
    layer = _peft_layer()
    x = torch.randn(2, 9, IN)
    expected = layer(x)
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        got = torch.compile(lambda t: fused_lora_forward(layer, t), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
