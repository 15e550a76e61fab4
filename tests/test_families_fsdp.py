"""FSDP2 (``SlothFSDPStrategy(kernels=True)``) on two CPU processes for a hybrid linear-attention family
(Qwen3.5, LoRA on the linear-attention, attention and MLP projections): the sharded step's loss and
gathered gradients equal one process on the same global batch (both ranks' packed rows)."""

from __future__ import annotations

from pathlib import Path

import _fsdp
import pytest
import torch
from _families import tiny
from lightning.pytorch import Trainer, seed_everything

from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothFSDPStrategy, SlothPrecision
from lightning_sloth.data import build_char_tokenizer
from lightning_sloth.transform import transform_model

FAMILIES = {
    "qwen3_5_text": ("in_proj_qkv", "out_proj", "q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"),
}


def _module(family: str) -> CausalLMModule:
    model = tiny(family, vocab_size=len(build_char_tokenizer()), initializer_range=0.05)
    lora = LoraSettings(r=4, target_modules=FAMILIES[family])
    return CausalLMModule(model, lora=lora, optimizer=OptimizerSettings(lr=1e-2, scheduler="constant"))


def sharded_steps(tmp: Path) -> dict:
    """Each rank: one optimizer step per family (one packed row per rank), recorded."""
    out = {}
    for family in FAMILIES:
        seed_everything(0, verbose=False)
        recorder = _fsdp.Recorder()
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=SlothFSDPStrategy(kernels=True),
            plugins=[SlothPrecision("32-true")],
            callbacks=[recorder],
            max_steps=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp),
        )
        trainer.fit(_module(family), datamodule=_fsdp.datamodule(16, max_tokens=192))
        report = trainer.strategy.sloth_report
        out[family] = {
            "steps": recorder.steps,
            "losses": recorder.losses,
            "applied": list(report.applied),
            "kernels": report.kernels.counts,
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _fsdp.run(sharded_steps, tmp_path_factory.mktemp("families_fsdp"))


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_step_equals_one_process(runs, family):
    record, other = runs[0][family], runs[1][family]
    assert any("fully_shard" in step for step in record["applied"])
    assert record["kernels"]["rms_norm"] > 0 and record["kernels"]["lora"] > 0
    if family == "qwen3_5_text":
        assert record["kernels"]["linear_attention"] == 1
    step0, step1 = record["steps"][0], other["steps"][0]
    module = _module(family)
    module.load_state_dict(step0["params"], strict=True)
    transform_model(module, kernels=True, gradient_checkpointing=False)
    module.train()
    total, count = 0.0, 0
    batches = step0["batches"] + step1["batches"]
    for batch in batches:
        out = module.model(**batch.model_inputs(), labels=batch.labels)
        total = total + out.loss * batch.num_target_tokens
        count += batch.num_target_tokens
    loss = total / count
    loss.backward()
    recorded = sum(
        value * b.num_target_tokens for value, b in zip(record["losses"] + other["losses"], batches)
    )
    torch.testing.assert_close(recorded / count, float(loss), rtol=1e-5, atol=0)
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert grads.keys() == step0["grads"].keys() and all("lora_" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(step0["grads"][name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()))
