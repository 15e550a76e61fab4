"""The add_rms_norm decoder-layer patch: parity with transformers under checkpointing, autocast and hooks."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from test_patching import assert_same_training_step, batch, lora, tiny_model

from lightning_sloth.offload import apply_checkpointing
from lightning_sloth.patching import KernelSettings, apply_kernels
from lightning_sloth.patching import _forwards as forwards

torch.set_num_threads(1)


def _layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


@pytest.mark.parametrize("checkpointing", ["none", "transformers", "sloth"])
def test_lora_step_matches_unpatched_and_checkpoints(checkpointing):
    model = lora(tiny_model("qwen3"))
    reference = copy.deepcopy(model)
    for m in (model, reference):
        if checkpointing == "transformers":
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif checkpointing == "sloth":
            apply_checkpointing(m)
    report = apply_kernels(model, KernelSettings(add_rms_norm=True))
    assert report.counts["add_rms_norm"] == 2
    assert all(forwards.patched_op(layer) == "add_rms_norm" for layer in _layers(model))
    with mock.patch.object(forwards, "add_rms_norm", wraps=forwards.add_rms_norm) as fused:
        assert_same_training_step(model, reference)
    # Once per layer in the forward, once more in each layer's recompute when checkpointed.
    assert fused.call_count == (2 if checkpointing == "none" else 4)


def test_autocast_with_float32_residuals_runs_the_unfused_steps():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_kernels(model, KernelSettings(lora=False, add_rms_norm=True))
    wrapped = mock.patch.object(forwards, "add_rms_norm", wraps=forwards.add_rms_norm)
    with wrapped as fused, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch()).loss
        ref = reference(**batch()).loss
    assert fused.call_count == 0  # o_proj gives bf16, the residual stream is float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)


def test_hooked_norm_and_switch_off():
    model = tiny_model("mistral")
    reference = copy.deepcopy(model)
    apply_kernels(model, KernelSettings(add_rms_norm=True))
    seen = []
    norm = _layers(model)[0].post_attention_layernorm
    handle = norm.register_forward_hook(lambda module, args, out: seen.append(module))
    assert_same_training_step(model, reference)
    handle.remove()
    assert seen == [norm]

    report = apply_kernels(model, KernelSettings(add_rms_norm=False))
    assert report.counts["add_rms_norm"] == 0 and report.skipped["add_rms_norm"] == "switched off"
    assert all(forwards.patched_op(layer) is None for layer in _layers(model))


def test_on_by_default_and_can_be_switched_off():
    report = apply_kernels(tiny_model("llama"))
    assert report.counts["add_rms_norm"] == len(_layers(tiny_model("llama")))
    report = apply_kernels(tiny_model("llama"), KernelSettings(add_rms_norm=False))
    assert report.counts["add_rms_norm"] == 0 and report.skipped["add_rms_norm"] == "switched off"


def test_families_without_the_pre_norm_layer_are_not_patched():
    report = apply_kernels(tiny_model("gemma2"), KernelSettings(add_rms_norm=True))
    assert report.counts["add_rms_norm"] == 0
