"""FP8 base weights on CPU: the row-wise format and its error bounds, ``sloth::linear_fp8`` against the
emulation (exactly) and against the float64 product (within FP8's error), forward and backward, opcheck;
``LinearFP8`` from bf16 and from NF4; LoRA over FP8 bases trains and its gradients equal the emulated
reference; ``SlothPrecision(base_dtype="fp8")`` and its refusals; the Hydra preset; torchao's float8
training."""

import copy
import sys

import pytest
import torch
from _models import add_lora, packed_batch, random_documents, tiny_llama
from _trainer import fit_recording_losses
from lightning.pytorch import seed_everything
from torch import nn

from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.ops.fp8 import fp8_from_4bit, linear_4bit_fp8, linear_fp8, linear_fp8_grad
from lightning_sloth.ops.fp8_formats import (
    check_fp8_device,
    dequantize_rows,
    fp8_linear_grad_reference,
    fp8_linear_reference,
    quantize_rows,
)
from lightning_sloth.ops.fp8_lora import lora_linear_fp8
from lightning_sloth.ops.fp8_qlora import lora_linear_4bit_fp8
from lightning_sloth.quant import Linear4bit, quantize_model
from lightning_sloth.quant.fp8 import LinearFP8, float8_training, fp8_base_model, fp8_compute_4bit
from lightning_sloth.transform import transform_model

# Half a unit in the last place, relative (normal numbers), and the subnormal half-spacing in units
# of the row scale: e4m3 has 3 mantissa bits and subnormals 2^-9 apart; e5m2 2 bits and 2^-16.
ROUNDING = {"e4m3": (2.0**-4, 2.0**-10), "e5m2": (2.0**-3, 2.0**-17)}


