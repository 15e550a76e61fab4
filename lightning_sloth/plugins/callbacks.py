"""Callbacks that observe and guard a run: throughput on real tokens, gradient flow, adapter export."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor

log = logging.getLogger(__name__)


def _documents(batch: Any) -> int:
    return getattr(batch, "num_documents", None) or len(batch["input_ids"])


def _real_tokens(batch: Any) -> int:
    if hasattr(batch, "num_tokens"):
        return batch.num_tokens
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()


class SlothThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` counting documents as samples and real tokens as items.

    Logs ``train|device/items_per_sec`` as real (non-padding) tokens per second, and MFU where the
    module exposes ``flops_per_batch`` (``CausalLMModule`` does; see its formula) and the device's
    peak rate is known.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=_documents, length_fn=_real_tokens, **kwargs)


class GradientFlowError(RuntimeError):
    """Raised when no usable gradient reaches the trainable parameters."""


class GradientFlowGuard(Callback):
    """Stops a run whose trainable gradients are all zero or not finite.

    The check reads one scalar per check back from the device, so it runs every
    ``every_n_steps`` optimizer steps (and always on the first one, where a broken setup shows).
    The error names the step and the problem; resume from the last checkpoint after fixing it.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if every_n_steps <= 0:
            raise ValueError(f"GradientFlowGuard every_n_steps must be positive, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.last_grad_norm: float | None = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        step = trainer.global_step
        if step % self.every_n_steps:
            return
        grads = [p.grad for p in pl_module.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            raise GradientFlowError(f"step {step}: no trainable parameter received a gradient")
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if hasattr(norm, "full_tensor"):  # sharded (FSDP2) gradients: a DTensor norm, reduced over ranks
            norm = norm.full_tensor()
        norm = float(norm)
        self.last_grad_norm = norm
        if not torch.isfinite(torch.tensor(norm)):
            raise GradientFlowError(f"step {step}: trainable gradient norm is {norm} (non-finite gradients)")
        if norm == 0.0:
            raise GradientFlowError(
                f"step {step}: all {len(grads)} trainable gradients are zero "
                "(frozen path, detached loss or fully masked labels?)"
            )
        pl_module.log("train/grad_norm", norm, batch_size=1)


class SaveAdapter(Callback):
    """Saves the trained adapter in PEFT's format (or the full model) at the end of training.

    The directory holds ``adapter_config.json`` + ``adapter_model.safetensors`` for LoRA, loadable
    with ``peft.PeftModel.from_pretrained(base_model, dirpath)``.
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_sloth.plugins.sharding import full_state_dict
        from lightning_sloth.plugins.strategy import find_hf_model

        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "save_pretrained"):
            model = find_hf_model(pl_module)
        # Sharded (FSDP2) weights are gathered on rank 0 first: a collective on every rank.
        state_dict = full_state_dict(model)
        if trainer.is_global_zero:
            model.save_pretrained(str(self.dirpath), state_dict=state_dict)
            log.info("saved adapter to %s", self.dirpath)
