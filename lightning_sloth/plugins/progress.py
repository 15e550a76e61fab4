"""A run's progress: a bar of optimizer steps on a terminal, one line every N steps in a log.

Lightning's bars describe training per epoch (``Epoch 2/-2`` when ``max_epochs=-1`` lets
``max_steps`` end the run). The app trains for a number of steps over epochs of packed batches,
so one bar from 0 to ``estimated_stepping_batches``, continuing from the resumed step, says
more (:class:`StepProgressBar`).

Where the output is not a terminal (CI, a SLURM log, ``| tee``) a bar is a new line per update,
validation bars nested in it. :class:`ProgressLines` prints instead one line every ``N`` steps
(step, loss, real tokens/s and MFU from :class:`~lightning_sloth.plugins.callbacks.SlothThroughputMonitor`)
and one line per validation::

    training 600 steps on cpu: 155 K of 956 K parameters trainable; a line every 40 steps
    step 40/600  loss 0.2454  1,874 real tok/s  MFU n/a  (21 s)
    ...
    validation at step 100: loss 0.1060, token_acc 0.9610, exact_match 0.7812 (4.1 s)
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from lightning_sloth.plugins.callbacks import SlothThroughputMonitor


def interactive() -> bool:
    """Whether the output goes to a terminal (stdout and stderr both), where a bar redraws in place."""
    return all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))


def lines_every(max_steps: int, log_every_n_steps: int, lines: int = 15) -> int:
    """The step cadence of :class:`ProgressLines` for about ``lines`` lines over ``max_steps``: a
    multiple of ``log_every_n_steps`` (when the throughput monitor has fresh figures)."""
    if max_steps <= 0:
        return log_every_n_steps
    every = max(1, math.ceil(max_steps / lines))
    return math.ceil(every / log_every_n_steps) * log_every_n_steps


class StepProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose training bar reads optimizer steps over the whole run.

    Validation bars are Lightning's own.
    """

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        bar.set_description("steps")
        return bar

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.reset(total=int(trainer.estimated_stepping_batches))
        self._set_n(trainer.global_step)

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        """Epochs do not restart the bar."""

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.train_progress_bar is not None and self._should_update(step, self.train_progress_bar.total):
            self._set_n(step)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def _set_n(self, value: int) -> None:
        bar = self.train_progress_bar
        if not bar.disable:
            bar.n = value
            bar.refresh()


class ProgressLines(ProgressBar):
    """Progress as log lines: one per ``every_n_steps`` optimizer steps, one per validation.

    A training line has the step, the training loss (read back only on those steps), the real
    tokens per second and MFU of :class:`~lightning_sloth.plugins.callbacks.SlothThroughputMonitor`'s
    last window (when the Trainer has one) and the time since training started. Printed on global
    rank zero, to stdout, flushed. The sanity check prints nothing.

    Args:
        every_n_steps: cadence of the training lines (``None``: :func:`lines_every`, about 15
            lines per run); the last step always gets one.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be positive or None, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._start = 0.0
        self._validation_start = 0.0
        self._last_step = -1

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.trainer.is_global_zero

    def _print(self, line: str) -> None:
        if self.is_enabled:
            print(line, flush=True)

    def _every(self, trainer: Trainer) -> int:
        if self.every_n_steps is not None:
            return self.every_n_steps
        return lines_every(int(trainer.estimated_stepping_batches), trainer.log_every_n_steps)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()
        params = list(pl_module.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        steps = int(trainer.estimated_stepping_batches)
        resumed = f" from step {trainer.global_step}" if trainer.global_step else ""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            import torch

            where = f"{device} ({torch.cuda.get_device_name(device)})"
        else:
            where = device.type
        processes = f" x {trainer.world_size} processes" if trainer.world_size > 1 else ""
        self._print(
            f"training {steps} steps{resumed} on {where}{processes}: {get_human_readable_count(trainable)} of "
            f"{get_human_readable_count(total)} parameters trainable; a line every {self._every(trainer)} steps"
        )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, total = trainer.global_step, int(trainer.estimated_stepping_batches)
        if step == self._last_step or (step % self._every(trainer) and step != total):
            return
        self._last_step = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        parts = [f"step {step}/{total}"]
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        monitor = next((c for c in trainer.callbacks if isinstance(c, SlothThroughputMonitor)), None)
        if monitor is not None and monitor.tokens_per_sec is not None:
            parts.append(f"{monitor.tokens_per_sec:,.0f} real tok/s")
            parts.append("MFU n/a" if monitor.mfu is None else f"MFU {100 * monitor.mfu:.1f}%")
        parts.append(f"({time.perf_counter() - self._start:.0f} s)")
        self._print("  ".join(parts))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {
            k.removeprefix("val/"): v for k, v in trainer.callback_metrics.items() if k.startswith("val/")
        }
        shown = ", ".join(f"{k} {float(v):.4f}" for k, v in metrics.items()) or "no metrics"
        seconds = time.perf_counter() - self._validation_start
        self._print(f"validation at step {trainer.global_step}: {shown} ({seconds:.1f} s)")