def _strided(rows, cols, seed):
    """A non-contiguous ``[rows, cols]`` float32 tensor with a wide spread of magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(rows, 2 * cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    return big[:, ::2]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_row_quantisation_round_trip_is_within_half_an_ulp(fmt):
    t = _strided(37, 53, seed=1)
    t[5] = 0.0
    assert not t.is_contiguous()
    q, scale = quantize_rows(t, fmt)
    assert q.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    assert scale.shape == (37, 1) and scale.dtype == torch.float32
    back = dequantize_rows(q, scale)
    relative, subnormal = ROUNDING[fmt]
    bound = t.abs() * relative + scale * subnormal
    assert ((back - t).abs() <= bound * (1 + 1e-6)).all()
    # Each row's largest magnitude lands on the format's largest value; a zero row stays zero.
    fmax = torch.finfo(q.dtype).max
    assert torch.allclose(q.float().abs().amax(1)[t.abs().amax(1) > 0], torch.tensor(fmax))
    assert scale[5].item() == 1.0 and (back[5] == 0).all()
    # Values already on the grid of their row come back exactly.
    assert torch.equal(dequantize_rows(*quantize_rows(back, fmt)), back)


def test_quantize_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="e4m3"):
        quantize_rows(torch.randn(3, 4), "e3m4")
    with pytest.raises(ValueError, match="rows, cols"):
        quantize_rows(torch.randn(3, 4, 5))


def _weight(out_features, in_features, seed):
    w = _strided(out_features, in_features, seed) * 0.2
    return w, *quantize_rows(w, "e4m3")


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
def test_linear_fp8_equals_the_emulation_and_the_float64_product_within_fp8_error(grad_format):
    w, codes, scale = _weight(29, 53, seed=2)
    x = _strided(2 * 19, 53, seed=3).reshape(2, 19, 53).requires_grad_()
    y = linear_fp8(x, codes, scale, grad_format)
    assert y.shape == (2, 19, 29) and y.dtype == torch.float32
    rows = x.detach().reshape(-1, 53)
    assert torch.equal(y.detach().reshape(-1, 29), fp8_linear_reference(rows, codes, scale))
    # Against the exact product with the unquantised weight: each term is off by at most the two
    # operands' roundings (e4m3: 2^-4 each), plus the subnormal floor.
    exact = rows.double() @ w.double().t()
    magnitude = rows.abs().double() @ w.abs().double().t()
    error = (y.detach().reshape(-1, 29).double() - exact).abs()
    assert (error <= magnitude * (2 * 2.0**-4 + 2.0**-8) + 1e-6).all()
    assert error.max() > 0  # it is FP8, not a float32 product

    dy = _strided(38, 29, seed=4).reshape(2, 19, 29)
    y.backward(dy)
    flat = dy.reshape(-1, 29)
    assert torch.equal(x.grad.reshape(-1, 53), fp8_linear_grad_reference(flat, codes, scale, grad_format))
    assert torch.equal(x.grad, linear_fp8_grad(dy, codes, scale, grad_format))
    exact_dx = flat.double() @ w.double()
    dx_bound = {"e4m3": 2 * 2.0**-4, "e5m2": 2.0**-3 + 2.0**-4, "bf16": 2.0**-4}[grad_format] + 2.0**-8
    dx_error = (x.grad.reshape(-1, 53).double() - exact_dx).abs()
    assert (dx_error <= (flat.abs().double() @ w.abs().double()) * dx_bound + 1e-6).all()


def test_linear_fp8_in_bfloat16_matches_the_emulation():
    w, codes, scale = _weight(32, 48, seed=5)
    x = torch.randn(7, 48).bfloat16()
    y = linear_fp8(x, codes, scale)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp8_linear_reference(x, codes, scale))


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
def test_opcheck(grad_format):
    w, codes, scale = _weight(16, 24, seed=6)
    x = torch.randn(5, 24, requires_grad=True)
    bits = codes.view(torch.uint8)
    torch.library.opcheck(torch.ops.sloth.linear_fp8.default, (x, bits, scale, grad_format))
    torch.library.opcheck(
        torch.ops.sloth.linear_fp8_grad.default, (torch.randn(5, 16), bits, scale, grad_format)
    )


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
def test_lora_linear_fp8_equals_the_base_product_plus_the_adapter(grad_format):
    """One op for LoRA over an FP8 base: the output and the gradients of x, A and B are those of
    ``linear_fp8(x) + scale (x A^T) B^T`` composed of separate ops (float32; the adapter's parts
    are added into the FP8 products' outputs instead of summed after)."""
    w, codes, scale = _weight(32, 48, seed=11)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 9, 48, generator=gen)
    a, b = torch.randn(4, 48, generator=gen) * 0.1, torch.randn(32, 4, generator=gen) * 0.1
    dy = torch.randn(3, 9, 32, generator=gen)
    results = []
    for fused in (True, False):
        xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
        if fused:
            y = lora_linear_fp8(xs, codes, scale, as_, bs, 0.5, grad_format)
        else:
            y = linear_fp8(xs, codes, scale, grad_format) + 0.5 * (xs @ as_.t()) @ bs.t()
        y.backward(dy)
        results.append((y.detach(), xs.grad, as_.grad, bs.grad))
    for got, want, name in zip(results[0], results[1], ("y", "dx", "dA", "dB")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # rank 0 (no adapter rows) and no rows at all
    empty = lora_linear_fp8(x, codes, scale, a[:0], b[:, :0], 0.5, grad_format)
    torch.testing.assert_close(empty, linear_fp8(x, codes, scale, grad_format))
    assert lora_linear_fp8(x[:, :0], codes, scale, a, b, 0.5, grad_format).shape == (3, 0, 32)


@pytest.mark.parametrize("grad_format", ["e4m3", "bf16"])
def test_lora_linear_fp8_opcheck(grad_format):
    w, codes, scale = _weight(16, 32, seed=13)
    bits = codes.view(torch.uint8)
    x, a, b = (
        torch.randn(6, 32, requires_grad=True),
        torch.randn(4, 32, requires_grad=True),
        torch.randn(16, 4, requires_grad=True),
    )
    torch.library.opcheck(torch.ops.sloth.lora_linear_fp8.default, (x, bits, scale, a, b, 0.5, grad_format))
    xa = x.detach() @ a.detach().t()
    args = (torch.randn(6, 16), x.detach(), xa, bits, scale, a.detach(), b.detach(), 0.5, grad_format)
    for need in ((True, True, True), (True, False, False), (False, True, True)):
        torch.library.opcheck(torch.ops.sloth.lora_linear_fp8_backward.default, (*args, *need))


def test_lora_linear_fp8_rejects_adapters_that_do_not_fit():
    w, codes, scale = _weight(16, 32, seed=14)
    x = torch.randn(6, 32)
    with pytest.raises(ValueError, match="do not fit the weight"):
        lora_linear_fp8(x, codes, scale, torch.randn(4, 31), torch.randn(16, 4), 1.0)
    with pytest.raises(ValueError, match="do not fit the weight"):
        lora_linear_fp8(x, codes, scale, torch.randn(4, 32), torch.randn(15, 4), 1.0)
    with pytest.raises(TypeError, match="must be in x's dtype"):
        lora_linear_fp8(x, codes, scale, torch.randn(4, 32).double(), torch.randn(16, 4), 1.0)


def test_linear_fp8_rejects_bad_input():
    w, codes, scale = _weight(16, 24, seed=7)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        linear_fp8(torch.randn(3, 24), w, scale)
    with pytest.raises(ValueError, match=r"\[16, 1\]"):
        linear_fp8(torch.randn(3, 24), codes, scale.t())
    with pytest.raises(ValueError, match="does not fit"):
        linear_fp8(torch.randn(3, 23), codes, scale)
    with pytest.raises(ValueError, match="bf16"):
        linear_fp8(torch.randn(3, 24), codes, scale, "fp16")


def test_linear_fp8_layer_from_bf16_and_from_nf4():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    layer = LinearFP8.from_linear(linear)
    assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
    codes, scale = layer.fp8_weight()
    assert torch.equal(codes.float(), quantize_rows(linear.weight.detach())[0].float())
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), fp8_linear_reference(x, codes, scale) + linear.bias.detach())
    # bf16 conversion (Lightning's half precision) moves the codes and scales but never converts them.
    half = copy.deepcopy(layer).to(torch.bfloat16)
    assert torch.equal(half.weight, layer.weight) and torch.equal(half.weight_scale, layer.weight_scale)
    # A bf16 checkpoint loaded into the FP8 layer is refused, not cast.
    with pytest.raises(ValueError, match="FP8"):
        layer.load_state_dict(linear.state_dict())
    layer.load_state_dict(copy.deepcopy(layer.state_dict()))

    four = Linear4bit.from_linear(linear, "nf4")
    from_four = LinearFP8.from_4bit(four)
    from lightning_sloth.quant import dequantize_4bit_reference

    expected, _ = quantize_rows(dequantize_4bit_reference(four.storage(), torch.float32))
    assert torch.equal(from_four.fp8_weight()[0].float(), expected.float())
    assert torch.equal(from_four.bias, linear.bias.detach())


