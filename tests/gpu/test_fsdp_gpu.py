"""SlothFSDPStrategy on every visible GPU (NCCL): bf16 parity with the Triton kernels (a meta-device
MoE in NF4 made shard by shard included), offload, the spawn launcher with adapter export, and the
app's ``trainer=fsdp``.

Needs two CUDA devices (skipped otherwise): ``pytest -m gpu tests/gpu/test_fsdp_gpu.py``; the world
size is the number of visible GPUs (``SLOTH_TEST_GPUS=N`` for fewer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _ddp
import _fsdp
import _processes
import pytest
import torch

WORLD = _ddp.gpu_world()
RANKS = range(WORLD)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(WORLD < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _fsdp.run(_fsdp.gpu_parity_and_offload, tmp_path_factory.mktemp("fsdp_gpu"), world=WORLD)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference).norm() / reference.norm().clamp(min=1e-30))


@pytest.mark.parametrize(
    "case,family,lora,quantize",
    [
        (True, "llama", True, None),
        ("default", "llama", True, None),
        (False, "llama", False, None),
        ("moe_nf4", "qwen3_moe", True, "nf4"),
        ("meta_moe_nf4", "qwen3_moe", True, "nf4"),
    ],
)
def test_bf16_with_kernels_matches_one_process_on_the_global_batch(runs, case, family, lora, quantize):
    """FSDP2 in bf16 (kernels on) vs float32 on one GPU; its error is that of one-GPU bf16, with
    float32 weights under autocast or, as FSDP2's ``param_dtype`` keeps them, with bf16 weights
    (bf16 activations between ops: MoE routing near ties can send a token to another expert).
    ``meta_moe_nf4``: built on the meta device, each rank quantising its own shards from a checkpoint
    (the reference checks its gathered codes equal quantising the whole model)."""
    records = [runs[rank][case] for rank in RANKS]
    record = records[0]
    assert "kernels" in record["report"] and any("fully_shard" in a for a in record["report"])
    assert (case == "meta_moe_nf4") == ("shards made per rank (CheckpointWeights)" in record["report"])
    # the defaults keep the LoRA base whole on every rank, the adapters in the root's unit
    assert (case == "default") == any("their adapters in the root's unit" in a for a in record["report"])
    steps = [r["steps"][0] for r in records]
    settings = dict(device="cuda", hidden=256, quantize=quantize)
    loss, grads, _ = _fsdp.reference_step(family, lora, *steps, **settings)
    bf16_loss, bf16_grads, _ = _fsdp.reference_step(family, lora, *steps, bf16_autocast=True, **settings)
    _, bf16_weight_grads, _ = _fsdp.reference_step(
        family, lora, *steps, bf16_autocast=True, bf16_weights=True, **settings
    )
    sharded_loss = _fsdp.global_loss(*records, step=0)
    assert sharded_loss == pytest.approx(float(loss), rel=1e-2)
    worst = {}
    for name, grad in grads.items():
        error = _relative_error(steps[0]["grads"][name], grad)
        one_gpu = _relative_error(bf16_grads[name], grad)
        one_gpu_bf16_weights = _relative_error(bf16_weight_grads[name], grad)
        worst[name] = (error, one_gpu, one_gpu_bf16_weights)
        assert error <= max(2 * one_gpu, 2 * one_gpu_bf16_weights, 1e-2), (name, worst[name])
    name = max(worst, key=lambda n: worst[n][0])
    print(
        f"{case} {family} lora={lora} quantize={quantize} world={WORLD}: loss fsdp {sharded_loss:.6f} / fp32 {float(loss):.6f} / bf16 1-GPU "
        f"{float(bf16_loss):.6f}; worst gradient {name}: relative error {worst[name][0]:.2e} "
        f"(one-GPU bf16: {worst[name][1]:.2e}, with bf16 weights {worst[name][2]:.2e})"
    )


def test_an_elementwise_optimizer_steps_the_local_shards_as_the_dtensors_on_cuda(tmp_path):
    """``SlothPrecision``'s optimizer step on FSDP2's local shards, on the GPUs over NCCL: AdamW
    (foreach and fused, the Trainer's), Adam with amsgrad and SGD with momentum give the ``DTensor``
    step's parameters and states bit for bit over three steps (uneven and empty shards, a parameter
    without a gradient in one step)."""
    runs = _fsdp.run(_fsdp.local_shard_steps_cuda, tmp_path, world=WORLD)
    for rank in RANKS:
        result = runs[rank]
        for name in ("adamw_foreach", "adamw_fused", "adam_amsgrad", "sgd_momentum"):
            assert result[name]["params"] == 0.0 and result[name]["states"] == 0.0, (rank, name, result[name])
            assert all(ours == theirs for _, ours, theirs in result[name]["kinds"]), result[name]["kinds"]
        assert result["applies"] == {"adamw": True, "adagrad": False, "plain": False}


def test_triton_ops_see_local_tensors(runs):
    ops = runs[0]["ops"]
    assert ops["rms_norm"] > 0 and ops["linear_cross_entropy"] > 0 and ops["fused_lora_forward"] > 0
    assert ops["dtensor_args"] == 0


def test_offload_under_fsdp_offloads_and_changes_nothing(runs):
    for rank in RANKS:
        stats = runs[rank]["on"]["stats"]
        assert stats["offloaded_bytes_per_step"] > 0, (rank, stats)
        assert stats["fetched_on_demand"] + stats["prefetched"] > 0
        assert runs[rank]["off"]["stats"] == {}
        # Packed (varlen) attention's backward is not bitwise deterministic; the rest is.
        torch.testing.assert_close(runs[rank]["on"]["losses"], runs[rank]["off"]["losses"], rtol=1e-5, atol=0)
    plain, offloaded = runs[0]["off"]["grads"], runs[0]["on"]["grads"]
    assert plain.keys() == offloaded.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(offloaded[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_spawn_launcher_returns_gathered_weights_and_exports_the_adapter(tmp_path):
    from lightning.pytorch import Trainer, seed_everything
    from peft import PeftModel
    from safetensors.torch import load_file

    from lightning_sloth import (
        CausalLMModule,
        LoraSettings,
        OptimizerSettings,
        SaveAdapter,
        SlothFSDPStrategy,
        SlothPrecision,
    )

    seed_everything(0)
    data = _fsdp.datamodule(96, max_tokens=512)
    module = CausalLMModule(
        _fsdp.tiny_model("llama", len(data.tokenizer), hidden=256),
        lora=LoraSettings(r=4),
        optimizer=OptimizerSettings(lr=1e-2),
    )
    trainer = Trainer(
        accelerator="gpu",
        devices=WORLD,
        strategy=SlothFSDPStrategy(start_method="spawn", kernels=True),
        plugins=[SlothPrecision("bf16-mixed")],
        callbacks=[SaveAdapter(tmp_path / "adapter")],
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    trained = {n: p.detach().cpu() for n, p in module.named_parameters() if "lora_B" in n}
    assert trained and all(v.abs().sum() > 0 for v in trained.values())  # B starts at 0: it trained
    assert sum("lora_B" in k for k in saved) == len(trained)
    for key, value in saved.items():
        if "lora_B" in key:
            name = "model." + key.replace(".weight", ".default.weight")
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
    base = _fsdp.tiny_model("llama", len(data.tokenizer), hidden=256)
    assert isinstance(PeftModel.from_pretrained(base, tmp_path / "adapter"), PeftModel)


QUICK = [
    "trainer=fsdp",
    f"trainer.devices={WORLD}",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "data.num_train=256",
    "data.num_val=16",
]


def _app(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    overrides = {a.split("=")[0]: a for a in QUICK}
    overrides |= {a.split("=")[0]: a for a in args if "=" in a and not a.startswith("-")}
    flags = [a for a in args if "=" not in a or a.startswith("-")]
    result = _processes.run(  # a stuck rank is killed with its process group, the output kept
        [str(Path(sys.executable).parent / "lightning-sloth"), *flags, *overrides.values()],
        cwd=cwd,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_app_trainer_fsdp_trains_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "run"
    _app(tmp_path, f"hydra.run.dir={out}")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["val"]["loss"] > 0
    assert (out / "checkpoints" / "last.ckpt").is_dir()  # sharded: one file per rank + metadata
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    _app(tmp_path, "trainer.max_steps=9", f"hydra.run.dir={out}")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(out / "checkpoints" / "last.ckpt") and metrics["steps"] == 9


def test_app_multirun_with_fsdp_runs_each_job_once(tmp_path):
    sweep = tmp_path / "sweep"
    result = _app(tmp_path, "-m", "optimizer.lr=1e-3,3e-3", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}")
    for job in ("0", "1"):
        assert json.loads((sweep / job / "metrics.json").read_text())["steps"] == 3
    assert not (sweep / "2").exists()
    assert (
        result.stdout.count("Launching 2 jobs locally") + result.stderr.count("Launching 2 jobs locally") == 1
    )
