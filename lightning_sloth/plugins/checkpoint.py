"""Checkpoints that survive a kill: atomic writes, and the random state a resumed run needs.

Lightning's ``TorchCheckpointIO`` serializes the checkpoint into memory and then writes it through
an fsspec transaction, which on a local disk writes a temporary file in the *system* temporary
directory and moves it over the target with ``shutil.move``. When that directory is on another
file system than the checkpoint (a tmpfs ``/tmp``, a network home), the move is a copy into the
target, and a kill during it leaves a truncated ``last.ckpt``; nothing is flushed to disk
either. :class:`AtomicCheckpointIO` writes next to the target and renames.

Lightning restores model, optimizer, schedulers, grad scaler, loops and stateful data loaders, but
not the global random generators. :class:`RandomStateCheckpoint` adds them, so dropout masks and
anything else drawing random numbers continue as in an uninterrupted run.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` replaces the file atomically.

    The checkpoint goes to ``<name>.tmp-<pid>`` in the target's directory, is flushed and
    ``fsync``-ed, then ``os.replace``-d over the target (atomic on POSIX within one file system)
    and the directory is synced. A process killed at any point leaves either the previous
    checkpoint or the new one, never a partial file (a stale ``.tmp-*`` file at worst, removed by
    the next successful save of the same process).

    Use it as ``Trainer(plugins=[AtomicCheckpointIO()])``; local paths only.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Persist a rename (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def collect_random_state() -> dict[str, Any]:
    """The global generators: Python's ``random``, NumPy's (when installed), torch CPU and CUDA."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy

        # Plain lists and tensors only, so the checkpoint still loads with ``weights_only=True``.
        name, keys, position, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_random_state(state: dict[str, Any]) -> None:
    """Set the generators :func:`collect_random_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, keys, position, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), position, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class FinalCheckpoint(Callback):
    """Saves ``path`` after the last training step when ``max_steps`` is not a multiple of the cadence.

    It saves at the end of the batch like ``ModelCheckpoint``, so resuming from it (with a larger
    ``max_steps``) continues exactly as from any other step checkpoint, and tools that read the
    last checkpoint (``lightning-sloth-export``) see the final weights.

    Args:
        path: the checkpoint file (``ModelCheckpoint``'s ``last.ckpt``).
        every_n_steps: the ``ModelCheckpoint`` cadence; steps that are multiples are left to it.
    """

    def __init__(self, path: str | Path, every_n_steps: int) -> None:
        self.path = Path(path)
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == trainer.max_steps and step % self.every_n_steps:
            trainer.save_checkpoint(self.path)


class RandomStateCheckpoint(Callback):
    """Saves the global random generators in each checkpoint and restores them on resume.

    They are restored right before the first resumed training step, after Lightning has built
    the resumed iterators (a ``DataLoader`` iterator draws its base seed from torch's generator
    when created, which the uninterrupted run did at the start of the epoch, long before the
    checkpoint): the step then starts from the generators' state at the moment of the save.
    """

    KEY = "random_state"

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        checkpoint[self.KEY] = collect_random_state()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self._pending = checkpoint.get(self.KEY)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int
    ) -> None:
        if self._pending is not None:
            restore_random_state(self._pending)
            self._pending = None