class _EmulatedBase(torch.autograd.Function):
    """The FP8 base product written with the emulation functions only (the oracle of the op's wiring)."""

    @staticmethod
    def forward(ctx, x, codes, scale, grad_format):
        ctx.save_for_backward(codes, scale)
        ctx.grad_format = grad_format
        return fp8_linear_reference(x.reshape(-1, x.shape[-1]), codes, scale).view(
            *x.shape[:-1], codes.shape[0]
        )

    @staticmethod
    def backward(ctx, dy):
        codes, scale = ctx.saved_tensors
        dx = fp8_linear_grad_reference(dy.reshape(-1, dy.shape[-1]), codes, scale, ctx.grad_format)
        return dx.view(*dy.shape[:-1], codes.shape[1]), None, None, None


def _emulate(model):
    """Every ``LinearFP8`` of ``model`` computes through :class:`_EmulatedBase` (its class forward
    replaced on the instance; PEFT's own LoRA forward runs around it)."""
    for module in model.modules():
        if isinstance(module, LinearFP8):
            module.forward = lambda x, m=module: _EmulatedBase.apply(x, *m.fp8_weight(), m.grad_format)


@pytest.mark.parametrize("grad_format", ["e4m3", "bf16"])
def test_lora_over_fp8_bases_gives_the_emulated_gradients(grad_format):
    model = add_lora(tiny_llama())
    converted = fp8_base_model(model, grad_format=grad_format)
    assert len(converted) == 14 and not any("lm_head" in n or "lora_" in n for n in converted)
    reference = copy.deepcopy(model)
    _emulate(reference)
    for m in (model, reference):
        report = transform_model(m, kernels=True)
        assert "lora" not in report.kernels.skipped  # every LoRA layer runs the quantised-base path
    batch = packed_batch(random_documents([23, 17, 30], seed=3))
    losses, grads = [], []
    for m in (model, reference):
        m.train()
        loss = m(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for name in grads[0]:
        if grad_format == "bf16":
            torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)
            continue
        # An e4m3 input gradient quantises dy to 3 mantissa bits: the fused LoRA path and PEFT's
        # composed one hand each base layer a dy that differs in the float32 rounding of its sums,
        # enough to move an element across an e4m3 rounding boundary (one code: 1/8 of its value).
        # The flips compound towards the first layer (measured: at most 0.3% of a gradient's norm
        # there, 4.5e-7 with bf16 input gradients); a wrong scale, format or layout is O(1).
        error = (grads[0][name] - grads[1][name]).norm() / grads[1][name].norm()
        assert error < 2**-6, (name, float(error))


