"""Exact resume: a run killed with SIGKILL after a checkpoint, resumed with the same command, logs
the same per-step losses as an uninterrupted run; checkpoints are written atomically."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_sloth.plugins.checkpoint import (
    AtomicCheckpointIO,
    RandomStateCheckpoint,
    collect_random_state,
    restore_random_state,
)

SCRIPT = str(Path(sys.executable).parent / "lightning-sloth")
# A small random Llama, epochs of a few batches, LoRA dropout (so the random state matters),
# validation with samples, and a checkpoint every 3 steps; 10 steps cross an epoch boundary.
RUN = [
    "model=tiny_llama",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "lora.dropout=0.1",
    "data.num_train=24",
    "data.num_val=8",
    "data.max_tokens=128",
    "data.pad_to_multiple_of=16",
    "trainer=cpu_debug",
    "trainer.max_steps=10",
    "trainer.val_check_interval=4",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.deterministic=true",
    "trainer.samples=2",
    "trainer.sample_max_new_tokens=4",
    "trainer.enable_progress_bar=false",
]


def start(out: Path, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    return subprocess.Popen(
        [SCRIPT, *RUN, f"hydra.run.dir={out}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def losses(out: Path) -> dict[int, float]:
    """``{step: train/loss}`` over every CSV version of a run directory."""
    found = {}
    for path in sorted((out / "csv").glob("version_*/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                if row.get("train/loss"):
                    found[int(row["step"])] = float(row["train/loss"])
    return found


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_losses(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    uninterrupted = start(reference, tmp_path)
    victim = start(killed, tmp_path)
    checkpoint = killed / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not checkpoint.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL, victim.stdout.read()[-3000:]
    assert not (killed / "metrics.json").exists()
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    step = saved["global_step"]
    (loader_state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert 0 < step < 10 and loader_state["consumed"] > 0  # mid-epoch

    resumed = subprocess.run(
        [SCRIPT, *RUN, f"hydra.run.dir={killed}"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stdout.read()[-3000:]

    expected, got = losses(reference), losses(killed)
    assert sorted(expected) == list(range(10))
    after = [s for s in expected if s >= step]
    assert [got[s] for s in after] == [expected[s] for s in after]  # bit for bit
    assert len(after) >= 10 - step


CHILD = """
import sys, time, torch
from lightning_sloth.plugins import checkpoint as module
io = module.AtomicCheckpointIO()
path = sys.argv[1]
io.save_checkpoint({"step": 1, "weights": torch.arange(1 << 20)}, path)

def slow_save(obj, handle):
    handle.write(b"x" * 4096)  # a partial write, then the process dies
    handle.flush()
    print("writing", flush=True)
    time.sleep(600)

module.torch.save = slow_save
io.save_checkpoint({"step": 2, "weights": torch.zeros(1 << 20)}, path)
"""


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "writing", child.stderr.read()
    child.send_signal(signal.SIGKILL)
    child.wait()
    checkpoint = AtomicCheckpointIO().load_checkpoint(path)
    assert checkpoint["step"] == 1 and torch.equal(checkpoint["weights"], torch.arange(1 << 20))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("last.ckpt.tmp-")]  # the partial one


def test_atomic_save_replaces_and_cleans_up(tmp_path):
    io = AtomicCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint({"step": step}, tmp_path / "sub" / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "sub" / "last.ckpt")["step"] == 2
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["last.ckpt"]


def test_random_state_is_saved_and_restored_before_the_next_step():
    callback = RandomStateCheckpoint()
    checkpoint = {}
    torch.manual_seed(7)
    callback.on_save_checkpoint(None, None, checkpoint)
    expected = torch.rand(3)
    torch.rand(100)  # a resumed process is elsewhere in its streams
    callback.on_load_checkpoint(None, None, checkpoint)
    callback.on_train_batch_start(None, None, None, 0)
    assert torch.equal(torch.rand(3), expected)
    state = collect_random_state()
    first = torch.rand(2)
    restore_random_state(state)
    assert torch.equal(torch.rand(2), first)
