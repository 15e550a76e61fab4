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

Preemption: :class:`PreemptionCheckpoint` turns SIGTERM, SIGUSR1 (SLURM's ``--signal``) and
SIGUSR2 (submitit's) during training into: the current step finishes, an atomic checkpoint is
written, the SLURM job is requeued where asked, and the process exits with ``128 + signal`` and
a message saying how to resume.

Lightning restores model, optimizer, schedulers, grad scaler, loops and stateful data loaders, but
not the global random generators. :class:`StepRandomState` seeds them at every training batch
from the run's seed and the batch's index, so dropout masks and anything else drawing random
numbers continue as in an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import pickle
import random
import re
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

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
    checkpoint: its Lightning ``meta.pt`` is loaded with ``weights_only=True``, its ``.metadata``
    index unpickled with the record types only, and every non-tensor entry (which
    ``torch.distributed.checkpoint`` would load with ``weights_only=False``) with
    ``weights_only=True``. Tensor entries are loaded by ``torch.distributed.checkpoint`` itself
    with ``weights_only=True``. What a directory lacks is not checked (loading it fails anyway).
    """
    path = Path(path)
    if not path.is_dir():
        load_checkpoint_file(path, safe_globals=safe_globals)
        return
    meta = path / "meta.pt"
    if meta.is_file():
        load_checkpoint_file(meta, safe_globals=safe_globals)
    index_file = path / ".metadata"
    if not index_file.is_file():  # nothing more that would be unpickled (loading it fails as is)
        return
    try:
        with index_file.open("rb") as handle:
            index = _IndexUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(_refusal(index_file, error, "the checkpoint index")) from error
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
        handle = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as raw:
                handle = _WriteErrors(raw)
                torch.save(checkpoint, handle)
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, path)
        except (OSError, RuntimeError) as error:
            # torch's zip writer reports a failed write of the file object as a RuntimeError
            # ("unexpected pos"): the OSError the write raised is the cause.
            cause = handle.error if handle is not None and handle.error is not None else error
            if not isinstance(cause, OSError):
                raise
            previous = (
                "the previous checkpoint there is intact" if path.is_file() else "none was there before"
            )
            reason = os.strerror(cause.errno) if cause.errno else str(cause)
            raise CheckpointWriteError(
                cause.errno or errno.EIO,
                f"could not write the checkpoint {path}: {reason} ({cause}); {previous}. "
                "Free space or fix the output directory, then rerun the same command to resume",
            ) from cause
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_directory(path.parent)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None):
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_checkpoint_file(
            path, map_location=map_location or (lambda storage, loc: storage), safe_globals=self.safe_globals
        )


class _WriteErrors:
    """A binary file's ``write`` that remembers the ``OSError`` it raised (torch's zip writer turns
    it into a RuntimeError without the cause)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


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


def seed_step(seed: int, batch_index: int) -> int:
    """The seed of one training batch: a mix of the run's seed and the batch's index (64 bits)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + batch_index * 0xBF58476D1CE4E5B9 + 1) % 2**64
    return (mixed ^ (mixed >> 31)) % 2**63


def seed_generators(seed: int) -> None:
    """Seed the global generators: Python's ``random``, NumPy's (when installed), torch CPU and CUDA."""
    random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


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


class StepRandomState(Callback):
    """Every training batch starts from generators seeded by the run's seed and the batch's index.

    Dropout masks and anything else a step draws then depend only on which batch it is, not on
    what ran before it: a resumed run continues bit for bit whether its checkpoint was taken in
    the middle of an epoch, at its end or at a validation step (creating a ``DataLoader``
    iterator, for validation or a new epoch, draws from torch's generator; a resumed process
    creates its iterators at other moments than the uninterrupted one did). Nothing needs to be
    saved: the batch index is in every checkpoint.

    Args:
        seed: the run's seed (default: the one ``seed_everything`` recorded in ``PL_GLOBAL_SEED``,
            else 0).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int
    ) -> None:
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        seed_generators(seed_step(seed, trainer.fit_loop.total_batch_idx))


#: Signals :class:`PreemptionCheckpoint` handles: SLURM's end-of-job SIGTERM, the warning signal
#: ``sbatch --signal=USR1@90`` sends (Lightning's SLURM requeue signal), and submitit's default.
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


