"""Checkpoints that survive a kill and cannot run code: atomic writes, safe loading, the random
state a resumed run needs.

Lightning's ``TorchCheckpointIO`` serializes the checkpoint into memory and then writes it through
an fsspec transaction, which on a local disk writes a temporary file in the *system* temporary
directory and moves it over the target with ``shutil.move``. When that directory is on another
file system than the checkpoint (a tmpfs ``/tmp``, a network home), the move is a copy into the
target, and a kill during it leaves a truncated ``last.ckpt``; nothing is flushed to disk
either. :class:`AtomicCheckpointIO` writes next to the target and renames.

Loading never runs code: :func:`load_checkpoint_file` unpickles with ``weights_only=True``
(tensors, containers, numbers, strings and the types in :data:`CHECKPOINT_SAFE_GLOBALS`), and a
file holding anything else is refused with an :class:`UnsafeCheckpointError` naming the file and
the type, before any of it is built. A sharded (distributed) checkpoint directory is checked the
same way by :func:`verify_checkpoint`: its index is unpickled with an allow-list of the
distributed-checkpoint record types, and every non-tensor entry with ``weights_only=True``.

Lightning restores model, optimizer, schedulers, grad scaler, loops and stateful data loaders, but
not the global random generators. :class:`RandomStateCheckpoint` adds them, so dropout masks and
anything else drawing random numbers continue as in an uninterrupted run.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO

#: Types a checkpoint may hold beyond what ``torch.load(weights_only=True)`` accepts by default
#: (tensors, dtypes, ``torch.Size``, containers, numbers, strings). lightning_sloth's checkpoints
#: need none: the module's hyperparameters, the data module's state, the random generators and
#: 4-bit quantisation records are all stored as plain types. Extend it per call
#: (``AtomicCheckpointIO(safe_globals=[MyConfig])``), never by loading with ``weights_only=False``.
CHECKPOINT_SAFE_GLOBALS: tuple[Any, ...] = ()


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a pickled object of a type outside the allow-list; none of it was run."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only or missing directory); the file at
    the target path, if any, is the previous checkpoint, untouched."""


def load_checkpoint_file(
    path: str | Path, map_location: Any = "cpu", safe_globals: Iterable[Any] = ()
) -> dict[str, Any]:
    """``torch.load`` a checkpoint file with ``weights_only=True``: nothing in it can run code.

    Args:
        path: a checkpoint file (``last.ckpt``).
        map_location: as for ``torch.load``.
        safe_globals: types accepted besides :data:`CHECKPOINT_SAFE_GLOBALS` and torch's defaults.

    Raises:
        UnsafeCheckpointError: the file pickles an object of another type (named in the message).
    """
    path = Path(path)
    allowed = [*CHECKPOINT_SAFE_GLOBALS, *safe_globals]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(_refusal(path, error)) from error


def _refusal(path: Path, error: Exception, what: str = "checkpoint") -> str:
    """The message of a refused file: which file, which types, and what to do."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint (legacy format, a raw pickle): read torch's message
        names = re.findall(r"GLOBAL ([\w.]+)", str(error))
    found = ", ".join(sorted(set(names))) or str(error).splitlines()[0]
    return (
        f"refused to load {what} {path}: it holds pickled objects of type {found}, which a "
        "checkpoint of lightning_sloth never contains; loading it could run code. Nothing of it was "
        "run. Only load checkpoints you made; a type you trust can be allowed with safe_globals=[...]."
    )


# The record types of a distributed checkpoint's index (``.metadata``), as torch pickles them.
_DCP_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a distributed checkpoint's index; any type outside :data:`_DCP_INDEX_GLOBALS`
    (and torch's dtypes) is refused before it is looked up, so no other callable is ever reached."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_INDEX_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not a distributed-checkpoint record")


def verify_checkpoint(path: str | Path, safe_globals: Iterable[Any] = ()) -> None:
    """Check that a checkpoint loads without running code; raise :class:`UnsafeCheckpointError` if not.

    A file is loaded with :func:`load_checkpoint_file`. A directory is a distributed (sharded)
    checkpoint: its ``.metadata`` index is unpickled with the record types only, its Lightning
    ``meta.pt`` and every non-tensor entry (which ``torch.distributed.checkpoint`` would load with
    ``weights_only=False``) with ``weights_only=True``. Tensor entries are loaded by
    ``torch.distributed.checkpoint`` itself with ``weights_only=True``.
    """
    path = Path(path)
    if not path.is_dir():
        load_checkpoint_file(path, safe_globals=safe_globals)
        return
    index_file = path / ".metadata"
    if not index_file.is_file():
        raise FileNotFoundError(f"{path}: a checkpoint directory without a .metadata index")
    try:
        with index_file.open("rb") as handle:
            index = _IndexUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(_refusal(index_file, error, "the checkpoint index")) from error
    meta = path / "meta.pt"
    if meta.is_file():
        load_checkpoint_file(meta, safe_globals=safe_globals)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    allowed = [*CHECKPOINT_SAFE_GLOBALS, *safe_globals]
    for fqn, entry in index.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue
        info = index.storage_data[MetadataIndex(fqn)]
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"refused to load {path}: entry {fqn!r} is stored transformed "
                f"({info.transform_descriptors}) and cannot be checked before loading"
            )
        with (path / info.relative_path).open("rb") as handle:
            handle.seek(info.offset)
            blob = io.BytesIO(handle.read(info.length))
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(blob, weights_only=True)
        except pickle.UnpicklingError as error:
            names = ", ".join(sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(error))))) or str(error)
            raise UnsafeCheckpointError(
                f"refused to load {path}: entry {fqn!r} in {info.relative_path} holds pickled objects "
                f"of type {names}; loading it could run code. Nothing of it was run."
            ) from error


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that replaces the file atomically and loads without running code.

    The checkpoint goes to ``<name>.tmp-<pid>`` in the target's directory, is flushed and
    ``fsync``-ed, then ``os.replace``-d over the target (atomic on POSIX within one file system)
    and the directory is synced. A process killed at any point leaves either the previous
    checkpoint or the new one, never a partial file (a stale ``.tmp-*`` file at worst, removed by
    the next successful save of the same process). A write that fails (a full disk, a read-only
    or vanished directory) removes its temporary file and raises :class:`CheckpointWriteError`
    naming the path and the cause; the previous checkpoint stays as it was.

    ``load_checkpoint`` is :func:`load_checkpoint_file` whatever ``weights_only`` Lightning
    passes: a checkpoint pickling any other type is refused.

    Use it as ``Trainer(plugins=[AtomicCheckpointIO()])``; local paths only.

    Args:
        safe_globals: types a checkpoint may hold besides :data:`CHECKPOINT_SAFE_GLOBALS`.
    """

    def __init__(self, safe_globals: Iterable[Any] = ()) -> None:
        super().__init__()
        self.safe_globals = tuple(safe_globals)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as error:
            previous = (
                "the previous checkpoint there is intact" if path.is_file() else "none was there before"
            )
            cause = os.strerror(error.errno) if error.errno else str(error)
            raise CheckpointWriteError(
                error.errno or errno.EIO,
                f"could not write the checkpoint {path}: {cause} ({error}); {previous}. "
                "Free space or fix the output directory, then rerun the same command to resume",
            ) from error
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_directory(path.parent)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None):
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_checkpoint_file(
            path, map_location=map_location or (lambda storage, loc: storage), safe_globals=self.safe_globals
        )


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
