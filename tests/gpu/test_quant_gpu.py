"""4-bit QLoRA on the GPU: the Triton dequantisation kernel, the 4-bit LoRA op, one training step
against transformers + PEFT + bitsandbytes on the same quantised weights."""

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from lightning_sloth.ops.nf4 import _dequantize_op, _lora_4bit_op, dequantize_4bit, lora_linear_4bit  # noqa: E402
from lightning_sloth.quant import Linear4bit, dequantize_4bit_reference, from_bnb, quantize_4bit, to_bnb  # noqa: E402

SHAPES = [(96, 130), (333, 77), (4096, 1024)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference_and_bitsandbytes_bitwise(shape, dtype, quant_type):
    torch.manual_seed(0)
    w = torch.randn(shape, device="cuda", dtype=dtype)
    ours = quantize_4bit(w, quant_type)
    got = dequantize_4bit(ours.packed, ours.block_absmax(), ours.code, ours.blocksize, shape, dtype)
    assert torch.equal(_bits(got), _bits(dequantize_4bit_reference(ours, dtype)))
    packed, state = to_bnb(ours)  # ours through bitsandbytes' CUDA kernel
    theirs_of_ours = bnb_functional.dequantize_4bit(packed, state)
    p, st = bnb_functional.quantize_4bit(
        w, blocksize=64, quant_type=quant_type[:3], compress_statistics=quant_type.endswith("dq")
    )
    adopted = from_bnb(p, st)  # bitsandbytes' weight through our kernel
    mine_of_theirs = dequantize_4bit(adopted.packed, adopted.block_absmax(), adopted.code, 64, shape, dtype)
    if quant_type == "fp4":  # bitsandbytes' kernels decode code 8 as -0.0, its Python code book as +0.0
        assert torch.equal(theirs_of_ours, got) and torch.equal(
            mine_of_theirs, bnb_functional.dequantize_4bit(p, st)
        )
    else:
        assert torch.equal(_bits(theirs_of_ours), _bits(got))
        assert torch.equal(_bits(mine_of_theirs), _bits(bnb_functional.dequantize_4bit(p, st)))


@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq"])
def test_lora_4bit_op_matches_reference_bf16(quant_type):
    torch.manual_seed(0)
    out_f, in_f, r, n = 333, 260, 16, 77
    q = quantize_4bit(torch.randn(out_f, in_f, device="cuda") * 0.05, quant_type)
    w = dequantize_4bit_reference(q, torch.float32)
    x = torch.randn(3, n, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = (torch.randn(r, in_f, device="cuda") * 0.1).bfloat16().requires_grad_()
    b = (torch.randn(out_f, r, device="cuda") * 0.1).bfloat16().requires_grad_()
    y = lora_linear_4bit(x, q.packed, q.block_absmax(), q.code, 64, a, b, 2.0)
    grad = torch.randn_like(y)
    y.backward(grad)
    xr, ar, br = (t.detach().double().requires_grad_() for t in (x, a, b))
    yr = xr @ w.double().t() + 2.0 * (xr @ ar.t()) @ br.t()
    yr.backward(grad.double())
    for ours, ref in ((y, yr), (x.grad, xr.grad), (a.grad, ar.grad), (b.grad, br.grad)):
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_opcheck_on_cuda():
    q = quantize_4bit(torch.randn(64, 96, device="cuda"), "nf4")
    absmax = q.block_absmax()
    torch.library.opcheck(_dequantize_op, (q.packed, absmax, q.code, 64, 64, 96, torch.bfloat16))
    x = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(4, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(_lora_4bit_op, (x, q.packed, absmax, q.code, 64, a, b, 0.5))


def _tiny_quantized(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_sloth.quant import quantize_model

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    quantize_model(model, "nf4")
    return model


def _lora(model):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(torch.bfloat16)
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_one_step_matches_transformers_peft_bitsandbytes():
    from lightning_sloth.transform import transform_model

    ours = _tiny_quantized()
    theirs = copy.deepcopy(ours)
    for name, module in list(theirs.named_modules()):
        if isinstance(module, Linear4bit):
            parent, _, child = name.rpartition(".")
            setattr(theirs.get_submodule(parent), child, module.to_bnb_module(torch.bfloat16))
    ours, theirs = _lora(ours), _lora(theirs)
    adapters = {n: p for n, p in ours.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(adapters[name])
    transform_model(ours, kernels=True, packed_attention=False)
    ids = torch.randint(0, 512, (2, 96), device="cuda")
    losses, grads = [], []
    for model in (ours, theirs):
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.float())
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-2)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for name, g in grads[0].items():
        ref = grads[1][name]
        assert g.abs().sum() > 0
        assert (g - ref).norm() <= 5e-2 * ref.norm(), name


# ----------------------------------------------------------------- fused decode-in-GEMM products
GEMM_SHAPES = [(1, 4096, 4096), (16, 1024, 4096), (77, 333, 260), (300, 14336, 4096), (2048, 256, 1030)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_fused_gemm_matches_reference(shape, dtype):
    """x @ W^T and dy @ W with W decoded in the load, against float64 products of the same decoded
    weight (the rounding of W to the compute dtype is the dequantisation kernel's, bit for bit)."""
    from lightning_sloth.kernels.nf4_gemm import matmul_4bit, matmul_4bit_t

    m, n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = quantize_4bit(torch.randn(n, k, device="cuda", generator=gen) * 0.05, "nf4-dq")
    absmax = q.block_absmax()
    w = dequantize_4bit(q.packed, absmax, q.code, 64, (n, k), dtype).double()
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    dy = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for got, ref in (
        (matmul_4bit(x, q.packed, absmax, q.code, 64, n), x.double() @ w.t()),
        (matmul_4bit_t(dy, q.packed, absmax, q.code, 64, k), dy.double() @ w),
    ):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_fused_ops_opcheck_and_compile():
    from lightning_sloth.ops.nf4 import _matmul_op, _matmul_t_op, matmul_4bit

    q = quantize_4bit(torch.randn(64, 96, device="cuda"), "nf4")
    x = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(_matmul_op, (x, q.packed, q.absmax, q.code, 64, 64))
    torch.library.opcheck(
        _matmul_t_op, (torch.randn(5, 64, device="cuda").bfloat16(), q.packed, q.absmax, q.code, 64, 96)
    )
    eager = matmul_4bit(x, q.packed, q.absmax, q.code, 64, 64)
    compiled = torch.compile(matmul_4bit, fullgraph=True)(x, q.packed, q.absmax, q.code, 64, 64)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("rows", [1, 7, "max+1", 4096])
def test_lora_op_takes_the_fused_path_only_up_to_the_threshold(rows, monkeypatch):
    """Forward and backward pick the fused kernels for at most FUSED_MAX_ROWS rows and the buffer +
    cuBLAS path above; both give the reference result."""
    from lightning_sloth.kernels import nf4_gemm

    from lightning_sloth.ops import nf4 as nf4_ops

    limit = nf4_ops.FUSED_MAX_ROWS
    rows = {"max+1": limit + 1}.get(rows, rows)
    calls = []
    for name in ("matmul_4bit", "matmul_4bit_t"):
        real = getattr(nf4_gemm, name)
        monkeypatch.setattr(
            nf4_gemm, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    torch.manual_seed(0)
    out_f, in_f, r = 520, 384, 8
    q = quantize_4bit(torch.randn(out_f, in_f, device="cuda") * 0.05, "nf4")
    w = dequantize_4bit_reference(q, torch.bfloat16).double()
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = (torch.randn(r, in_f, device="cuda") * 0.1).bfloat16().requires_grad_()
    b = (torch.randn(out_f, r, device="cuda") * 0.1).bfloat16().requires_grad_()
    y = lora_linear_4bit(x, q.packed, q.absmax, q.code, 64, a, b, 2.0)
    grad = torch.randn_like(y)
    y.backward(grad)
    fused = rows <= limit  # FUSED_MAX_ROWS is 0 as measured: the buffer path for every row count
    assert calls == (["matmul_4bit", "matmul_4bit_t"] if fused else [])
    xr, ar, br = (t.detach().double().requires_grad_() for t in (x, a, b))
    yr = xr @ w.t() + 2.0 * (xr @ ar.t()) @ br.t()
    yr.backward(grad.double())
    for ours, ref in ((y, yr), (x.grad, xr.grad), (a.grad, ar.grad), (b.grad, br.grad)):
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