class PreemptionCheckpoint(Callback):
    """Preemption loses nothing: on a signal the step finishes, a checkpoint is written, the exit is non-zero.

    From ``on_train_start`` this callback holds SIGTERM, and from ``setup`` SIGUSR1 and SIGUSR2
    (a warning signal while the model loads is kept too). A signal only records itself; at the
    end of the training step that is running (the next one if it came during validation) the
    callback

    - saves ``path`` through the Trainer exactly where ``ModelCheckpoint`` saves (the end of a
      training batch), so a resumed run continues bit for bit; atomic with
      :class:`AtomicCheckpointIO`. At an epoch's last batch it waits one more step: a loader
      state saved there (every batch of the epoch consumed) is applied by the resumed run to the
      next epoch's batches;
    - hands the stop to Lightning's own SIGTERM handler (which shares it with every rank and ends
      the loop after the step's logging, or in the middle of a validation that was due);
    - when the loop ends with ``SIGTERMException``: requeues the SLURM job (``scontrol requeue``,
      as Lightning's ``SLURMEnvironment`` does) when ``requeue`` is set and the signal was a
      warning signal (SIGUSR1/2; SIGTERM alone is also what ``scancel`` sends), sets the exit code
      to ``128 + signal number`` (143 for SIGTERM) and logs how to resume: a scheduler sees a
      stopped job, not a finished one.

    With several processes the decision is shared (``reduce_boolean_decision``: one rank
    signalled stops all at the same step). Lightning's SIGTERM handler alone would stop the run
    in the middle of validation or after an epoch's last step without a checkpoint, and exit 0.
    Lightning's ``SLURMEnvironment`` should be given ``auto_requeue=False``: its handler saves a
    checkpoint from inside the signal handler, in the middle of a step.

    Args:
        path: the checkpoint to write (the app's ``checkpoints/last.ckpt``, which ``resume=auto``
            and ``Trainer.fit(ckpt_path=...)`` read).
        requeue: requeue the SLURM job after saving, on SIGUSR1/SIGUSR2.
        resume_hint: how to resume, for the message (default: ``Trainer.fit(..., ckpt_path=<path>)``).

    Attributes:
        signum: the signal received, or ``None``.
        saved_step: the step the checkpoint was saved at, or ``None``.
    """

    def __init__(self, path: str | Path, requeue: bool = False, resume_hint: str | None = None) -> None:
        self.path = Path(path)
        self.requeue = requeue
        self.resume_hint = resume_hint or f"Trainer.fit(..., ckpt_path={str(self.path)!r})"
        self.signum: int | None = None
        self.saved_step: int | None = None
        self._done = False
        self._originals: dict[int, Any] = {}
        self._lightning_handler: Any = None

    def _install(self, name: str) -> None:
        signum = getattr(signal, name, None)
        if signum is None:  # not on this platform
            return
        self._originals.setdefault(signum, signal.getsignal(signum))
        # Outside the main thread no handler can be set (Lightning's cannot either).
        with contextlib.suppress(ValueError):
            signal.signal(signum, self._on_signal)

    def _finish(self) -> None:
        """Give the signals back to the handlers they had before, where this callback's handler is
        still the one installed: Lightning's teardown runs before the callbacks' and has already put
        back what SIGTERM had before ``fit``; reinstalling Lightning's own handler over that would
        leave the process ignoring SIGTERM after ``fit`` returns."""
        self._done = True
        for signum, handler in self._originals.items():
            if signal.getsignal(signum) != self._on_signal:
                continue
            with contextlib.suppress(ValueError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:
            self._done, self._originals = False, {}
            for name in PREEMPTION_SIGNALS[1:]:
                self._install(name)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._lightning_handler = signal.getsignal(signal.SIGTERM)  # registered by Lightning by now
        self._install("SIGTERM")

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._done:  # fit is over (Lightning's teardown may put this handler back): as before it
            _default_action(signum, frame, self._originals.get(signum, signal.SIG_DFL))
            return
        if self.signum is None:
            self.signum = signum
            log.warning("received %s: stopping after the current training step", signal.Signals(signum).name)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.saved_step is not None:
            return
        if not trainer.strategy.reduce_boolean_decision(self.signum is not None, all=False):
            return
        if self.signum is None:
            self.signum = signal.SIGTERM  # another rank was signalled
        final = 0 <= trainer.max_steps <= trainer.global_step
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and not final:
            return
        trainer.save_checkpoint(self.path)
        self.saved_step = trainer.global_step
        if callable(self._lightning_handler):
            self._lightning_handler(signal.SIGTERM, None)
        else:  # no Lightning handler to hand the stop to (not the main thread)
            raise SIGTERMException(128 + self.signum)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish()
        if not isinstance(exception, SIGTERMException):
            return
        signum = self.signum or signal.SIGTERM
        name = signal.Signals(signum).name
        exception.code = 128 + signum
        requeued = self.requeue and name != "SIGTERM" and trainer.is_global_zero and _requeue_slurm_job()
        if not trainer.is_global_zero:
            return
        if self.saved_step is None:
            log.error("stopped by %s before training resumed; nothing new to save", name)
            return
        log.error(
            "preempted by %s at step %d: saved %s%s. To resume, %s",
            name,
            self.saved_step,
            self.path,
            "; the SLURM job is requeued" if requeued else "",
            self.resume_hint,
        )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish()


def _default_action(signum: int, frame: Any, handler: Any) -> None:
    """Do what ``handler`` (a signal's earlier disposition) would have done with the signal."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _requeue_slurm_job() -> bool:
    """``scontrol requeue`` the current SLURM job (array task included); whether it worked."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job = os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning("not requeued: no SLURM job id in the environment")
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("requeuing SLURM job %s failed: %s", job, error)
        return False
    if result.returncode:
        log.warning("requeuing SLURM job %s failed: %s", job, result.stderr.strip())
    return result.returncode == 0
