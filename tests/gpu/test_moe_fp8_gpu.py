"""GPU checks of FP8 expert weights (``lightning_sloth.moe.fp8``): the grouped FP8 GEMMs
(``torch._scaled_grouped_mm``) against the op's own emulation on the same device, forward and every
gradient, with idle experts and a bias; each input-gradient format; the Qwen3-MoE and GPT-OSS blocks
with expert LoRA against their bf16 experts; ``fp8_base_model`` on a MoE model in a training step; and
no host sync in a training step.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_moe_fp8_gpu.py`` (under a minute; Hopper).
"""

import pytest
import torch
from _moe_blocks import assert_no_host_sync_in_a_training_step, block_step, lora_block
from transformers import Qwen3MoeConfig

from lightning_sloth.moe import group_by_expert
from lightning_sloth.moe.fp8 import FP8Experts, has_fp8_experts, lora_grouped_mm_fp8, quantize_experts_fp8
from lightning_sloth.moe.fused import fused_permutation_setting, set_fused_permutation
from lightning_sloth.ops.fp8_formats import quantize_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a CUDA GPU of compute capability 9.0+ (torch._scaled_grouped_mm)",
    ),
]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _case(grad_format, tokens=1500, experts=16, n_in=256, n_out=384, top_k=4, rank=16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(experts, n_out, n_in, device="cuda", generator=gen) * 0.05
    codes, scale = quantize_rows(weight.reshape(-1, n_in), "e4m3")
    codes = codes.view(torch.uint8).view(experts, n_out, n_in)
    storage = FP8Experts(codes, codes.transpose(-2, -1).contiguous(), scale.view(experts, n_out), grad_format)
    index = torch.randint(0, experts - 2, (tokens, top_k), device="cuda", generator=gen)  # two idle experts
    grouping = group_by_expert(index, experts)
    rows = tokens * top_k
    x = torch.randn(rows, n_in, device="cuda", generator=gen)
    a = torch.randn(experts, rank, n_in, device="cuda", generator=gen) * 0.05
    b = torch.randn(experts, n_out, rank, device="cuda", generator=gen) * 0.05
    bias = torch.randn(experts, n_out, device="cuda", generator=gen)
    grad = torch.randn(rows, n_out, device="cuda", generator=gen)
    # bf16 values, so the float32 emulation quantises the very numbers the bf16 path does
    x, a, b, bias, grad = (t.bfloat16().float() for t in (x, a, b, bias, grad))
    return storage, grouping, x, a, b, bias, grad


def _run(storage, grouping, x, a, b, bias, grad, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, a, b, bias)]
    y = lora_grouped_mm_fp8(
        leaves[0],
        storage,
        leaves[1],
        leaves[2],
        2.0,
        grouping.ends,
        bias=leaves[3],
        expert_ids=grouping.expert_ids,
    )
    y.backward(grad.to(dtype))
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
def test_fp8_grouped_gemms_match_the_emulation(grad_format):
    """bf16 on the FP8 tensor cores against the same op in float32 on the same bf16 values (the
    plain-torch emulation on the GPU): the output, the input's gradient, dA, dB and the bias
    gradient. They differ by bf16 rounding and the accumulation (fast accumulation by default),
    well under e4m3's own 4%."""
    case = _case(grad_format)
    got = _run(*case, torch.bfloat16)
    want = _run(*case, torch.float32)
    for name, g, w in zip(("y", "dx", "dA", "dB", "dbias"), got, want, strict=True):
        assert torch.isfinite(g).all(), name
        assert _rel(g, w) < 1.5e-2, (name, _rel(g, w))
    again = _run(*case, torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(again, got, strict=True))  # deterministic


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_block_with_fp8_experts_follows_its_bf16_experts(family):
    """The block with its experts in FP8 against the same block in bf16: the output and every
    gradient within FP8's rounding, with the fused switch on (FP8 experts take the separate passes)."""
    block = lora_block(family)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 1000, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(1, 1000, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    saved = fused_permutation_setting()
    try:
        set_fused_permutation(True)
        reference, names = block_step(block, x, grad)
        assert quantize_experts_fp8(block.experts.get_base_layer()) == ["gate_up_proj", "down_proj"]
        ours, names_fp8 = block_step(block, x, grad)
    finally:
        set_fused_permutation(saved)
    assert names_fp8 == names and sum("lora" in n for n in names) == 4
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        assert 1e-3 < _rel(got, want) < 0.1, ([None, "x", *names][i], _rel(got, want))


def test_no_host_sync_in_a_training_step():
    block = lora_block("qwen3_moe")
    quantize_experts_fp8(block.experts.get_base_layer())
    x = torch.randn(1, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_no_host_sync_in_a_training_step(block, x)


def test_precision_fp8_on_a_moe_model_puts_the_experts_in_fp8_and_trains():
    """``SlothPrecision("bf16-true", base_dtype="fp8", fp8_experts=True)`` through ``Trainer`` on a small Qwen3-MoE whose
    expert products all run on the FP8 tensor cores: the experts' weights are e4m3 codes that do not
    move, the expert LoRA factors train, the loss falls."""
    from lightning.pytorch import Callback, Trainer, seed_everything
    from transformers import Qwen3MoeForCausalLM

    from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision, SlothStrategy
    from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer

    seed_everything(0)
    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=64, norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).train()
    data = PackedDataModule(tokenizer, train=SyntheticTask(4, seed=1), max_tokens=256)
    lora = LoraSettings(
        r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"]
    )
    module = CausalLMModule(model, lora=lora, optimizer=OptimizerSettings(lr=3e-2, scheduler="constant"))
    losses, snapshot = [], {}

    def experts_of(root):
        return {
            n: m for n, m in root.named_modules() if hasattr(m, "num_experts") and hasattr(m, "gate_up_proj")
        }

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            for name, experts in experts_of(pl_module).items():
                snapshot[name] = {k: v.clone() for k, v in experts.state_dict().items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = Trainer(
        accelerator="gpu", devices=1, max_steps=10, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=SlothStrategy(kernels=True),
        plugins=[SlothPrecision("bf16-true", base_dtype="fp8", fp8_experts=True)],
        callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    experts = experts_of(module)
    assert len(snapshot) == 2 and all(has_fp8_experts(m) for m in experts.values())
    for name, state in snapshot.items():
        assert experts[name].gate_up_proj.dtype == torch.uint8
        for key, value in state.items():
            assert torch.equal(experts[name].state_dict()[key].cpu(), value.cpu()), (name, key)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
