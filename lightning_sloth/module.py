"""``CausalLMModule``: a ready LightningModule around a transformers causal LM, LoRA (PEFT) or full.

The plugins do not need it: ``SlothStrategy`` works with any LightningModule that holds a
transformers ``PreTrainedModel``. It is the module the Hydra app trains, and a short way to
fine-tune from a plain ``Trainer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_sloth.attention import attention_width
from lightning_sloth.data.batch import IGNORE_INDEX, PackedBatch
from lightning_sloth.patching import takes_target_count
from lightning_sloth.token_loss import GlobalTokenLoss

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSettings:
    """LoRA adapter settings, passed to ``peft.LoraConfig``.

    ``target_parameters`` adapts fused 3-D parameters such as MoE experts
    (``("experts.gate_up_proj", "experts.down_proj")``).
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Sequence[str] = LLAMA_PROJECTIONS
    target_parameters: Sequence[str] = ()
    modules_to_save: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got r={self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules and not self.target_parameters:
            raise ValueError("LoRA needs at least one of target_modules or target_parameters")

    def to_peft(self):
        """Build the ``peft.LoraConfig``."""
        from peft import LoraConfig

        kwargs = dict(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules) or None,
            modules_to_save=list(self.modules_to_save) or None,
            task_type="CAUSAL_LM",
        )
        if self.target_parameters:
            kwargs["target_parameters"] = list(self.target_parameters)
        return LoraConfig(**kwargs)


@dataclass
class OptimizerSettings:
    """AdamW with linear warm-up then a cosine (or constant) schedule, stepped per optimizer step."""

    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = field(default=(0.9, 0.999))
    warmup_steps: int = 0
    scheduler: str = "cosine"
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer lr must be positive, got {self.lr}")
        if self.scheduler not in ("cosine", "constant"):
            raise ValueError(f"optimizer scheduler must be 'cosine' or 'constant', got {self.scheduler!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer warmup_steps must be >= 0, got {self.warmup_steps}")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based) of ``total_steps``."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.scheduler == "constant":
            return 1.0
        span = max(total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def flop_parameters(model: nn.Module) -> int:
    """Parameters that cost matmul FLOPs per token: all but the input embedding, lm_head included.

    A 4-bit weight (``uint8`` codes, two per byte) counts two parameters per byte; a module whose
    ``uint8`` weights hold another number of values per byte says so in a ``codes_per_byte``
    attribute (an FP8 layer: one).
    """
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total, seen = 0, {id(embedding)}
    for module in model.modules():
        per_byte = getattr(module, "codes_per_byte", 2)
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel() * (per_byte if p.dtype == torch.uint8 else 1)
    return total + (head.numel() if head is embedding else 0)


def shifted_targets(labels: Tensor) -> Tensor:
    """Targets aligned with logits: ``targets[..., t] = labels[..., t + 1]``, last position ignored."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def document_exact_match(preds: Tensor, targets: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per document of a packed row, whether every target token is predicted right.

    Teacher-forced, so a document scores 1 exactly when greedy decoding of its response would
    reproduce it. Documents without targets (padding) are left out.

    Args:
        preds: ``[T]`` argmax predictions aligned with ``targets``.
        targets: ``[T]`` shifted targets, ``-100`` where there is no loss.
        cu_seqlens: ``[n + 1]`` int32 document boundaries.

    Returns:
        float tensor ``[m]`` of 0/1, one per document that has at least one target.
    """
    num_docs = cu_seqlens.numel() - 1
    positions = torch.arange(targets.numel(), device=targets.device)
    doc = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)
    has_target = targets != IGNORE_INDEX
    # float32 explicitly: under a half-precision default dtype (``bf16-true``) zeros() would be bf16.
    counts = dict(dtype=torch.float32, device=targets.device)
    wrong = (has_target & (preds != targets)).float()
    wrong_per_doc = torch.zeros(num_docs, **counts).index_add_(0, doc, wrong)
    targets_per_doc = torch.zeros(num_docs, **counts).index_add_(0, doc, has_target.float())
    return (wrong_per_doc[targets_per_doc > 0] == 0).float()


def use_fused_adamw(
    device: torch.device, params: Sequence[Tensor], *, loss_scaled: bool, clipped: bool
) -> bool:
    """Whether AdamW can take its fused CUDA kernel: CUDA, fp32/bf16 parameters, and not fp16 loss
    scaling together with gradient clipping (a fused step unscales inside itself, after the clip)."""
    return (
        device.type == "cuda"
        and all(p.dtype in (torch.float32, torch.bfloat16) for p in params)
        and not (loss_scaled and clipped)
    )


