"""Callbacks that observe and guard a run: throughput on real tokens, gradient flow (steps with
non-finite gradients skipped), out-of-memory advice, memory-plan headroom, adapter export."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only

from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.moe import ENDS_ATTR, counts_from_ends
from lightning_sloth.offload import ActivationOffloader
from lightning_sloth.plugins.local_shards import sharded_grad_norm
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
    peak rate is known. The last logged figures are in :attr:`latest` (for the progress lines) and
    the whole run's in :meth:`summary` (for the end summary).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=_documents, length_fn=_real_tokens, **kwargs)
        self.latest: dict[str, float] = {}
        self._tokens = 0
        self._flops = 0.0
        self._elapsed = 0.0

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self.latest, self._tokens, self._flops, self._elapsed = {}, 0, 0.0, 0.0

    def _update(self, trainer: Trainer, pl_module: LightningModule, batch: Any, iter_num: int) -> None:
        super()._update(trainer, pl_module, batch, iter_num)
        stage = trainer.state.stage
        if stage is None or stage.value != "train":
            return
        # The same clock as the window (validation time taken out by the parent class).
        self._elapsed = time.perf_counter() - self._t0s[stage]
        self._tokens += _real_tokens(batch)
        self._flops += getattr(pl_module, "flops_per_batch", None) or 0.0

    def _compute(self, trainer: Trainer, iter_num: int | None = None) -> None:
        super()._compute(trainer, iter_num)
        stage = trainer.state.stage
        if stage is not None and stage.value == "train" and trainer._logger_connector.should_update_logs:
            metrics = self._throughputs[stage].compute()
            self.latest = {k: float(v) for k, v in metrics.items()}

    @property
    def tokens_per_sec(self) -> float | None:
        """Real tokens per second of the last logged window, or of the run so far until a window
        is full (``None`` before the first step)."""
        return self.latest.get("device/items_per_sec", self.summary()["real_tokens_per_s"])

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation, over the same span as :attr:`tokens_per_sec` (``None`` where
        the device's peak is unknown)."""
        return self.latest.get("device/mfu", self.summary()["mfu"])

    def summary(self) -> dict[str, float | None]:
        """The run's training steps as a whole (validation excluded): ``real_tokens_per_s``,
        ``model_tflops_per_s`` and ``mfu`` (``None`` where unknown)."""
        if self._elapsed <= 0:
            return {"real_tokens_per_s": None, "model_tflops_per_s": None, "mfu": None}
        flops = self._flops / self._elapsed if self._flops else None
        return {
            "real_tokens_per_s": self._tokens / self._elapsed,
            "model_tflops_per_s": None if flops is None else flops / 1e12,
            "mfu": flops / self.available_flops if flops and self.available_flops else None,
        }


class GradientFlowError(RuntimeError):
    """Raised when no usable gradient reaches the trainable parameters."""


class NonFiniteStepError(GradientFlowError):
    """Raised when too many consecutive steps had a non-finite loss or gradients."""


def describe_documents(batch: Any, tokenizer: Any = None, limit: int = 8, chars: int = 48) -> str:
    """The documents of a packed batch, one per line: index, tokens, and their start as text.

    Reads the batch back to the host (only for error messages). ``tokenizer`` decodes the ids;
    without one the first ids are shown.
    """
    ids = batch.input_ids[0].detach().cpu().tolist()
    bounds = batch.cu_seqlens.detach().cpu().tolist()
    lines = []
    segments = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a and a < batch.num_tokens]
    for i, (start, end) in enumerate(segments[:limit]):
        tokens = ids[start:end]
        if tokenizer is not None:
            text = tokenizer.decode(tokens[:chars])[:chars]
        else:
            text = " ".join(map(str, tokens[:12]))
        lines.append(f"  document {i}: {end - start} tokens, {text!r}")
    if len(segments) > limit:
        lines.append(f"  ... and {len(segments) - limit} more")
    return "\n".join(lines)


