"""4-bit MoE expert weights on CPU: parity with transformers' eager experts + PEFT over the dequantised
weights, the op (opcheck, no dequantised weight saved), training through ``Trainer`` with the storage
untouched, ``moe=False``, unsupported layouts, and the memory plan."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from peft import LoraConfig, get_peft_model
from test_moe import EXPERT_LORA, FAMILIES, VOCAB, tiny_moe
from torch import nn

from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision, SlothStrategy
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.moe import group_by_expert
from lightning_sloth.moe.quant import expert_storage, lora_grouped_mm_4bit, quantize_experts
from lightning_sloth.patching import apply_experts
from lightning_sloth.quant import dequantize_4bit_reference, quantize_model

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m for n, m in model.named_modules() if hasattr(m, "is_transposed") and hasattr(m, "num_experts")
    }


def _peft(family: str) -> nn.Module:
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_LORA, init_lora_weights=False
    )
    return get_peft_model(tiny_moe(family, experts=4), config).train()


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq", "fp4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_experts_match_eager_peft_on_the_dequantised_weights(family, quant_type):
    ours = _peft(family)
    reference = copy.deepcopy(ours)
    ref_experts = _experts_modules(reference)
    for name, experts in _experts_modules(ours).items():
        assert quantize_experts(experts, quant_type) == ["gate_up_proj", "down_proj"]
        with torch.no_grad():
            for weight in ("gate_up_proj", "down_proj"):
                storage = expert_storage(experts, weight)
                assert getattr(experts, weight).dtype == torch.uint8
                getattr(ref_experts[name], weight).copy_(dequantize_4bit_reference(storage, torch.float32))
    reference.base_model.model.set_experts_implementation("eager")
    assert len(apply_experts(ours).lora) == 2
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    loss_ref, grads_ref = _run(reference, ids)
    loss, grads = _run(ours, ids)
    assert _rel(loss, loss_ref) <= 1e-5
    assert grads.keys() == grads_ref.keys()
    assert sum("experts" in n for n in grads) == 8  # A and B of two parameters in two layers
    for name, grad in grads_ref.items():
        assert _rel(grads[name], grad) <= 1e-5, name


def _op_inputs(transposed: bool, rank: int, bias: bool):
    gen = torch.Generator().manual_seed(0)
    experts, n_in, n_out = 3, 10, 14
    shape = (experts, n_in, n_out) if transposed else (experts, n_out, n_in)
    from lightning_sloth.quant import quantize_4bit

    storage = quantize_4bit(torch.randn(shape, generator=gen))
    index = torch.randint(0, experts, (7, 2), generator=gen)
    grouping = group_by_expert(index, experts)
    x = torch.randn(14, n_in, generator=gen, requires_grad=True)
    a = (torch.randn(experts, rank, n_in, generator=gen) * 0.3).requires_grad_()
    b = (torch.randn(experts, n_out, rank, generator=gen) * 0.3).requires_grad_()
    bias_t = torch.randn(experts, n_out, generator=gen, requires_grad=True) if bias else None
    return storage, grouping, x, a, b, bias_t


@pytest.mark.parametrize(
    ("transposed", "rank", "bias"), [(False, 3, False), (True, 2, True), (False, 0, False)]
)
def test_op_matches_lora_grouped_mm_on_the_dequantised_weight(transposed, rank, bias):
    from lightning_sloth.moe import lora_grouped_mm

    storage, grouping, x, a, b, bias_t = _op_inputs(transposed, rank, bias)
    weight = dequantize_4bit_reference(storage, torch.float32)
    kwargs = dict(transposed=transposed, bias=bias_t, expert_ids=grouping.expert_ids)
    lora = (a, b) if rank else (None, None)
    y = lora_grouped_mm_4bit(x, storage, *lora, 1.5, grouping.ends, **kwargs)
    y_ref = lora_grouped_mm(x, weight, a, b, 1.5, grouping.ends, **kwargs)
    grad = torch.randn_like(y_ref)
    leaves = [t for t in (x, bias_t, *((a, b) if rank else ())) if t is not None]
    got = torch.autograd.grad(y, leaves, grad)
    want = torch.autograd.grad(y_ref, leaves, grad)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_and_nothing_dequantised_is_saved(transposed):
    from lightning_sloth.moe.quant import _backward_op, _op

    storage, grouping, x, a, b, bias_t = _op_inputs(transposed, 2, transposed)
    absmax = storage.block_absmax()
    args = (
        x, storage.packed, absmax, storage.code, 64, list(storage.shape), bias_t, a, b, 0.5,
        grouping.ends, grouping.expert_ids, transposed,
    )  # fmt: skip
    torch.library.opcheck(_op, args)
    y, xa = _op(*args)
    grad = torch.randn_like(y)
    back = (grad, x.detach(), xa, storage.packed, absmax, storage.code, 64, list(storage.shape),
            a.detach(), b.detach(), 0.5, grouping.ends, transposed, True, True, True)  # fmt: skip
    torch.library.opcheck(_backward_op, back)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_grouped_mm_4bit(x, storage, a, b, 0.5, grouping.ends, transposed=transposed, bias=bias_t,
                             expert_ids=grouping.expert_ids)  # fmt: skip
    assert saved and all(t.numel() < storage.numel for t in saved)  # no [E, ., .] float weight


def train_recording_experts(precision: SlothPrecision) -> tuple[CausalLMModule, dict, list[float]]:
    """Ten steps of a tiny Qwen3-MoE with LoRA on q/v and the experts under ``precision``:
    ``(module, each experts module's state dict when training starts, the losses)``."""
    seed_everything(0)
    tokenizer = build_char_tokenizer()
    model = tiny_moe("qwen3_moe", experts=4).train()
    model.resize_token_embeddings(len(tokenizer))
    data = PackedDataModule(tokenizer, train=SyntheticTask(4, seed=1), max_tokens=128)
    lora = LoraSettings(r=4, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_LORA)
    module = CausalLMModule(model, lora=lora, optimizer=OptimizerSettings(lr=3e-2, scheduler="constant"))
    losses, snapshot = [], {}

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            for name, experts in _experts_modules(pl_module).items():
                snapshot[name] = {k: v.clone() for k, v in experts.state_dict().items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = Trainer(
        plugins=[precision],
        strategy=SlothStrategy(kernels=True),
        max_steps=10,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    trainer.fit(module, datamodule=data)
    return module, snapshot, losses


def test_trainer_trains_4bit_experts_and_leaves_the_storage_untouched():
    module, snapshot, losses = train_recording_experts(SlothPrecision("32-true", quantize="nf4"))
    experts = _experts_modules(find_hf_model(module))
    assert len(snapshot) == 2 and len(experts) == 2
    for name, state in snapshot.items():
        module_experts = _experts_modules(module)[name]
        assert (
            module_experts.gate_up_proj.dtype == torch.uint8 and module_experts.down_proj.dtype == torch.uint8
        )
        for key, value in state.items():
            assert torch.equal(module_experts.state_dict()[key], value), (name, key)
    assert sum(losses[-3:]) < sum(losses[:3]), losses


def test_moe_false_with_4bit_experts_is_a_clear_error():
    model = tiny_moe("mixtral", experts=4)
    names = quantize_model(model, "nf4")
    assert sum(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names) == 4
    apply_experts(model, enabled=False)
    ids = torch.randint(0, VOCAB, (1, 5))
    with pytest.raises(RuntimeError, match="stores its expert weights in 4 bits"):
        model(input_ids=ids)
    apply_experts(model)
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_unsupported_experts_layout_is_a_clear_error():
    model = tiny_moe("mixtral", experts=4)
    experts = next(iter(_experts_modules(model).values()))
    experts.extra_proj = nn.Parameter(torch.randn(4, 3, 3))
    with pytest.raises(NotImplementedError, match="extra_proj.*quantize_skip"):
        quantize_model(model, "nf4")
    model = tiny_moe("mixtral", experts=4)
    names = quantize_model(model, "nf4", skip=("lm_head", "experts"))
    assert not any("experts" in n for n in names)


def test_memory_plan_counts_4bit_experts_like_dense_ones():
    """The expert storage is parameters and buffers, not activations: the measured bytes per layer
    equal those of the same model with dense experts (nothing dequantised is saved)."""
    from lightning_sloth.offload import apply_checkpointing

    measured = []
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    for quantize in (False, True):
        model = tiny_moe("qwen3_moe", experts=4).train()
        if quantize:
            quantize_model(model, "nf4", skip=("lm_head", "self_attn", "gate"))
        apply_experts(model)
        for p in model.parameters():
            p.requires_grad_(False)
        model.model.embed_tokens.weight.requires_grad_(True)
        ckpt = apply_checkpointing(model, memory_budget=1 << 30)
        model(input_ids=ids, labels=ids).loss.backward()
        measured.append((ckpt.activation_bytes, ckpt.input_bytes))
    assert measured[0] == measured[1]


def test_lora_made_on_4bit_experts_is_a_clear_error():
    model = tiny_moe("mixtral", experts=4)
    quantize_model(model, "nf4", skip=("lm_head", "self_attn"))
    model = get_peft_model(model, LoraConfig(r=4, target_parameters=EXPERT_LORA))
    apply_experts(model)
    with pytest.raises(ValueError, match="apply the adapters before quantising"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))


def test_checkpoint_with_other_4bit_experts_is_a_clear_error():
    """Only the expert weights are in 4 bits here (no Linear4bit record in the checkpoint): nf4 against
    fp4 has the same shapes and dtypes and would load silently without the check."""
    from lightning_sloth.quant.linear import check_checkpoint_quantization

    skip = ("lm_head", "self_attn", "gate")

    def model(quant_type):
        built = tiny_moe("qwen3_moe", experts=4)
        if quant_type is not None:
            assert all("experts" in n for n in quantize_model(built, quant_type, skip=skip))
        return built

    saved = model("nf4").state_dict()
    check_checkpoint_quantization(model("nf4"), saved)
    for other in ("fp4", "nf4-dq"):
        with pytest.raises(ValueError, match=rf"do not match.*'{other}'"):
            check_checkpoint_quantization(model(other), saved)
    with pytest.raises(ValueError, match="stores 4 weights in 4 bits.*but the model has none"):
        check_checkpoint_quantization(model(None), saved)
    with pytest.raises(ValueError, match="written without quantisation"):
        check_checkpoint_quantization(model("fp4"), model(None).state_dict())
    check_checkpoint_quantization(model("nf4-dq"), model("nf4-dq").state_dict())
