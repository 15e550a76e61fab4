"""Exact resume: a run killed with SIGKILL after a checkpoint, or stopped by SIGTERM at any step
(preemption), resumed with the same command, logs the same per-step losses as an uninterrupted
run; checkpoints are written atomically, and a full disk leaves the previous one loadable."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _processes
import pytest
import torch

from lightning_sloth.plugins.checkpoint import AtomicCheckpointIO, StepRandomState, seed_step

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


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_started():
    """Whatever a test started (and its process group) ends with the test, pass or fail."""
    yield
    while STARTED:
        _processes.stop(STARTED.pop())


def start(out: Path, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", **(env or {})}
    return _started(
        [SCRIPT, *RUN, f"hydra.run.dir={out}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _started(args, **kwargs) -> subprocess.Popen:
    STARTED.append(_processes.start(args, **kwargs))
    return STARTED[-1]


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

    resumed = _processes.run(
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


def resume_and_compare(reference: Path, stopped: Path, cwd: Path, uninterrupted, step: int) -> None:
    """Rerun the same command in ``stopped``; its losses from ``step`` on equal the reference's."""
    resumed = _processes.run(
        [SCRIPT, *RUN, f"hydra.run.dir={stopped}"],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stdout.read()[-3000:]
    expected, got = losses(reference), losses(stopped)
    assert sorted(expected) == list(range(10))
    after = [s for s in expected if s >= step]
    assert [got[s] for s in after] == [expected[s] for s in after]  # bit for bit
    assert len(after) >= 10 - step


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path):
    """Preemption: SIGTERM at an arbitrary step (here: as soon as step 3's checkpoint is on disk,
    during step 4's training or validation) -> that step finishes, ``last.ckpt`` is rewritten
    atomically at it, the exit code is 143 with a message saying how to resume, and the same
    command continues exactly."""
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    uninterrupted = start(reference, tmp_path)
    victim = start(stopped, tmp_path)
    checkpoint = stopped / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not checkpoint.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    first = torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]
    victim.send_signal(signal.SIGTERM)
    output = victim.communicate(timeout=300)[0]
    assert victim.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "preempted by SIGTERM at step" in output and "rerun the same command" in output
    assert not (stopped / "metrics.json").exists()
    step = torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]
    assert first <= step < 10
    assert not list(checkpoint.parent.glob("*.tmp-*"))
    resume_and_compare(reference, stopped, tmp_path, uninterrupted, step)


@pytest.mark.slow
def test_the_slurm_warning_signal_saves_and_requeues(tmp_path):
    """``sbatch --signal=USR1@90`` inside a SLURM job: the step finishes, the checkpoint is written,
    the job is requeued with ``scontrol requeue <job id>`` and the exit code is 128 + SIGUSR1."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    slurm = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "finetune",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }
    out = tmp_path / "run"
    victim = start(out, tmp_path, env=slurm)
    checkpoint = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not checkpoint.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    victim.send_signal(signal.SIGUSR1)
    output = victim.communicate(timeout=300)[0]
    assert victim.returncode == 128 + signal.SIGUSR1, output[-3000:]
    assert "preempted by SIGUSR1" in output and "the SLURM job is requeued" in output
    assert calls.read_text().split() == ["requeue", "4242"]
    assert 3 <= torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"] < 10


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
    child = _started(
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


def test_each_batch_draws_from_its_own_seed():
    """A batch's random numbers depend on the run's seed and the batch's index, nothing else."""

    class Loop:
        total_batch_idx = 0

    class FakeTrainer:
        fit_loop = Loop()

    def draws(seed: int, index: int, noise: int) -> torch.Tensor:
        torch.rand(noise)  # whatever ran before: validation, a new epoch's iterator, a resume
        FakeTrainer.fit_loop.total_batch_idx = index
        StepRandomState(seed).on_train_batch_start(FakeTrainer(), None, None, 0)
        return torch.rand(4)

    assert torch.equal(draws(0, 5, noise=1), draws(0, 5, noise=100))
    assert not torch.equal(draws(0, 5, noise=1), draws(0, 6, noise=1))
    assert not torch.equal(draws(0, 5, noise=1), draws(1, 5, noise=1))
    assert len({seed_step(s, i) for s in range(4) for i in range(1000)}) == 4000


def test_fit_gives_the_signals_back_as_it_found_them(tmp_path):
    """After ``fit`` returns, SIGTERM and the SLURM signals have their dispositions from before it:
    the process can be terminated again (Lightning's teardown runs before the callbacks', so the
    callback must not reinstall Lightning's SIGTERM handler, which only logs), and nothing keeps
    the trainer and its model alive (a handler left installed held both for the process's life)."""
    import gc
    import weakref

    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_sloth.plugins.checkpoint import PREEMPTION_SIGNALS, PreemptionCheckpoint

    signums = [getattr(signal, name) for name in PREEMPTION_SIGNALS]
    before = {signum: signal.getsignal(signum) for signum in signums}
    try:
        for _ in range(2):
            trainer = L.Trainer(
                max_steps=2,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=tmp_path,
                callbacks=[PreemptionCheckpoint(tmp_path / "last.ckpt")],
            )
            model = BoringModel()
            trainer.fit(model)
            assert {signum: signal.getsignal(signum) for signum in signums} == before
            alive = weakref.ref(trainer), weakref.ref(model)
            del trainer, model
            gc.collect()
            assert [ref() is None for ref in alive] == [True, True]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