class CausalLMModule(LightningModule):
    """Fine-tunes a transformers causal LM on :class:`PackedBatch` batches.

    Args:
        model: a ``PreTrainedModel``, or a zero-argument callable building one (then it is built
            in ``configure_model``, which suits sharded strategies).
        lora: LoRA settings; ``None`` trains all parameters (full fine-tuning).
        optimizer: optimizer and schedule settings.

    Logs ``train/loss``, ``val/loss`` (token-weighted), ``val/token_acc`` (next-token accuracy on
    target tokens) and ``val/exact_match`` (documents whose whole response is right).
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        lora: LoraSettings | None = None,
        optimizer: OptimizerSettings | None = None,
    ) -> None:
        super().__init__()
        self.lora = lora if lora is not None else None
        self.optim = optimizer or OptimizerSettings()
        self.save_hyperparameters(
            {"lora": asdict(self.lora) if self.lora else None, "optimizer": asdict(self.optim)}
        )
        self._model_factory: Callable[[], nn.Module] | None = None
        self.model: nn.Module | None = None
        if isinstance(model, nn.Module):
            self.model = self._wrap(model)
        elif callable(model):
            self._model_factory = model
        else:
            raise TypeError(
                f"model must be an nn.Module or a callable returning one, got {type(model).__name__}"
            )
        self.val_loss = MeanMetric()
        self.val_exact_match = MeanMetric()
        self.val_token_acc: MulticlassAccuracy | None = None
        self.flops_per_batch: int | None = None
        self.token_loss = GlobalTokenLoss()
        if self.model is not None:
            self._init_metrics()

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.lora is None:
            return model
        from peft import get_peft_model

        return get_peft_model(model, self.lora.to_peft())

    def _init_metrics(self) -> None:
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.val_token_acc = MulticlassAccuracy(num_classes=vocab, ignore_index=IGNORE_INDEX, average="micro")

    def configure_model(self) -> None:
        if self.model is None and self._model_factory is not None:
            self.model = self._wrap(self._model_factory())
            self._init_metrics()

    def forward(self, batch: PackedBatch) -> Tensor:
        """Logits ``[1, T, vocab]`` of a packed batch."""
        return self.model(**batch.model_inputs()).logits

    def training_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:
        inputs = batch.model_inputs()
        if self._fused_loss():  # logits only for the rows that carry a target
            inputs["num_target_tokens"] = batch.num_target_tokens
        out = self.model(**inputs, labels=batch.labels)
        self.flops_per_batch = self._estimate_flops(batch)
        self.log("train/loss", out.loss, prog_bar=True, batch_size=batch.num_target_tokens)
        self.log("train/packing_efficiency", batch.efficiency, batch_size=1)
        if self._global_token_loss:
            return self.token_loss.loss(out.loss, batch.num_target_tokens)
        return out.loss

    def _fused_loss(self) -> bool:
        """Whether the model's loss is lightning_sloth's fused one (decided once per model object;
        kept by id in the instance dict, so no module attribute or state-dict entry comes of it)."""
        model = self.model
        cached = self.__dict__.get("_fused_loss_cache")
        if cached is None or cached[0] != id(model):
            cached = self.__dict__["_fused_loss_cache"] = (id(model), takes_target_count(model))
        return cached[1]

    @property
    def _global_token_loss(self) -> bool:
        """Whether the strategy asks for the loss normalised by the step's global target tokens."""
        return self._trainer is not None and getattr(self.trainer.strategy, "global_token_loss", False)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if self._global_token_loss and optimizer_closure is not None:
            closure = optimizer_closure

            def optimizer_closure():
                # After the step's last backward, before clipping and the optimizer step.
                result = closure()
                self.token_loss.rescale_gradients(
                    self.parameters(), self.trainer.world_size, self.trainer.accumulate_grad_batches
                )
                return result

        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        logits = self(batch)[0].float()
        targets = shifted_targets(batch.labels)[0]
        mask = targets != IGNORE_INDEX
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        count = mask.sum()
        self.val_loss.update(loss / count.clamp(min=1), weight=count)
        preds = logits.argmax(dim=-1)
        self.val_token_acc.update(preds, targets)
        exact = document_exact_match(preds, targets, batch.cu_seqlens)
        if exact.numel():
            self.val_exact_match.update(exact)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/token_acc", self.val_token_acc, prog_bar=True)
        self.log("val/exact_match", self.val_exact_match)

    def _estimate_flops(self, batch: PackedBatch) -> int:
        """Model FLOPs of one step: ``6·N·tokens`` plus causal attention (PaLM convention).

        ``N`` counts all parameters except the input embedding (:func:`flop_parameters`); attention adds
        ``6 · width · Σ len²`` for causal documents (half of the full ``12·…``), ``width`` summing
        heads × head dim over the softmax-attention layers (:func:`~lightning_sloth.attention.attention_width`:
        per-layer head dims, linear-attention layers none).
        """
        if not hasattr(self, "_flop_params"):
            self._flop_params = flop_parameters(self.model)
        if not hasattr(self, "_attention_width"):
            self._attention_width = attention_width(self.model.config)
        return 6 * self._flop_params * batch.num_tokens + 6 * self._attention_width * batch.sum_sq_seqlens

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("CausalLMModule has no trainable parameters (check the LoRA target modules)")
        fused = use_fused_adamw(
            self.device,
            params,
            loss_scaled=getattr(self.trainer.precision_plugin, "scaler", None) is not None,
            clipped=bool(self.trainer.gradient_clip_val),
        )
        optimizer = torch.optim.AdamW(
            params,
            lr=self.optim.lr,
            weight_decay=self.optim.weight_decay,
            betas=tuple(self.optim.betas),
            fused=fused,
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: self.optim.lr_factor(step, total)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def save_adapter(self, path: str) -> None:
        """Save the LoRA adapter in PEFT's format (or the full model for full fine-tuning)."""
        self.model.save_pretrained(path)
