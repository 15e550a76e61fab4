"""GPU checks of lightning_sloth.moe: bf16 parity with transformers' experts, the grouped GEMM paths
(``torch._grouped_mm`` and Triton) against a float64 reference with uneven and empty groups, opcheck
through the ``triton_op`` path, and no host sync in a training step of a MoE layer with LoRA.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_moe_gpu.py``.
"""

import pytest
import torch
from _moe_blocks import assert_no_host_sync_in_a_training_step
from peft import LoraConfig, inject_adapter_in_model
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lightning_sloth.moe import gemm as moe_gemm
from lightning_sloth.moe import grouped_mm, install_lora_experts, register
from lightning_sloth.moe import ops as moe_ops
from lightning_sloth.moe.gemm import grouped_mm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

COUNTS = [0, 37, 300, 0, 1, 129, 64, 0]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def _ends(counts):
    return torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dims", [(64, 96), (45, 70)])  # aligned (torch._grouped_mm in bf16) and odd (Triton)
def test_grouped_mm_matches_float64_with_uneven_and_empty_groups(dtype, transposed, dims):
    k, n = dims
    ends = _ends(COUNTS)
    rows, experts = int(ends[-1]), len(COUNTS)
    x = torch.randn(rows, k, device="cuda").to(dtype).requires_grad_()
    shape = (experts, k, n) if transposed else (experts, n, k)
    w = (torch.randn(shape, device="cuda") / k**0.5).to(dtype).requires_grad_()
    out = grouped_mm(x, w, ends, transposed=transposed)
    expected = grouped_mm_reference(x.double(), w.double(), ends, transposed)
    assert _rel(out, expected) < TOLERANCE[dtype]
    grad = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ex, ew = torch.autograd.grad(grouped_mm_reference(x64, w64, ends, transposed), (x64, w64), grad.double())
    assert _rel(dx, ex) < TOLERANCE[dtype] and _rel(dw, ew) < TOLERANCE[dtype]
    empty = torch.tensor(COUNTS, device="cuda") == 0
    assert dw[empty].abs().max() == 0


def test_opcheck_triton_op_path():
    ends = _ends([0, 20, 3, 17])
    x = torch.randn(40, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 64, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.repeat_interleave(torch.arange(4, device="cuda"), torch.tensor([0, 20, 3, 17], device="cuda"))
    torch.library.opcheck(moe_gemm._grouped_mm_op, (x, w, None, ends, ids, False))
    h = torch.randn(40, 32, device="cuda", dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(moe_ops._clamped_swiglu_op, (h, 1.702, 7.0))


def _blocks(hidden, inter):
    common = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    return {
        "qwen3_moe": Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=inter)
        ),
        "mixtral": MixtralSparseMoeBlock(
            MixtralConfig(**common, num_local_experts=8, intermediate_size=inter)
        ),
        "gpt_oss": GptOssMLP(GptOssConfig(**common, num_local_experts=8, intermediate_size=inter)),
    }


def _run_experts(experts, impl, x, index, weights, grad):
    experts.config._experts_implementation = impl
    x = x.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    out = experts(x, index, weights)
    out.backward(grad.to(out.dtype))
    grads = {n: p.grad.detach().clone() for n, p in experts.named_parameters()}
    for p in experts.parameters():
        p.grad = None
    return out.detach(), x.grad, weights.grad, grads


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("dims", [(64, 48), (40, 20)])
def test_bf16_experts_parity_with_transformers_eager(family, dims):
    """Same routing (so bf16 cannot flip a near-tied expert choice): outputs and gradients of the
    input, the routing weights and every expert parameter against float64 eager."""
    register()
    torch.manual_seed(0)
    block = _blocks(*dims)[family]
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    block = block.cuda().double()
    tokens = 301
    x = torch.randn(tokens, dims[0], device="cuda", dtype=torch.float64)
    router = getattr(block, "gate", None) or block.router
    with torch.no_grad():
        _, weights, index = router(x)
    grad = torch.randn(tokens, dims[0], device="cuda", dtype=torch.float64)
    reference = _run_experts(block.experts, "eager", x, index, weights, grad)
    experts = block.experts.to(torch.bfloat16)
    ours = _run_experts(experts, "sloth", x.bfloat16(), index, weights.bfloat16(), grad)
    for got, want in zip(ours[:3], reference[:3], strict=True):
        assert _rel(got, want) < 2e-2
    for name, g in reference[3].items():
        assert _rel(ours[3][name], g) < 2e-2, name


def test_no_host_sync_in_a_training_step_with_lora_on_experts():
    register()
    torch.manual_seed(0)
    block = _blocks(64, 48)["qwen3_moe"]
    for p in block.parameters():
        p.requires_grad_(False)
    block = inject_adapter_in_model(
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=[],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        ),
        block,
    )
    block = block.to("cuda", torch.bfloat16)
    block.experts.get_base_layer().config._experts_implementation = "sloth"
    assert install_lora_experts(block) == ["experts"]
    x = torch.randn(1, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_no_host_sync_in_a_training_step(block, x)
