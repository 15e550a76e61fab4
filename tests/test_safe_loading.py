"""Checkpoints that cannot run code: a run's ``last.ckpt`` replaced by a file whose unpickling
would create a file is refused by ``lightning-sloth-export``, ``lightning-sloth-generate`` and a
resumed run, naming the file and the type, and the file is never created. Sharded checkpoint
directories are checked the same way."""

import os
import shutil
import sys
from pathlib import Path

import _processes
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_export import run_app

from lightning_sloth import build, export, generate
from lightning_sloth.plugins.checkpoint import (
    AtomicCheckpointIO,
    UnsafeCheckpointError,
    load_checkpoint_file,
    verify_checkpoint,
)

# Two steps of a small random Llama: the checkpoint is a real one of the app.
RUN = [
    "model=tiny_llama",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "data.num_train=16",
    "data.num_val=4",
    "data.max_tokens=128",
    "trainer=cpu_debug",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.samples=0",
    "trainer.enable_progress_bar=false",
]


class Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft(checkpoint: Path, marker: Path) -> None:
    """Rewrite a real checkpoint with the payload hidden among its hyperparameters."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["note"] = Payload(marker)
    torch.save(state, checkpoint)


@pytest.fixture(scope="module")
def crafted_run(tmp_path_factory):
    """A real 3-step run whose ``checkpoints/last.ckpt`` carries the payload; returns (run, marker)."""
    root = tmp_path_factory.mktemp("crafted")
    run = root / "run"
    run_app(run, RUN)
    marker = root / "pwned"
    craft(run / "checkpoints" / "last.ckpt", marker)
    return run, marker


def test_the_payload_runs_when_loaded_unrestricted(crafted_run, tmp_path):
    """The crafted file is a real threat: ``weights_only=False`` runs the command."""
    run, marker = crafted_run
    probe = tmp_path / "last.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", probe)
    code = f"import torch; torch.load({str(probe)!r}, weights_only=False)"
    _processes.run([sys.executable, "-c", code], check=True, timeout=120)
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("command", ["lightning-sloth-export", "lightning-sloth-generate"])
def test_export_and_generate_refuse_it(crafted_run, tmp_path, command):
    """The console scripts' entry points (``export.main``, ``generate.main``), in this process."""
    run, marker = crafted_run
    main, args = {
        "lightning-sloth-export": (export.main, [str(run), "--out", str(tmp_path)]),
        "lightning-sloth-generate": (generate.main, [str(run), "reverse: abc\\n"]),
    }[command]
    expected = f"refused to load checkpoint {run / 'checkpoints' / 'last.ckpt'}: .* type posix.system"
    with pytest.raises(UnsafeCheckpointError, match=expected):
        main(args)
    assert not marker.exists()
    assert not (tmp_path / "merged").exists()


def test_a_resumed_run_refuses_it(crafted_run):
    run, marker = crafted_run
    with pytest.raises(
        UnsafeCheckpointError, match=r"refused to load checkpoint .*last\.ckpt.*posix\.system"
    ):
        run_app(run, [*RUN, "trainer.max_steps=4"])
    assert not marker.exists()


def test_the_checkpoint_io_refuses_whatever_lightning_asks(tmp_path):
    path, marker = tmp_path / "x.ckpt", tmp_path / "pwned"
    torch.save({"state_dict": {}, "extra": Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    with pytest.raises(FileNotFoundError):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")
    assert not marker.exists()
    # A type the caller trusts is allowed explicitly.
    torch.save({"shape": torch.Size([2, 3]), "when": Path("/x")}, path)
    with pytest.raises(UnsafeCheckpointError, match="pathlib"):
        load_checkpoint_file(path)
    assert AtomicCheckpointIO(safe_globals=[type(Path("/x"))]).load_checkpoint(path)["when"] == Path("/x")


def sharded(path: Path, extra=None) -> Path:
    state = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3, "lr": [1e-3]}
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 3, "loops": {}}, path / "meta.pt")
    return path


def test_sharded_checkpoints_are_checked_before_loading(tmp_path):
    marker = tmp_path / "pwned"
    verify_checkpoint(sharded(tmp_path / "clean"))
    assert build.resolve_resume(str(tmp_path / "clean"), tmp_path) == str(tmp_path / "clean")

    entry = sharded(tmp_path / "entry", extra=Payload(marker))
    with pytest.raises(UnsafeCheckpointError, match="entry 'extra'.*posix.system"):
        build.resolve_resume(str(entry), tmp_path)

    meta = sharded(tmp_path / "meta")
    torch.save({"global_step": 3, "extra": Payload(marker)}, meta / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"meta\.pt.*posix\.system"):
        verify_checkpoint(meta)

    index = sharded(tmp_path / "index")
    payload = Payload(marker)
    import pickle

    (index / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(UnsafeCheckpointError, match="checkpoint index.*posix.system"):
        verify_checkpoint(index)
    assert not marker.exists()
