"""CausalLMModule helpers: target shift, per-document exact match, settings validation."""

import pytest
import torch

from lightning_sloth.module import (
    CausalLMModule,
    LoraSettings,
    OptimizerSettings,
    document_exact_match,
    shifted_targets,
)


def test_shifted_targets_aligns_with_logits():
    labels = torch.tensor([[-100, 5, 6, -100, 7]])
    assert shifted_targets(labels).tolist() == [[5, 6, -100, 7, -100]]


def test_document_exact_match_per_document():
    # three documents: [0,3) [3,6) [6,8) (the last one has no targets: padding)
    cu = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    targets = torch.tensor([1, 2, -100, 3, 4, -100, -100, -100])
    preds = torch.tensor([1, 2, 9, 3, 0, 9, 9, 9])
    assert document_exact_match(preds, targets, cu).tolist() == [1.0, 0.0]


def test_document_exact_match_under_a_half_precision_default_dtype():
    # bf16-true validation runs under torch.set_default_dtype(torch.bfloat16)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    targets = torch.tensor([1, 2, -100, 3, 4, -100])
    preds = torch.tensor([1, 2, 9, 3, 0, 9])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        exact = document_exact_match(preds, targets, cu)
    finally:
        torch.set_default_dtype(previous)
    assert exact.dtype == torch.float32 and exact.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, "rank r must be positive"),
        ({"dropout": 1.5}, "dropout"),
        ({"target_modules": ()}, "target"),
    ],
)
def test_lora_settings_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSettings(**kwargs)


def test_optimizer_schedule_warmup_then_cosine():
    opt = OptimizerSettings(lr=1.0, warmup_steps=4, scheduler="cosine", min_lr_ratio=0.1)
    factors = [opt.lr_factor(s, 20) for s in range(21)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    with pytest.raises(ValueError, match="scheduler"):
        OptimizerSettings(scheduler="linear")


def test_module_rejects_non_model():
    with pytest.raises(TypeError, match="nn.Module or a callable"):
        CausalLMModule(model=42)
