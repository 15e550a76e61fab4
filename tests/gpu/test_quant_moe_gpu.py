"""GPU check of 4-bit MoE experts: one bf16 layer of each family with NF4 experts (dequantised by the
Triton kernel into a reusable buffer before each grouped GEMM) against the same layer whose experts
hold the dequantised bf16 weights, with LoRA on the experts: output, input, routing-weight and LoRA
gradients; the 4-bit storage is unchanged by the backward.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_quant_moe_gpu.py``.
"""

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lightning_sloth.moe import install_lora_experts, register
from lightning_sloth.moe.quant import expert_storage, quantize_experts
from lightning_sloth.quant import dequantize_4bit_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _block(family, hidden, inter):
    common = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=inter))
    if family == "mixtral":
        return MixtralSparseMoeBlock(MixtralConfig(**common, num_local_experts=8, intermediate_size=inter))
    return GptOssMLP(GptOssConfig(**common, num_local_experts=8, intermediate_size=inter))


def _with_lora(block):
    config = LoraConfig(r=8, lora_alpha=16, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    block = inject_adapter_in_model(config, block)
    for name, param in block.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    install_lora_experts(block)
    block.experts.get_base_layer().config._experts_implementation = "sloth"
    return block


def _step(block, x, index, weights, grad):
    x = x.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    out = block.experts(x, index, weights)
    out.backward(grad)
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, weights.grad, grads


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("dims", [(64, 96), (72, 40)])  # aligned (torch._grouped_mm) and odd (Triton)
def test_bf16_4bit_experts_match_dequantised_bf16_experts(family, dims):
    register()
    torch.manual_seed(0)
    block = _block(family, *dims).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for name, param in block.experts.named_parameters():
            param.normal_(0.0, 0.05 if "bias" not in name else 0.01)
    block = _with_lora(block)  # PEFT reads the dense shapes: adapters first, then 4-bit storage
    reference = copy.deepcopy(block)
    experts, ref_experts = block.experts.get_base_layer(), reference.experts.get_base_layer()
    quantize_experts(experts, "nf4")
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            storage = expert_storage(experts, name)
            getattr(ref_experts, name).copy_(dequantize_4bit_reference(storage, torch.bfloat16))
    snapshot = {k: v.clone() for k, v in experts.state_dict().items()}
    tokens = 300
    x = torch.randn(tokens, dims[0], device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, 8, (tokens, 2), device="cuda")
    weights = torch.rand(tokens, 2, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, dims[0], device="cuda", dtype=torch.bfloat16)
    out, dx, dw, grads = _step(block, x, index, weights, grad)
    out_ref, dx_ref, dw_ref, grads_ref = _step(reference, x, index, weights, grad)
    assert _rel(out, out_ref) <= 2e-2
    assert _rel(dx, dx_ref) <= 2e-2
    assert _rel(dw, dw_ref) <= 2e-2
    lora = [n for n in grads_ref if "lora_" in n]
    assert len(lora) == 4
    for name in lora:
        assert _rel(grads[name], grads_ref[name]) <= 3e-2, name
    for key, value in snapshot.items():
        assert torch.equal(experts.state_dict()[key], value), key
