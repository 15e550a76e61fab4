"""The Hydra app on CUDA: the default run (bf16 autocast, fused AdamW, gradient clipping) on one
GPU, and DDP with activation offload on two.

Each run is the console entry point in a subprocess, as a user starts it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path

import _processes
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUICK = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "data.num_train=256",
    "data.num_val=16",
]


def _app(out: Path, *overrides: str) -> dict:
    result = _processes.run(  # a stuck rank is killed with its process group, the output kept
        [sys.executable, "-m", "lightning_sloth.train", *QUICK, *overrides, f"hydra.run.dir={out}"],
        cwd=out.parent,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6
    assert math.isfinite(metrics["train_loss_last"]) and math.isfinite(metrics["val"]["loss"])
    return metrics


def _logged(out: Path, key: str) -> list[float]:
    with open(out / "csv" / "version_0" / "metrics.csv") as fh:
        return [float(row[key]) for row in csv.DictReader(fh) if row.get(key)]


def test_default_run_on_one_gpu(tmp_path):
    """precision=auto is bf16 autocast here; AdamW is fused; the trainer clips gradients at 1.0."""
    _app(tmp_path / "run", "data.max_tokens=512")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_ddp_run_with_offload_on_two_gpus(tmp_path):
    # hidden 512: a 2048-token layer input (bf16) is 2 MiB, above the offloader's 1 MiB floor.
    # The random-weight Llama (the default base, model/tiny_base, has a fixed shape).
    wider = [
        "model=tiny_llama",
        "model.hidden_size=512",
        "model.intermediate_size=1024",
        "model.num_attention_heads=8",
        "model.num_key_value_heads=4",
        "data.max_tokens=2048",
        "trainer.devices=2",
    ]
    out = tmp_path / "ddp"
    _app(out, *wider, "sloth.offload=on")
    offloaded = _logged(out, "offload/offloaded_bytes_per_step")
    assert offloaded and min(offloaded) > 0
    assert (out / "train_ddp_process_1.log").is_file()  # the second rank ran under Hydra too