class GradientFlowGuard(Callback):
    """Skips steps whose gradients are not finite; stops a run whose gradients are all zero.

    Every step (with ``max_nonfinite_steps`` set) the norm of the trainable gradients is read
    back to the host (one scalar). A NaN or infinite norm (a non-finite loss makes one) skips
    the step: the gradients are dropped before the optimizer runs, so it updates no parameter
    and no state (AdamW leaves parameters without a gradient alone), and the learning-rate
    schedulers' step of this batch is undone; ``train/skipped_steps`` counts the skips and a
    warning names the batch's documents. After ``max_nonfinite_steps`` consecutive skips the
    next one raises :class:`NonFiniteStepError` naming the step and the batch's documents; no
    checkpoint was written with those gradients. Under fp16's loss scaler the scaler skips such
    steps itself (lowering its scale), and the guard leaves them to it.

    Every ``every_n_steps`` optimizer steps (and always on the first, where a broken setup
    shows) it also checks that the gradients are not all zero. The error names the step and the
    problem; resume from the last checkpoint after fixing it.

    Args:
        every_n_steps: cadence of the all-zero check (and of the ``train/grad_norm`` log).
        max_nonfinite_steps: consecutive non-finite steps skipped before the run stops (0: stop
            at the first); ``None``: no per-step check, a non-finite norm found by the periodic
            check stops the run.
        tokenizer: decodes the documents the messages name (default: the data module's).
    """

    def __init__(
        self, every_n_steps: int = 50, max_nonfinite_steps: int | None = 3, tokenizer: Any = None
    ) -> None:
        if every_n_steps <= 0:
            raise ValueError(f"GradientFlowGuard every_n_steps must be positive, got {every_n_steps}")
        if max_nonfinite_steps is not None and max_nonfinite_steps < 0:
            raise ValueError(f"max_nonfinite_steps must be >= 0 or None, got {max_nonfinite_steps}")
        self.every_n_steps = every_n_steps
        self.max_nonfinite_steps = max_nonfinite_steps
        self.tokenizer = tokenizer
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._batch: Any = None
        self._undo: list[tuple[Any, dict, list[float]]] | None = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch = batch

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        step = trainer.global_step
        periodic = step % self.every_n_steps == 0
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        per_step = self.max_nonfinite_steps is not None and not scaled
        if not (periodic or per_step):
            return
        grads = [p.grad for p in pl_module.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            raise GradientFlowError(f"step {step}: no trainable parameter received a gradient")
        norm = sharded_grad_norm(grads)  # FSDP2: from the local shards, one all_reduce
        if norm is None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            if hasattr(norm, "full_tensor"):  # other DTensor layouts: a DTensor norm, reduced over ranks
                norm = norm.full_tensor()
        norm = float(norm)
        if not math.isfinite(norm):
            if not per_step:
                raise GradientFlowError(
                    f"step {step}: trainable gradient norm is {norm} (non-finite gradients)"
                )
            self._skip(trainer, pl_module, optimizer, norm)
            return
        self.consecutive_skips = 0
        if self.max_nonfinite_steps is not None:
            pl_module.log("train/skipped_steps", float(self.skipped_steps), batch_size=1)
        if not periodic:
            return
        self.last_grad_norm = norm
        if norm == 0.0:
            raise GradientFlowError(
                f"step {step}: all {len(grads)} trainable gradients are zero "
                "(frozen path, detached loss or fully masked labels?)"
            )
        pl_module.log("train/grad_norm", norm, batch_size=1)

    def _skip(self, trainer: Trainer, pl_module: LightningModule, optimizer, norm: float) -> None:
        step = trainer.global_step
        tokenizer = self.tokenizer or getattr(trainer.datamodule, "tokenizer", None)
        documents = describe_documents(self._batch, tokenizer) if hasattr(self._batch, "cu_seqlens") else ""
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_nonfinite_steps:
            raise NonFiniteStepError(
                f"step {step}: the loss or gradients were not finite (norm {norm}) for "
                f"{self.consecutive_skips} steps in a row (max_nonfinite_steps={self.max_nonfinite_steps}); "
                f"stopping. No checkpoint was written with these gradients. This batch's documents:\n"
                f"{documents}\nCheck these records, the learning rate and the precision."
            )
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)  # the optimizer then updates nothing
        self._undo = [
            (
                config.scheduler,
                config.scheduler.state_dict(),
                [g["lr"] for g in config.scheduler.optimizer.param_groups],
            )
            for config in trainer.lr_scheduler_configs
            if config.interval == "step"
        ]
        log.warning(
            "step %d: non-finite loss or gradients (norm %s); step skipped (%d in a row, %d in all). "
            "The batch's documents:\n%s",
            step,
            norm,
            self.consecutive_skips,
            self.skipped_steps,
            documents,
        )
        pl_module.log("train/skipped_steps", float(self.skipped_steps), batch_size=1)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch = None
        if self._undo is None:
            return
        for scheduler, state, lrs in self._undo:  # the schedulers stepped after the skipped step
            scheduler.load_state_dict(state)
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
        self._undo = None


