"""A progress bar that counts a run's optimizer steps (``120/300``) instead of an epoch's batches.

Lightning's bars describe training per epoch (``Epoch 2/-2`` when ``max_epochs=-1`` lets
``max_steps`` end the run). The app trains for a number of steps over epochs of packed batches,
so one bar from 0 to ``estimated_stepping_batches``, continuing from the resumed step, says
more.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar


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
