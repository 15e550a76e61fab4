"""GPU test helpers for one MoE block with LoRA on its experts (the "sloth" experts selected).

Imported as ``from _moe_blocks import ...`` (``tests/`` is on ``sys.path``, see ``_models``).
"""

from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lightning_sloth.moe import install_lora_experts, register


def lora_block(family: str, hidden: int = 256, inter: int = 192, experts: int = 16, top_k: int = 4):
    """A bf16 CUDA Qwen3-MoE or GPT-OSS block, weights N(0, 0.05) and frozen, PEFT LoRA r=16 on both
    expert weights (B given values too), run by the "sloth" experts."""
    common = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=top_k)
    torch.manual_seed(0)
    if family == "qwen3_moe":
        block = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=inter, norm_topk_prob=True)
        )
    else:
        block = GptOssMLP(GptOssConfig(**common, num_local_experts=experts, intermediate_size=inter))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    for p in block.parameters():
        p.requires_grad_(False)
    config = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    block = inject_adapter_in_model(config, block)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    register()
    block = block.to("cuda", torch.bfloat16)
    block.experts.get_base_layer().config._experts_implementation = "sloth"
    install_lora_experts(block)
    return block


def block_step(block, x, grad):
    """``([output, dx, *parameter gradients], parameter names)`` of one forward + backward."""
    x = x.detach().clone().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    for p in block.parameters():
        p.grad = None
    return [out.detach(), x.grad, *grads.values()], list(grads)


def assert_no_host_sync_in_a_training_step(block, x) -> None:
    """Two warm-up steps (kernel compilation, allocator), then a forward, backward and capturable
    AdamW step of ``block`` on ``x`` under ``torch.cuda.set_sync_debug_mode("error")``."""
    params = [p for p in block.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, capturable=True, foreach=True)
    for _ in range(2):
        block(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