class StepOutOfMemoryError(RuntimeError):
    """A training step ran out of device memory; the message says what the step held and what fits."""


#: What to change when a step does not fit, spelled for the Python API (the app passes its own).
OUT_OF_MEMORY_HINTS = (
    'SlothStrategy(offload="on"): checkpointed layer inputs to pinned host memory',
    'SlothStrategy(memory_budget="auto" or a byte count): keep, recompute or offload each layer to fit',
    "PackedDataModule(max_tokens=...): fewer tokens per step",
    'SlothPrecision(..., quantize="nf4"): the frozen base weights in 4 bits (QLoRA)',
)


class OutOfMemoryAdvice(Callback):
    """Explains a CUDA out-of-memory error in a training step: what the step held and what would fit.

    It remembers the current batch's sizes (host integers, no device work; training and
    validation) and, when a step raises ``torch.OutOfMemoryError``, builds :attr:`message`: the
    step, its real tokens, row
    length, documents and longest document, the peak allocated device memory and the device's
    total, and ``hints``. Lightning then re-raises the error (callers such as the app raise
    :class:`StepOutOfMemoryError` with the message); nothing is saved, so the last checkpoint is
    the one before the step.

    Args:
        hints: the settings that would make the step fit, most effective first.
    """

    def __init__(self, hints: tuple[str, ...] | list[str] = OUT_OF_MEMORY_HINTS) -> None:
        self.hints = list(hints)
        self.message: str | None = None
        self._step: dict[str, int] | None = None

    def _remember(self, batch: Any) -> None:
        self._step = None
        if hasattr(batch, "cu_seqlens"):
            self._step = {
                "tokens": batch.num_tokens,
                "capacity": batch.capacity,
                "documents": batch.num_documents,
                "longest": batch.max_seqlen,
            }

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._remember(batch)

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._remember(batch)

    def describe(self, trainer: Trainer) -> str:
        """The message for an out-of-memory error in the current step."""
        device = trainer.strategy.root_device
        where = "validation after " if trainer.validating or trainer.sanity_checking else ""
        step = self._step
        held = (
            f"{step['tokens']} real tokens in a {step['capacity']}-token row, {step['documents']} "
            f"documents, the longest {step['longest']} tokens"
            if step
            else "its batch"
        )
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            total = torch.cuda.get_device_properties(device).total_memory / 2**30
            memory = f"peak allocated {peak:.2f} GiB of the device's {total:.2f} GiB"
        else:
            memory = f"on {device.type}"
        hints = "".join(f"\n  - {hint}" for hint in self.hints)
        return (
            f"out of memory in {where}training step {trainer.global_step} ({held}); {memory}. "
            f"Settings that make it fit:{hints}"
        )

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, torch.OutOfMemoryError):
            self.message = self.describe(trainer)
            log.error("%s", self.message)


class LongestStepHeadroom(Callback):
    """``memory_budget="auto"`` plans for the longest step the data can make, not the first one.

    The layer plan (keep, recompute or offload each layer) is made from the activations measured
    in the first training step. A later step with more tokens needs more: once the plan is
    measured, it is made again for a budget scaled by ``first step's row / longest row`` (the
    longest row is ``max_tokens``, the packing budget every bin fits in).

    Args:
        max_tokens: the longest row (default: the data module's ``max_tokens``).
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.done = False

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.done:
            return
        layers = getattr(getattr(trainer.strategy, "sloth_report", None), "checkpointing", None)
        if layers is None or layers.memory_budget != "auto" or not hasattr(batch, "capacity"):
            self.done = True
            return
        if layers.activation_bytes is None:  # not measured yet
            return
        self.done = True
        longest = self.max_tokens or getattr(trainer.datamodule, "max_tokens", None)
        if layers.budget_bytes is None or not longest or batch.capacity >= longest:
            return
        budget = int(layers.budget_bytes * batch.capacity / longest)
        log.info(
            "memory plan for the longest step (%d tokens; the first had %d): budget %d bytes",
            longest,
            batch.capacity,
            budget,
        )
        layers.replan(budget)


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

    Reads the per-expert row ends that the "sloth" experts (``lightning_sloth.moe``) leave on each
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
        return [
            counts_from_ends(e) for m in module.modules() if (e := getattr(m, ENDS_ATTR, None)) is not None
        ]

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
