"""The ``lightning-sloth`` app as a user runs it: console script, resume, multirun, user config dirs.

The end-to-end runs (marked slow; they run in CI too) train the embedded tiny Llama on the
synthetic task for a few steps on the CPU.
"""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _processes
import pytest
import torch
from hydra import compose, initialize_config_module
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from omegaconf import OmegaConf

from lightning_sloth import SlothDDPStrategy, SlothStrategy, build

SCRIPT = str(Path(sys.executable).parent / "lightning-sloth")
MODULE = [sys.executable, "-m", "lightning_sloth.train"]
# A few CPU steps on the tiny default: validation and a checkpoint every 3 steps.
QUICK = [
    "trainer=cpu_debug",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.enable_progress_bar=false",
    "data.num_train=64",
    "data.num_val=16",
    "data.max_tokens=512",
]


def cli(*args: str, command=(SCRIPT,), cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "2"}
    result = _processes.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    result.log = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        yield


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("multirun", [False, True])
def test_strategy_and_launcher_follow_the_rule(hydra_conf, tmp_path, devices, multirun):
    cfg = compose("train", overrides=["trainer.accelerator=cpu", f"trainer.devices={devices}"])
    trainer = build.build_trainer(cfg, tmp_path, multirun=multirun, callbacks=[], loggers=False)
    strategy = trainer.strategy
    if devices == 1:
        assert type(strategy) is SlothStrategy
        assert strategy.launcher is None
    elif multirun:
        # `-m` must not re-run sys.argv (the whole sweep) in the extra processes: spawn them.
        assert isinstance(strategy, SlothDDPStrategy)
        assert isinstance(strategy.launcher, _MultiProcessingLauncher)
        assert strategy.launcher._start_method == "spawn"
    else:
        assert isinstance(strategy, SlothDDPStrategy)
        assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
    assert trainer.precision_plugin.precision == ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    assert not tmp_path.joinpath("checkpoints").exists()


def test_ddp_start_method_rule():
    assert build.ddp_start_method(multirun=True) == "spawn"
    assert build.ddp_start_method(multirun=False) == "popen"


def test_cli_rejects_a_wrong_key_before_running(tmp_path):
    result = cli("model=tiny_llama", "model.hiden_size=3", f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert result.returncode != 0, result.log
    assert "Key 'hiden_size' not in 'RandomModelConfig'" in result.stderr, result.log
    assert not (tmp_path / "out").exists()


def test_cli_rejects_an_out_of_range_value_before_loading(tmp_path):
    result = cli("data.max_tokens=0", "lora.r=-1", f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert result.returncode != 0, result.log
    assert "data.max_tokens: must be > 0, got 0" in result.stderr, result.log
    assert "lora.r: must be > 0, got -1" in result.stderr, result.log
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_cli_user_config_dir(tmp_path):
    conf = tmp_path / "my_conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "my_model.yaml").write_text(
        "defaults:\n  - tiny_llama\n  - _self_\n\nhidden_size: 96\nnum_hidden_layers: 3\n"
    )
    result = cli("--config-dir", str(conf), "model=my_model", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.log
    assert "hidden_size: 96" in result.stdout and "num_hidden_layers: 3" in result.stdout, result.log


def test_cli_help_lists_the_config_groups(tmp_path):
    result = cli("--help", command=MODULE, cwd=tmp_path)
    assert result.returncode == 0, result.log
    for option in (
        "tiny_llama",
        "llama_3_2_1b",
        "hf",
        "synthetic",
        "jsonl",
        "hf_dataset",
        "cpu_debug",
        "llama_1b_bench",
    ):
        assert option in result.stdout, result.log


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One short training run of the console script on the tiny default."""
    root = tmp_path_factory.mktemp("app")
    out = root / "run"
    result = cli(*QUICK, f"hydra.run.dir={out}", cwd=root)
    assert result.returncode == 0, result.log
    return out, result


@pytest.mark.slow
def test_console_script_trains_and_writes_every_output(quick_run):
    out, result = quick_run
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6
    assert metrics["val_step"] == 6
    assert [v["step"] for v in metrics["val_history"]] == [3, 6]
    assert metrics["val_history"][-1] == {"step": 6, **metrics["val"]}
    assert set(metrics["val"]) >= {"loss", "token_acc", "exact_match"}
    assert 0.0 <= metrics["val"]["token_acc"] <= 1.0
    assert all(isinstance(metrics[k], float) for k in ("train_loss_first", "train_loss_last"))
    assert 0.0 < metrics["packing_efficiency"]["train"] <= 1.0
    assert metrics["wall_time_s"] >= metrics["train_time_s"] > 0
    assert metrics["resumed_from"] is None
    assert "lightning-sloth: 6 steps" in result.stdout + result.stderr

    header = (out / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/loss", "val/loss", "val/token_acc", "val/exact_match"} <= set(header)
    assert list((out / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 6
    assert (out / ".hydra" / "config.yaml").is_file()


@pytest.mark.slow
def test_rerun_in_the_same_dir_resumes_from_last_checkpoint(quick_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(quick_run[0], out)
    # Same output dir, more steps; `resume=auto` (the default) picks up checkpoints/last.ckpt.
    args = [a for a in QUICK if not a.startswith("trainer.max_steps")]
    result = cli(*args, "trainer.max_steps=9", f"hydra.run.dir={out}", command=MODULE, cwd=tmp_path)
    assert result.returncode == 0, result.log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(out / "checkpoints" / "last.ckpt")
    assert metrics["steps"] == 9
    assert [v["step"] for v in metrics["val_history"]] == [9]
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 9
    # The resumed run logs to a new version; its training steps continue from 6.
    with (out / "csv" / "version_1" / "metrics.csv").open() as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row["train/loss"]]
    assert steps == [6, 7, 8]


@pytest.mark.slow
def test_multirun_sweep_writes_one_job_dir_per_value(tmp_path):
    sweep = tmp_path / "sweep"
    args = [a for a in QUICK if not a.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    result = cli(
        "-m",
        "optimizer.lr=1e-3,3e-3",
        *args,
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.log
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert metrics["steps"] == 2
        assert OmegaConf.load(sweep / job / ".hydra" / "config.yaml").optimizer.lr == lr
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()


def test_under_slurm_the_app_stops_at_a_step_and_requeues_itself(hydra_conf, tmp_path, monkeypatch):
    """Inside a SLURM job Lightning's auto-requeue (a save from inside its signal handler) is off;
    PreemptionCheckpoint saves at the step's end and requeues; the launcher asks for the signal."""
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_sloth.plugins.checkpoint import PreemptionCheckpoint

    slurm = dict(SLURM_NTASKS="1", SLURM_JOB_NAME="finetune", SLURM_NODELIST="node1", SLURM_JOB_ID="7")
    slurm |= dict(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    trainer = build.build_trainer(
        compose("train", overrides=["trainer.accelerator=cpu"]), tmp_path, loggers=False
    )
    environment = trainer._accelerator_connector.cluster_environment  # what Lightning's signals read
    assert isinstance(environment, SLURMEnvironment) and not environment.auto_requeue
    (preemption,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    assert preemption.requeue and preemption.path == tmp_path / "checkpoints" / "last.ckpt"
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    launcher = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True).hydra.launcher
    assert launcher.signal_delay_s == 120 and launcher.max_num_timeout > 0
