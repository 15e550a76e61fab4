"""Callbacks that observe and guard a run: throughput on real tokens, gradient flow, adapter export."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only

from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.moe import COUNTS_ATTR
from lightning_sloth.offload import ActivationOffloader
from lightning_sloth.plugins.sharding import full_state_dict

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
        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "save_pretrained"):
            model = find_hf_model(pl_module)
        # Sharded (FSDP2) weights are gathered on rank 0 first: a collective on every rank.
        state_dict = full_state_dict(model)
        if trainer.is_global_zero:
            model.save_pretrained(str(self.dirpath), state_dict=state_dict)
            log.info("saved adapter to %s", self.dirpath)


class ExpertLoadMonitor(Callback):
    """Logs how evenly each MoE layer's router spreads tokens over its experts.

    Reads the per-expert row counts that the "sloth" experts (``lightning_sloth.moe``) leave on each
    experts module at every forward (a device tensor; nothing is read back except when logging).
    Every ``every_n_steps`` training steps it logs, per MoE layer ``i``, the scalar
    ``moe/load_max_over_mean/layer_i`` (1.0 is perfectly balanced; ``E / k`` means all tokens went to
    the same ``k`` experts) and their mean ``moe/load_max_over_mean``; with a TensorBoard logger also
    the histogram ``moe/expert_load/layer_i`` of the tokens per expert. Models without such experts
    log nothing.

    Args:
        every_n_steps: logging cadence in training steps.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps

    @staticmethod
    def expert_counts(module: torch.nn.Module) -> list[torch.Tensor]:
        """The last forward's rows per expert of every MoE layer under ``module``, in layer order."""
        return [c for m in module.modules() if (c := getattr(m, COUNTS_ATTR, None)) is not None]

    @staticmethod
    def load_ratios(counts: list[torch.Tensor]) -> torch.Tensor:
        """``max / mean`` tokens per expert of each layer, float32 ``[layers]`` (on the counts' device)."""
        loads = torch.stack([c.float() for c in counts])
        return loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        counts = self.expert_counts(pl_module)
        if not counts:
            return
        ratios = self.load_ratios(counts).cpu()
        for i, ratio in enumerate(ratios.tolist()):
            pl_module.log(f"moe/load_max_over_mean/layer_{i}", ratio, on_step=True, on_epoch=False)
        pl_module.log("moe/load_max_over_mean", float(ratios.mean()), on_step=True, on_epoch=False)
        self._histograms(trainer, counts)

    @rank_zero_only
    def _histograms(self, trainer: Trainer, counts: list[torch.Tensor]) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                for i, c in enumerate(counts):
                    # one sample per token routed, valued by its expert id: the histogram is the load
                    ids = torch.repeat_interleave(torch.arange(c.numel()), c.cpu().long())
                    logger.experiment.add_histogram(
                        f"moe/expert_load/layer_{i}", ids, trainer.global_step, bins=c.numel()
                    )


class OffloadStatsCallback(Callback):
    """Logs :meth:`ActivationOffloader.stats` as ``offload/<key>`` every ``log_every_n_steps``.

    Args:
        offloader: the offloader to watch (default: ``trainer.strategy.offloader``).
    """

    def __init__(self, offloader: ActivationOffloader | None = None) -> None:
        self.offloader = offloader
        self._logged_step = -1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        offloader = self.offloader or getattr(trainer.strategy, "offloader", None)
        step = trainer.global_step
        if (
            offloader is None
            or not offloader.enabled
            or step % trainer.log_every_n_steps
            or step == self._logged_step
        ):
            return
        self._logged_step = step  # once per optimizer step, however many micro-batches it took
        stats = offloader.stats(reset=True)
        pl_module.log_dict({f"offload/{k}": v for k, v in stats.items()}, on_step=True, batch_size=1)
