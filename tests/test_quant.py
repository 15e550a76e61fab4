"""4-bit storage (NF4 / NF4-DQ / FP4): round-trip error, bit-exact agreement with bitsandbytes in
both directions, the ops (reference, opcheck, gradients), the 4-bit linear layer and its errors."""

import math

import pytest
import torch
from torch import nn

from lightning_sloth.ops.nf4 import (
    _dequantize_op,
    _lora_4bit_op,
    _matmul_op,
    _matmul_t_op,
    dequantize_4bit,
    lora_linear_4bit,
    matmul_4bit,
)
from lightning_sloth.ops.nf4_formats import code_book, dynamic_code
from lightning_sloth.quant import (
    Linear4bit,
    dequantize_4bit_reference,
    from_bnb,
    quantize_4bit,
    quantize_model,
    to_bnb,
)

SHAPES = [(64, 64), (96, 130), (33, 7), (5, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq", "fp4"])
def test_round_trip_error_within_the_format_bound(quant_type):
    """Each value lands on the nearest code: error <= half the widest code gap times its block's absmax;
    with NF4-DQ the block scale itself is off by at most half a gap of the 8-bit code times its scale,
    and each value by at most that much more."""
    torch.manual_seed(0)
    w = torch.randn(256, 320)
    q = quantize_4bit(w, quant_type)
    error = (dequantize_4bit_reference(q) - w).abs().view(-1, 64)
    code = code_book(quant_type).sort().values
    half_gap = (code[1:] - code[:-1]).max() / 2
    absmax = w.view(-1, 64).abs().amax(1, keepdim=True)
    stored = q.block_absmax().unsqueeze(1)
    scale_error = (stored - absmax).abs()
    if quant_type.endswith("dq"):
        gaps = dynamic_code()[1:] - dynamic_code()[:-1]
        nested = q.nested_absmax.repeat_interleave(256)[: absmax.numel()].unsqueeze(1)
        assert (scale_error <= gaps.max() / 2 * nested * 1.0001).all()
    else:
        assert torch.equal(stored, absmax)
    assert (error <= half_gap * stored * (1 + 1e-6) + scale_error * (1 + 1e-6)).all()
    # The 4-bit format's typical error on normal weights: about a tenth of the scale.
    assert (error.pow(2).mean().sqrt() / w.std()) < {"nf4": 0.11, "nf4-dq": 0.11, "fp4": 0.16}[quant_type]
    # 4 bits a weight, plus 32 bits a block of 64 (NF4-DQ: 8 bits a block, 32 per 256 blocks).
    books = 64 + (1024 + 4 if quant_type.endswith("dq") else 0)
    bits = 4 + (8 / 64 + 32 / 64 / 256 if quant_type.endswith("dq") else 32 / 64)
    assert q.nbytes() - books == w.numel() * bits / 8


def test_storage_layout():
    q = quantize_4bit(torch.randn(33, 7), "nf4")
    assert q.packed.shape == (116, 1) and q.packed.dtype == torch.uint8
    assert q.absmax.shape == (math.ceil(231 / 64),) and q.absmax.dtype == torch.float32
    dq = quantize_4bit(torch.randn(300, 300), "nf4-dq")
    assert dq.absmax.dtype == torch.uint8 and dq.nested_absmax.shape == (math.ceil(1407 / 256),)
    assert dq.offset.dim() == 0 and dq.nested_code.shape == (256,)


# ------------------------------------------------------------------------------------ bitsandbytes
bnb = pytest.importorskip("bitsandbytes.functional")


def test_code_books_are_bitsandbytes_code_books():
    assert torch.equal(code_book("nf4"), bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(code_book("fp4"), bnb.get_4bit_type("fp4", device="cpu"))  # -0.0 == 0.0
    assert torch.equal(dynamic_code(), bnb.create_dynamic_map(signed=True))


@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq", "fp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_exact_with_bitsandbytes_both_directions(shape, dtype, quant_type):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape, dtype=dtype)
    nested = quant_type.endswith("-dq")
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type=quant_type[:3], compress_statistics=nested)
    theirs = bnb.dequantize_4bit(packed, state)
    mine_of_theirs = dequantize_4bit_reference(from_bnb(packed, state))
    ours = quantize_4bit(w, quant_type)
    theirs_of_ours = bnb.dequantize_4bit(*to_bnb(ours))
    mine = dequantize_4bit_reference(ours)
    assert mine.dtype == theirs.dtype == dtype
    if quant_type == "fp4":
        # bitsandbytes' CPU kernel decodes code 8 as -0.0, its odd-shape fallback as +0.0: equal values.
        assert torch.equal(mine_of_theirs, theirs) and torch.equal(theirs_of_ours, mine)
    else:
        assert torch.equal(_bits(mine_of_theirs), _bits(theirs))
        assert torch.equal(_bits(theirs_of_ours), _bits(mine))
    # Same codes and scales as bitsandbytes' own quantiser (its nested scales may round a tie apart).
    assert torch.equal(ours.packed, packed)
    if not nested:
        assert torch.equal(ours.absmax, state.absmax)


# ------------------------------------------------------------------------------------------- ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_op_equals_reference(dtype):
    q = quantize_4bit(torch.randn(37, 130), "nf4-dq")
    got = dequantize_4bit(q.packed, q.block_absmax(), q.code, 64, (37, 130), dtype)
    assert torch.equal(_bits(got), _bits(dequantize_4bit_reference(q, dtype)))


@pytest.mark.parametrize("rank", [4, 0])
def test_lora_linear_4bit_matches_float64_reference(rank):
    torch.manual_seed(0)
    q = quantize_4bit(torch.randn(45, 70), "nf4")
    w = dequantize_4bit_reference(q, torch.float64)
    x = torch.randn(2, 9, 70, dtype=torch.float64).float().requires_grad_()
    a = torch.randn(rank, 70).requires_grad_()
    b = torch.randn(45, rank).requires_grad_()
    y = lora_linear_4bit(x, q.packed, q.absmax, q.code, 64, a, b, 0.5)
    grad = torch.randn_like(y)
    y.backward(grad)
    xr, ar, br = (t.detach().double().requires_grad_() for t in (x, a, b))
    yr = xr @ w.t() + 0.5 * (xr @ ar.t()) @ br.t()
    yr.backward(grad.double())
    for ours, ref in ((y, yr), (x.grad, xr.grad), (a.grad, ar.grad), (b.grad, br.grad)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


def test_lora_linear_4bit_non_contiguous_input():
    q = quantize_4bit(torch.randn(16, 24), "nf4")
    x = torch.randn(24, 6).t()  # [6, 24], strided
    a, b = torch.randn(2, 24), torch.randn(16, 2)
    y = lora_linear_4bit(x, q.packed, q.absmax, q.code, 64, a, b, 1.0)
    w = dequantize_4bit_reference(q, torch.float32)
    torch.testing.assert_close(y, x @ w.t() + (x @ a.t()) @ b.t(), rtol=1e-5, atol=1e-5)


def test_opcheck():
    q = quantize_4bit(torch.randn(20, 96), "nf4")
    torch.library.opcheck(_dequantize_op, (q.packed, q.absmax, q.code, 64, 20, 96, torch.float32))
    x = torch.randn(5, 96, requires_grad=True)
    a, b = torch.randn(4, 96, requires_grad=True), torch.randn(20, 4, requires_grad=True)
    torch.library.opcheck(_lora_4bit_op, (x, q.packed, q.absmax, q.code, 64, a, b, 0.5))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_lora_linear_4bit_overwrite_input_gives_the_same_gradients_in_the_inputs_memory(layout):
    """``overwrite_input=True``: x's gradient lands in x's memory, bit for bit the one the plain
    backward allocates (the same products in the same order), and the adapters' gradients too."""
    torch.manual_seed(1)
    q = quantize_4bit(torch.randn(45, 70), "nf4")
    a, b = torch.randn(4, 70, requires_grad=True), torch.randn(45, 4, requires_grad=True)
    leaf = (
        torch.randn(9, 70, requires_grad=True)
        if layout == "contiguous"
        else torch.randn(70, 9).requires_grad_()
    )
    grad_y = torch.randn(9, 45)

    def fresh():  # a fresh intermediate, as the activation's output is
        return leaf * 1 if layout == "contiguous" else (leaf * 1).t()

    expected = torch.autograd.grad(
        lora_linear_4bit(fresh(), q.packed, q.absmax, q.code, 64, a, b, 0.5), (leaf, a, b), grad_y
    )
    x = fresh()
    seen = []
    x.register_hook(lambda grad: seen.append(grad.data_ptr()))
    y = lora_linear_4bit(x, q.packed, q.absmax, q.code, 64, a, b, 0.5, overwrite_input=True)
    got = torch.autograd.grad(y, (leaf, a, b), grad_y)
    for ours, ref in zip(got, expected):
        assert torch.equal(ours, ref)
    assert seen == [x.data_ptr()]


@pytest.mark.parametrize("needs", [(True, True), (False, True), (True, False)])
def test_lora_linear_4bit_inplace_backward_opcheck(needs):
    q = quantize_4bit(torch.randn(20, 96), "nf4")
    x = torch.randn(5, 96)
    a, b = torch.randn(4, 96), torch.randn(20, 4)
    xa = x @ a.t()
    args = (torch.randn(5, 20), x, xa, q.packed, q.absmax, q.code, 64, a, b, 0.5, *needs)
    torch.library.opcheck(torch.ops.sloth.lora_linear_4bit_backward_.default, args)
    x = torch.randn(5, 96, requires_grad=True)
    a, b = a.requires_grad_(), b.requires_grad_()
    torch.library.opcheck(_lora_4bit_op, (x, q.packed, q.absmax, q.code, 64, a, b, 0.5, True))


def test_matmul_4bit_matches_float64_reference_and_opcheck():
    """The fused product's op: its CPU reference, fake and autograd (``dy @ W``, the storage frozen)."""
    torch.manual_seed(0)
    q = quantize_4bit(torch.randn(45, 70), "nf4-dq")
    w = dequantize_4bit_reference(q, torch.float64)
    absmax = q.block_absmax()
    x = torch.randn(3, 7, 70, requires_grad=True)
    y = matmul_4bit(x, q.packed, absmax, q.code, 64, 45)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(y.double(), x.detach().double() @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), grad.double() @ w, rtol=1e-5, atol=1e-5)
    rows = torch.randn(5, 70, requires_grad=True)
    torch.library.opcheck(_matmul_op, (rows, q.packed, absmax, q.code, 64, 45))
    torch.library.opcheck(_matmul_t_op, (torch.randn(5, 45), q.packed, absmax, q.code, 64, 70))
    with pytest.raises(ValueError, match="does not fit"):
        matmul_4bit(x, q.packed, absmax, q.code, 64, 44)


def test_op_errors_name_the_problem():
    q = quantize_4bit(torch.randn(16, 24), "nf4")
    a, b = torch.randn(2, 24), torch.randn(16, 2)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        lora_linear_4bit(torch.randn(3, 24, dtype=torch.float64), q.packed, q.absmax, q.code, 64, a, b, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        lora_linear_4bit(torch.randn(3, 24), q.packed[:-1], q.absmax, q.code, 64, a, b, 1.0)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_4bit(q.packed.int(), q.absmax, q.code, 64, (16, 24), torch.float32)
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        dequantize_4bit(q.packed, q.absmax, q.code, 64, (16, 24), torch.float64)
    with pytest.raises(TypeError, match="float16/bfloat16/float32 weights"):
        quantize_4bit(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown 4-bit quantisation"):
        quantize_4bit(torch.randn(4, 4), "int4")


# ---------------------------------------------------------------------------------- 4-bit linear
def test_linear4bit_survives_half_precision_conversion_and_matches_bitsandbytes_module():
    torch.manual_seed(0)
    linear = nn.Linear(130, 96)
    layer = Linear4bit.from_linear(linear, "nf4-dq")
    x = torch.randn(4, 130)
    reference = x @ dequantize_4bit_reference(layer.storage(), torch.float32).t() + linear.bias
    torch.testing.assert_close(layer(x), reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer(x), layer.to_bnb_module(torch.float32)(x), rtol=0, atol=0)
    before = {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}
    layer.to(torch.bfloat16)  # what Lightning's bf16-true does to the whole model
    after = layer.state_dict()
    for key in ("weight", "absmax", "code", "nested_absmax", "nested_code", "offset"):
        assert torch.equal(after[key], before[key]), key  # the 4-bit storage keeps its bits
    assert layer.bias.dtype == torch.bfloat16 and layer(x.bfloat16()).dtype == torch.bfloat16


def test_state_dict_round_trip_and_mismatch_errors():
    layer = Linear4bit.from_linear(nn.Linear(64, 32, bias=False), "nf4")
    copy = Linear4bit.from_linear(nn.Linear(64, 32, bias=False), "nf4")
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy.weight, layer.weight)
    with pytest.raises(ValueError, match="stores it in 4 bits"):
        layer.load_state_dict(nn.Linear(64, 32, bias=False).state_dict())
    other = Linear4bit.from_linear(nn.Linear(64, 32, bias=False), "fp4")
    with pytest.raises(ValueError, match="does not match the model's 4-bit layer"):
        layer.load_state_dict(other.state_dict())


def test_quantize_model_in_place_skips_lm_head_and_adapters():
    from _models import add_lora, tiny_llama

    model = add_lora(tiny_llama())
    inner = model.base_model.model
    converted = quantize_model(model, "nf4")
    assert len(converted) == 14 and all(name.endswith("base_layer") for name in converted)
    assert isinstance(inner.model.layers[0].mlp.down_proj.base_layer, Linear4bit)
    assert type(inner.lm_head) is nn.Linear
    assert type(inner.model.layers[0].self_attn.q_proj.lora_A["default"]) is nn.Linear
    assert quantize_model(model, "nf4") == []  # already 4-bit: nothing to do, no error


def test_quantize_model_frees_each_16bit_weight_as_it_goes():
    import gc
    import weakref

    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    weights = [weakref.ref(layer.weight) for layer in model]
    alive = []
    original = Linear4bit.from_linear

    def spy(linear, *args, **kwargs):
        gc.collect()
        alive.append(sum(w() is not None for w in weights))
        return original(linear, *args, **kwargs)

    Linear4bit.from_linear = spy
    try:
        quantize_model(model, "nf4", skip=())
    finally:
        Linear4bit.from_linear = original
    assert alive == [4, 3, 2, 1]  # each replaced layer's weight is gone before the next is quantised


def test_quantize_model_errors():
    with pytest.raises(ValueError, match="no nn.Linear layer to quantise"):
        quantize_model(nn.Sequential(nn.Embedding(4, 4), nn.LayerNorm(4)))

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 6))

    with pytest.raises(NotImplementedError, match="4-bit experts are supported for"):
        quantize_model(nn.Sequential(nn.Linear(4, 4), Experts()))
    # Skipped experts stay in the compute dtype; the rest is quantised.
    assert quantize_model(nn.Sequential(nn.Linear(4, 4), Experts()), skip=["1"]) == ["0"]


def test_moe_experts_quantise_or_stay_when_skipped():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    converted = quantize_model(Qwen3MoeForCausalLM(config))
    assert "model.layers.0.mlp.experts.gate_up_proj" in converted and len(converted) == 12
    model = Qwen3MoeForCausalLM(config)
    converted = quantize_model(model, skip=["lm_head", "experts"])
    assert len(converted) == 8 and all("self_attn" in name for name in converted)
    ids = torch.randint(0, 64, (1, 9))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
