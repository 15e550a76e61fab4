"""A short ``Trainer`` run with the sloth strategy that records every training step's loss (shared by
the tests that check a model learns through the user's path)."""

from __future__ import annotations

from lightning.pytorch import Callback, Trainer

from lightning_sloth import SlothStrategy


class LossRecorder(Callback):
    """Every training step's loss, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit_recording_losses(module, data, precision, max_steps: int, **trainer_kwargs) -> list[float]:
    """``Trainer(plugins=[precision], strategy=SlothStrategy(kernels=True))`` for ``max_steps`` steps,
    no validation, logging, checkpoints or progress bar; returns the training losses."""
    recorder = LossRecorder()
    trainer = Trainer(
        plugins=[precision],
        strategy=SlothStrategy(kernels=True),
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=data)
    return recorder.losses
