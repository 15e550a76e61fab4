"""What a user sees in a log: the default run with stdout piped prints a line every N steps (step,
loss, real tokens/s, MFU), one line per validation, and an end summary with the throughput; no
progress-bar redraws, and about 60 lines for the whole default run."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import _processes
import pytest
from hydra import compose, initialize_config_module

from lightning_sloth.plugins.progress import lines_every

SCRIPT = str(Path(sys.executable).parent / "lightning-sloth")


def test_the_cadence_gives_about_fifteen_lines_a_run():
    assert lines_every(600, 10) == 40 and math.ceil(600 / 40) == 15
    assert lines_every(10, 1) == 1 and lines_every(7, 5) == 5 and lines_every(1000, 3) == 69


@pytest.mark.slow
def test_the_default_run_in_a_log(tmp_path):
    """The default config (tiny base, synthetic task), shortened: 12 steps, validation every 6."""
    out = tmp_path / "run"
    shortened = [
        "trainer.accelerator=cpu",
        "trainer.max_steps=12",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=2",
        "trainer.checkpoint_every_n_steps=6",
        "trainer.samples=8",
        "data.num_val=16",
        "data.max_tokens=256",
    ]
    result = _processes.run(
        [SCRIPT, *shortened, f"hydra.run.dir={out}"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    output = result.stdout
    assert result.returncode == 0, output[-3000:]
    assert "\r" not in output and "it/s]" not in output  # no bar redraws, no nested bars
    lines = output.rstrip("\n").split("\n")
    steps = [line for line in lines if re.match(r"step \d+/12 ", line)]
    assert [line.split()[1] for line in steps] == ["2/12", "4/12", "6/12", "8/12", "10/12", "12/12"]
    assert all(re.search(r"loss \d\.\d{4}  [\d,]+ real tok/s  MFU n/a  \(\d+ s\)$", line) for line in steps)
    validations = [line for line in lines if line.startswith("validation at step")]
    assert [v.split(":")[0] for v in validations] == ["validation at step 6", "validation at step 12"]
    assert all("loss" in v and "token_acc" in v for v in validations)
    assert any(line.startswith("training 12 steps on cpu: ") for line in lines)
    assert any(re.match(r"  throughput: [\d,]+ real tokens/s, MFU n/a$", line) for line in lines)
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["real_tokens_per_s"] > 0 and summary["mfu"] is None

    # The whole default run (600 steps, validation every 100) prints the same lines but more
    # progress and validation lines: about 15 and 6.
    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        trainer = compose("train").trainer
    every = lines_every(trainer.max_steps, trainer.log_every_n_steps)
    default_lines = len(lines) - len(steps) - len(validations)
    default_lines += math.ceil(trainer.max_steps / every) + trainer.max_steps // trainer.val_check_interval
    assert default_lines <= 60, output
