"""Activation offload under DDP on every visible GPU (NCCL), directly and through SlothDDPStrategy.

Needs two CUDA devices (skipped otherwise): ``pytest -m gpu tests/gpu/test_ddp_gpu.py`` on a
multi-GPU machine; the world size is the number of visible GPUs (``SLOTH_TEST_GPUS=N`` for fewer).
"""

from __future__ import annotations

import _ddp
import pytest
import torch

WORLD = _ddp.gpu_world()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(WORLD < 2, reason="needs two CUDA GPUs"),
]


def test_ddp_training_is_bitwise_identical_with_offload():
    """Three NCCL DDP steps on every GPU: the same weights on all ranks, with and without offload."""
    results = _ddp.run("cuda", WORLD)
    assert {rank for _, rank in results} == set(range(WORLD))
    _ddp.assert_offload_changes_nothing(results)


def _lightning_fit(offload: str, tmp_path) -> tuple[dict, dict]:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_sloth import CausalLMModule, LoraSettings, SlothDDPStrategy, SlothPrecision
    from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
    from lightning_sloth.plugins import OffloadStatsCallback

    seed_everything(0)
    tokenizer = build_char_tokenizer()
    data = PackedDataModule(
        tokenizer, train=SyntheticTask(256, seed=1), val=SyntheticTask(16, seed=2), max_tokens=1024
    )
    # hidden 512 in fp32: a 1024-token layer input is 2 MiB, above the offloader's 1 MiB floor.
    module = CausalLMModule(_ddp.llama(512, 3, len(tokenizer), "sdpa"), lora=LoraSettings(r=8))
    trainer = Trainer(
        accelerator="gpu",
        devices=WORLD,
        strategy=SlothDDPStrategy(start_method="spawn", offload=offload),
        plugins=[SlothPrecision("32-true")],
        callbacks=[OffloadStatsCallback()],
        max_steps=6,
        log_every_n_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / offload,
    )
    trainer.fit(module, datamodule=data)
    lora = {n: p.detach().cpu() for n, p in module.named_parameters() if "lora_" in n}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return lora, metrics


def test_sloth_ddp_strategy_trains_with_offload(tmp_path):
    """SlothDDPStrategy(offload="on") on every GPU: offloads, and ends where offload="off" ends."""
    plain, plain_metrics = _lightning_fit("off", tmp_path)
    offloaded, metrics = _lightning_fit("on", tmp_path)
    assert metrics["offload/offloaded_bytes_per_step"] > 0
    assert "offload/offloaded_bytes_per_step" not in plain_metrics
    assert plain and plain.keys() == offloaded.keys()
    assert any(v.abs().sum() > 0 for n, v in offloaded.items() if "lora_B" in n)  # B starts at 0: it trained
    for name, value in plain.items():
        # Packed (flash/varlen) attention's backward is not bitwise deterministic; the rest is.
        torch.testing.assert_close(offloaded[name], value, rtol=1e-4, atol=1e-6)