def test_fp8_bases_stay_close_to_the_float32_model():
    dense = add_lora(tiny_llama())
    fp8 = copy.deepcopy(dense)
    fp8_base_model(fp8)
    batch = packed_batch(random_documents([40, 25], seed=4))
    with torch.no_grad():
        loss_dense = dense(**batch.model_inputs(), labels=batch.labels).loss
        loss_fp8 = fp8(**batch.model_inputs(), labels=batch.labels).loss
    assert loss_fp8 != loss_dense
    assert abs(loss_fp8 / loss_dense - 1) < 0.01


def test_fp8_base_model_converts_4bit_layers_and_refuses_an_empty_model():
    model = add_lora(tiny_llama())
    quantize_model(model, "nf4")
    converted = fp8_base_model(model)
    assert len(converted) == 14
    assert not any(isinstance(m, Linear4bit) for m in model.modules())
    assert fp8_base_model(model) == []  # already in FP8
    with pytest.raises(ValueError, match="no linear layer"):
        fp8_base_model(nn.Sequential(nn.ReLU()))


def _fit(precision):
    seed_everything(0)
    data = PackedDataModule(build_char_tokenizer(), train=SyntheticTask(64, seed=1), max_tokens=256)
    module = CausalLMModule(tiny_llama(), lora=LoraSettings(r=8), optimizer=OptimizerSettings(lr=2e-2))
    losses = fit_recording_losses(module, data, precision, max_steps=8)
    return module, losses


def test_trainer_with_fp8_bases_trains():
    module, losses = _fit(SlothPrecision("32-true", base_dtype="fp8"))
    model = find_hf_model(module)
    fp8 = [name for name, m in model.named_modules() if isinstance(m, LinearFP8)]
    assert len(fp8) == 10 and not any(part in name for name in fp8 for part in ("k_proj", "v_proj"))
    assert losses[-1] < losses[0] * 0.9


def test_fp8_skip_keeps_the_key_and_value_products_out_of_fp8_by_default():
    """``fp8_skip`` (default ``FP8_SKIP``: k_proj, v_proj) keeps those layers in the compute dtype,
    in 16 bits or, with ``quantize``, in their 4-bit storage computed in the compute dtype;
    ``fp8_skip=()`` puts every base layer but ``quantize_skip`` in FP8."""
    from lightning_sloth.quant import FP8_SKIP

    assert FP8_SKIP == ("k_proj", "v_proj")
    model = SlothPrecision("32-true", base_dtype="fp8").convert_module(add_lora(tiny_llama()))
    attention = model.base_model.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj.base_layer, LinearFP8)
    assert type(attention.k_proj.base_layer) is nn.Linear and type(attention.v_proj.base_layer) is nn.Linear
    assert sum(isinstance(m, LinearFP8) for m in model.modules()) == 10
    every = SlothPrecision("32-true", base_dtype="fp8", fp8_skip=()).convert_module(add_lora(tiny_llama()))
    assert sum(isinstance(m, LinearFP8) for m in every.modules()) == 14
    qlora = SlothPrecision("32-true", quantize="nf4", base_dtype="fp8").convert_module(add_lora(tiny_llama()))
    layers = {name: m for name, m in qlora.named_modules() if isinstance(m, Linear4bit)}
    assert len(layers) == 14  # the storage: every layer in 4 bits
    in_fp8 = sorted(name.split(".")[-2] for name, m in layers.items() if m.fp8_grad is not None)
    assert in_fp8 == sorted(["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2)
    assert SlothPrecision("32-true", base_dtype="fp8", fp8_skip="o_proj").fp8_skip == ("o_proj",)


def test_precision_validates_fp8_choices():
    precision = SlothPrecision("32-true", base_dtype="fp8", fp8_grad="e5m2")
    assert precision.base_dtype == "fp8" and precision.fp8_grad == "e5m2"
    qlora = SlothPrecision("32-true", quantize="nf4", base_dtype="fp8", fp8_grad="bf16")
    model = qlora.convert_module(add_lora(tiny_llama()))
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 14 and sorted(str(m.fp8_grad) for m in layers) == ["None"] * 4 + ["bf16"] * 10
    with pytest.raises(ValueError, match="base_dtype"):
        SlothPrecision("32-true", base_dtype="fp4")
    with pytest.raises(ValueError, match="fp8_grad|gradient format"):
        SlothPrecision("32-true", base_dtype="fp8", fp8_grad="fp16")
    with pytest.raises(ValueError, match="float16"):
        SlothPrecision("16-true", base_dtype="fp8")
    with pytest.raises(ValueError, match="exclude each other"):
        SlothPrecision("32-true", base_dtype="fp8", fp8_training=True)
    with pytest.raises(ValueError, match="4-bit"):
        SlothPrecision("32-true", quantize="nf4", fp8_training=True)


@pytest.mark.parametrize(
    ("capability", "refused"), [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)]
)
def test_fp8_is_refused_on_gpus_without_fp8_tensor_cores(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    if refused:
        with pytest.raises(
            RuntimeError,
            match=rf"compute capability {capability[0]}\.{capability[1]}.*8\.9|8\.9.*{capability[0]}\.{capability[1]}",
        ):
            SlothPrecision("bf16-true", base_dtype="fp8")
        with pytest.raises(RuntimeError, match="NVIDIA Test GPU"):
            check_fp8_device("cuda")
    else:
        assert SlothPrecision("bf16-true", base_dtype="fp8").base_dtype == "fp8"
        check_fp8_device("cuda")
    check_fp8_device("cpu")  # the emulation runs anywhere else


def test_hydra_preset_builds_the_fp8_precision():
    from hydra import compose, initialize_config_module

    from lightning_sloth import build
    from lightning_sloth.config import validate

    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        cfg = compose("train", overrides=["precision=fp8_lora", "precision.fp8_grad=bf16"])
        validate(cfg)
        precision = build.build_precision(cfg.precision)
        assert precision.base_dtype == "fp8" and precision.fp8_grad == "bf16"
        assert precision.quantize is None and precision.quantize_skip == ("lm_head",)
        assert precision.fp8_skip == ("k_proj", "v_proj")
        every = compose("train", overrides=["precision=fp8_lora", "precision.fp8_skip=[]"])
        assert build.build_precision(every.precision).fp8_skip == ()
        qlora = build.build_precision(
            compose("train", overrides=["precision=fp8_lora", "precision.quantize=nf4"]).precision
        )
        assert qlora.quantize == "nf4" and qlora.base_dtype == "fp8"
        full = compose("train", overrides=["precision=fp8_full", "lora.enabled=false"])
        validate(full)
        assert full.precision.fp8_training is True


def test_float8_training_converts_with_torchao_or_names_the_extra(monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_llama()
    converted = float8_training(model)
    assert len(converted) == 14 and "lm_head" not in converted
    assert isinstance(model.model.layers[0].mlp.down_proj, Float8Linear)
    assert type(model.lm_head) is nn.Linear
    with pytest.raises(ValueError, match="base_dtype='fp8'"):
        float8_training(add_lora(tiny_llama()))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"lightning-sloth\[fp8\]"):
        float8_training(tiny_llama())


def test_fp8_bases_dequantise_for_merging():
    from lightning_sloth.quant import dequantize_model

    model = add_lora(tiny_llama())
    fp8_base_model(model)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    dense = layer.base_layer.dequantized(torch.float32)
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    assert len(dequantize_model(model)) == 14
    assert type(layer.base_layer) is nn.Linear and torch.equal(layer.base_layer.weight, dense)
    merged = model.merge_and_unload()
    torch.testing.assert_close(merged.model.layers[1].mlp.down_proj.weight, dense + delta.detach())


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
def test_4bit_storage_with_fp8_compute_equals_the_emulation(grad_format):
    from lightning_sloth.quant import dequantize_4bit_reference, quantize_4bit

    w = _strided(48, 64, seed=8) * 0.1
    storage = quantize_4bit(w, "nf4")
    codes, scale = quantize_rows(dequantize_4bit_reference(storage, torch.bfloat16), "e4m3")
    args = (storage.packed, storage.block_absmax(), storage.code, storage.blocksize)
    got_codes, got_scale = fp8_from_4bit(*args, (48, 64))
    assert torch.equal(got_codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(got_scale, scale)
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = linear_4bit_fp8(x, *args, 48, grad_format)
    assert torch.equal(
        y.detach().reshape(-1, 48), fp8_linear_reference(x.detach().reshape(-1, 64), codes, scale)
    )
    dy = torch.randn(3, 5, 48)
    y.backward(dy)
    expected = fp8_linear_grad_reference(dy.reshape(-1, 48), codes, scale, grad_format)
    assert torch.equal(x.grad.reshape(-1, 64), expected)
    bits = storage.packed, storage.block_absmax(), storage.code
    torch.library.opcheck(
        torch.ops.sloth.linear_4bit_fp8.default,
        (x.detach().reshape(-1, 64).requires_grad_(), *bits, 64, 48, grad_format),
    )


@pytest.mark.parametrize("grad_format", ["e4m3", "bf16"])
def test_lora_over_4bit_storage_with_fp8_compute_in_one_op_equals_it_over_the_fp8_codes(grad_format):
    """``sloth::lora_linear_4bit_fp8`` decodes the 4-bit weight inside the op (forward and backward)
    and then computes exactly what ``sloth::lora_linear_fp8`` computes over the same e4m3 codes."""
    from lightning_sloth.quant import dequantize_4bit_reference, quantize_4bit

    storage = quantize_4bit(_strided(48, 64, seed=9) * 0.1, "nf4")
    codes, scale = quantize_rows(dequantize_4bit_reference(storage, torch.bfloat16), "e4m3")
    bits = (storage.packed, storage.block_absmax(), storage.code, storage.blocksize)
    gen = torch.Generator().manual_seed(10)
    x, a, b = (
        torch.randn(2, 7, 64, generator=gen),
        torch.randn(4, 64, generator=gen),
        torch.randn(48, 4, generator=gen),
    )
    dy = torch.randn(2, 7, 48, generator=gen)
    results = []
    for four_bit in (True, False):
        xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
        if four_bit:
            y = lora_linear_4bit_fp8(xs, *bits, as_, bs, 0.25, grad_format)
        else:
            y = lora_linear_fp8(xs, codes, scale, as_, bs, 0.25, grad_format)
        y.backward(dy)
        results.append((y.detach(), xs.grad, as_.grad, bs.grad))
    for got, want, name in zip(results[0], results[1], ("y", "dx", "dA", "dB")):
        assert torch.equal(got, want), name
    rows = x.reshape(-1, 64).requires_grad_()
    torch.library.opcheck(
        torch.ops.sloth.lora_linear_4bit_fp8.default, (rows, *bits, a.requires_grad_(), b, 0.25, grad_format)
    )
    xa = x.reshape(-1, 64) @ a.detach().t()
    args = (dy.reshape(-1, 48), x.reshape(-1, 64), xa, *bits, a.detach(), b, 0.25, grad_format)
    for need in ((True, True, True), (False, True, False)):
        torch.library.opcheck(torch.ops.sloth.lora_linear_4bit_fp8_backward.default, (*args, *need))
    with pytest.raises(ValueError, match="do not fit x"):
        lora_linear_4bit_fp8(x, *bits, a[:, :10], b, 0.25)


@pytest.mark.parametrize("grad_format", ["e4m3", "bf16"])
def test_layers_sharing_an_input_over_fp8_bases_quantise_it_once_with_the_layers_outputs(
    grad_format, monkeypatch
):
    """q/k/v (or gate/up) over FP8 bases as one node: x quantised once instead of once per layer, the
    outputs bit for bit the separate ``lora_linear_fp8`` ops', every gradient theirs (float32, up to
    the order of the sums)."""
    from lightning_sloth.ops import fp8_formats, fp8_lora

    gen = torch.Generator().manual_seed(15)
    weights = [quantize_rows(torch.randn(n, 64, generator=gen) * 0.1, "e4m3") for n in (64, 32, 32)]
    a = [torch.randn(8, 64, generator=gen) for _ in weights]
    b = [torch.randn(n, 8, generator=gen) for n in (64, 32, 32)]
    x = torch.randn(1, 37, 64, generator=gen)
    dys = [torch.randn(1, 37, n, generator=gen) for n in (64, 32, 32)]
    calls = []

    def counting(t, fmt):
        calls.append(tuple(t.shape))
        return quantize_rows(t, fmt)

    monkeypatch.setattr(fp8_formats, "quantize_rows", counting)
    monkeypatch.setattr(fp8_lora, "quantize_rows", counting)
    results = []
    for grouped in (True, False):
        xs = x.clone().requires_grad_()
        as_ = [t.clone().requires_grad_() for t in a]
        bs = [t.clone().requires_grad_() for t in b]
        calls.clear()
        if grouped:
            bits = [c.view(torch.uint8) for c, _ in weights]
            ys = fp8_lora.SharedInputLoraFP8.apply(
                xs, (0.5,) * 3, grad_format, False, *bits, *[s for _, s in weights], *as_, *bs
            )
        else:
            ys = [
                lora_linear_fp8(xs, c, s, ai, bi, 0.5, grad_format)
                for (c, s), ai, bi in zip(weights, as_, bs)
            ]
        forward_quantisations = calls.count((37, 64))
        torch.autograd.backward(ys, dys)
        results.append(([y.detach() for y in ys], (xs.grad, *[t.grad for t in as_], *[t.grad for t in bs])))
        assert forward_quantisations == (1 if grouped else 3)
    (got_y, got_g), (want_y, want_g) = results
    for got, want in zip(got_y, want_y):
        assert torch.equal(got, want)
    for got, want in zip(got_g, want_g):  # sums in another order: a few float32 ulps of the largest
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_a_model_with_fp8_bases_groups_q_k_v_and_gate_up_with_the_same_loss_and_gradients():
    """In a model, grouped layers over FP8 bases (the default) give the loss of the layers one by one
    bit for bit and the same gradients (float32, relative 1e-5); the report's groups hold them."""
    batch = packed_batch(random_documents([23, 17, 30], seed=3))
    results = []
    for grouped in (True, False):
        model = add_lora(tiny_llama())
        fp8_base_model(model, grad_format="bf16")
        report = transform_model(model, kernels=True)
        assert [len(g) for g in report.checkpointing._groups[0]] == [3, 2]
        report.checkpointing.group_projections = grouped
        model.train()
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (want_loss, want_grads) = results
    assert torch.equal(loss, want_loss)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fp8_bases_with_k_and_v_kept_group_each_kind_with_the_same_loss_and_gradients(monkeypatch):
    """``k_proj``/``v_proj`` kept in 16 bits beside an FP8 ``q_proj``: k and v run as one 16-bit node,
    q its own FP8 op, gate/up one FP8 node; the loss bit for bit that of q, k and v one by one."""
    from lightning_sloth.ops import fp8_lora
    from lightning_sloth.ops.lora_groups import _SharedInputLora

    batch = packed_batch(random_documents([23, 17, 30], seed=3))
    nodes = []
    for cls in (_SharedInputLora, fp8_lora.SharedInputLoraFP8):
        apply = cls.apply
        monkeypatch.setattr(
            cls, "apply", lambda *a, _f=apply, _c=cls: nodes.append((_c, len(a[1]))) or _f(*a)
        )
    results = []
    for grouped in (True, False):
        nodes.clear()
        model = add_lora(tiny_llama())
        converted = fp8_base_model(model, skip=("lm_head", "k_proj", "v_proj"), grad_format="bf16")
        assert converted and not any(
            name.endswith(("k_proj.base_layer", "v_proj.base_layer")) for name in converted
        )
        report = transform_model(model, kernels=True)
        report.checkpointing.group_projections = grouped
        model.train()
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        # Per layer (two), forward and recompute. gate/up are one FP8 node either way: the MLP's
        # activation takes their LoRA parts (glu_lora, on by default) from that node.
        gate_up = [(fp8_lora.SharedInputLoraFP8, 2)] * 4
        if grouped:
            assert sorted(nodes, key=str) == sorted([(_SharedInputLora, 2)] * 4 + gate_up, key=str)
        else:
            assert nodes == gate_up
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (want_loss, want_grads) = results
    assert torch.equal(loss, want_loss)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_qlora_with_fp8_compute_keeps_the_4bit_storage_and_equals_fp8_bases_of_its_weights():
    from lightning_sloth.quant import dequantize_4bit_reference

    nf4 = add_lora(tiny_llama())
    quantize_model(nf4, "nf4")
    fp8 = copy.deepcopy(nf4)
    assert len(fp8_compute_4bit(fp8, "e4m3")) == 14
    assert sum(isinstance(m, Linear4bit) for m in fp8.modules()) == 14  # storage unchanged
    # The reference: FP8 bases made from each 4-bit weight decoded to bf16, as the op decodes it.
    reference = copy.deepcopy(nf4)
    for name, module in list(reference.named_modules()):
        if isinstance(module, Linear4bit):
            dense = dequantize_4bit_reference(module.storage(), torch.bfloat16)
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, LinearFP8.from_weight(dense, module.bias))
    batch = packed_batch(random_documents([40, 25], seed=5))
    losses, grads = [], []
    for m in (nf4, fp8, reference):
        transform_model(m, kernels=True)
        loss = m(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad]))
    assert losses[0] != losses[1] and abs(losses[1] / losses[0] - 1) < 0.01
    torch.testing.assert_close(losses[1], losses[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[1], grads[2], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="no 4-bit layer"):
        fp8_compute_4bit(tiny_llama())


def test_flop_parameters_count_each_fp8_code_once_and_each_4bit_byte_twice():
    """The benchmarks' model FLOPs (6 · parameters · tokens) do not change with the base's storage:
    an FP8 layer holds one value per uint8, a 4-bit layer two."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_sloth.module import flop_parameters
    from lightning_sloth.quant import quantize_model

    def tiny():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        return LlamaForCausalLM(config).requires_grad_(False)

    expected = flop_parameters(tiny())
    fp8 = tiny()
    assert fp8_base_model(fp8)
    assert any(p.dtype == torch.uint8 for p in fp8.parameters())
    assert flop_parameters(fp8) == expected
    nf4 = tiny()
    assert quantize_model(nf4)
    assert flop_parameters(nf4) == expected


def test_unit_scales_are_cached_for_eager_calls_only():
    """The input gradient's ``[1, k]`` unit scales: one cached tensor per width in eager calls, a
    fresh one while tracing (``torch.compile`` runs a decomposed op's body on fake tensors): a
    cached real tensor must not enter a fake trace, nor a fake one the cache."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from lightning_sloth.ops import fp8 as fp8_ops

    fp8_ops._cached_unit_scales.cache_clear()
    with FakeTensorMode():
        traced = fp8_ops._unit_scales(48, torch.device("cpu"))
    assert isinstance(traced, FakeTensor) and fp8_ops._cached_unit_scales.cache_info().currsize == 0
    eager = fp8_ops._unit_scales(48, torch.device("cpu"))
    assert not isinstance(eager, FakeTensor) and torch.equal(eager, torch.ones(1, 48))
    assert fp8_ops._unit_scales(48, torch.device("cpu")) is eager
    with FakeTensorMode():
        assert isinstance(fp8_ops._unit_scales(48, torch.device("cpu")), FakeTensor)
