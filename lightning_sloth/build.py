"""Builders from a composed :class:`~lightning_sloth.config.TrainConfig` to the objects of a run.

Each function takes the config node it needs and returns one thing; none reads Hydra's global
state, so they serve scripts and tests as well as the app. Heavy libraries are imported inside
the functions: composing and validating a config stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lightning_sloth.config import (
    ConfigError,
    HFDatasetDataConfig,
    JsonlDataConfig,
    KernelOpsConfig,
    PretrainedModelConfig,
    ProgressMode,
    RandomModelConfig,
    Sharding,
    Switch,
    SyntheticDataConfig,
)
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.module import CausalLMModule, LoraSettings, OptimizerSettings
from lightning_sloth.plugins import (
    ExpertLoadMonitor,
    GradientFlowGuard,
    OffloadStatsCallback,
    SaveAdapter,
    SlothDDPStrategy,
    SlothFSDPStrategy,
    SlothPrecision,
    SlothStrategy,
    SlothThroughputMonitor,
)
from lightning_sloth.plugins.callbacks import LongestStepHeadroom, OutOfMemoryAdvice
from lightning_sloth.plugins.checkpoint import (
    AtomicCheckpointIO,
    FinalCheckpoint,
    PreemptionCheckpoint,
    StepRandomState,
    verify_checkpoint,
)
from lightning_sloth.plugins.progress import ProgressLines, StepProgressBar, interactive
from lightning_sloth.plugins.samples import SampleGenerations
from lightning_sloth.quant.loading import RandomWeights

if TYPE_CHECKING:
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import Strategy
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
_DEFAULT_KERNEL_OPS = vars(KernelOpsConfig())  # ``kernels=True`` means exactly these
ADAPTER_DIR = "adapter"
SAMPLES_FILE = "samples.jsonl"


def build_tokenizer(model: DictConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer: the built-in character tokenizer for ``model.tokenizer: char``, else
    ``AutoTokenizer.from_pretrained(model.tokenizer)``."""
    if model.tokenizer == "char":
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {}
    if OmegaConf.get_type(model) is PretrainedModelConfig:
        kwargs = {"revision": model.revision, "trust_remote_code": model.trust_remote_code}
    return AutoTokenizer.from_pretrained(model.tokenizer, **kwargs)


def build_model_config(model: DictConfig, vocab_size: int):
    """The transformers ``PretrainedConfig`` of a ``RandomModelConfig`` node.

    Args:
        model: a ``model`` node of type :class:`RandomModelConfig`.
        vocab_size: the tokenizer's number of ids; the embedding gets ``model.vocab_size`` rows
            when set (it must cover the tokenizer), else exactly this many.
    """
    from transformers import AutoConfig

    if model.vocab_size is not None and model.vocab_size < vocab_size:
        raise ConfigError(
            f"invalid configuration:\n  model.vocab_size: {model.vocab_size} is smaller than the "
            f"tokenizer's {vocab_size} ids"
        )
    kwargs: dict[str, Any] = {
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "vocab_size": model.vocab_size or vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
    }
    if model.head_dim is not None:
        kwargs["head_dim"] = model.head_dim
    if model.rope_theta is not None:
        kwargs["rope_theta"] = model.rope_theta
    kwargs.update(OmegaConf.to_container(model.extra, resolve=True))
    return AutoConfig.for_model(model.model_type, **kwargs)


def build_model(model: DictConfig, tokenizer: PreTrainedTokenizerBase, meta: bool = False) -> PreTrainedModel:
    """The transformers causal LM: random weights from a config, or ``from_pretrained``.

    Special token ids (pad, bos, eos) are taken from the tokenizer for a random model. ``meta``
    (a random model under FSDP, :func:`builds_per_shard`): built on the meta device, its shards
    made on each rank by the strategy.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kind = OmegaConf.get_type(model)
    if kind is RandomModelConfig:
        config = build_model_config(model, len(tokenizer))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            setattr(config, name, getattr(tokenizer, name))
        with torch.device("meta") if meta else contextlib.nullcontext():
            return AutoModelForCausalLM.from_config(config)
    if kind is PretrainedModelConfig:
        dtype = model.dtype.value
        loaded = AutoModelForCausalLM.from_pretrained(
            model.name_or_path,
            revision=model.revision,
            dtype=dtype if dtype == "auto" else getattr(torch, dtype),
            trust_remote_code=model.trust_remote_code,
        )
        # from_pretrained returns eval mode; transformers checkpoints layers only in training mode.
        return loaded.train()
    raise TypeError(f"model config of type {kind.__name__} has no builder")


def build_data_sources(data: DictConfig) -> tuple[Any, Any]:
    """``(train, val)`` record sources for ``PackedDataModule``; ``val`` is ``None`` without validation."""
    kind = OmegaConf.get_type(data)
    if kind is SyntheticDataConfig:
        train, val = SyntheticTask.splits(
            data.num_train, data.num_val, seed=data.seed, tasks=list(data.tasks)
        )
        return train, (val if data.num_val else None)
    if kind is JsonlDataConfig:
        return data.train_path, data.val_path
    if kind is HFDatasetDataConfig:
        try:
            import datasets
        except ImportError as error:
            raise ImportError(
                "data=hf_dataset needs the optional `datasets` package: pip install datasets"
            ) from error

        def load(split: str | None):
            return None if split is None else datasets.load_dataset(data.path, data.name, split=split)

        return load(data.train_split), load(data.val_split)
    raise TypeError(f"data config of type {kind.__name__} has no builder")


def build_datamodule(
    data: DictConfig, tokenizer: PreTrainedTokenizerBase, static_shapes: bool = False
) -> PackedDataModule:
    """The ``PackedDataModule`` of the ``data`` node (nothing is tokenized until ``setup``).

    ``static_shapes`` (set by ``sloth.cuda_graphs``): every row padded to ``max_tokens`` and
    ``cu_seqlens`` to a power-of-two length, so the layers' CUDA graphs see few shapes."""
    train, val = build_data_sources(data)
    return PackedDataModule(
        tokenizer,
        train,
        val,
        max_tokens=data.max_tokens,
        overlong=data.overlong.value,
        on_bad_record=data.on_bad_record.value,
        num_workers=data.num_workers,
        seed=data.seed,
        pad_to_multiple_of=data.pad_to_multiple_of,
        shuffle=data.shuffle,
        pad_to="max_tokens" if static_shapes else "multiple",
        segments_bucket="pow2" if static_shapes else "exact",
    )


def build_lora_settings(lora: DictConfig) -> LoraSettings | None:
    """``LoraSettings`` of the ``lora`` node; ``None`` (full fine-tuning) when ``lora.enabled`` is false."""
    if not lora.enabled:
        return None
    return LoraSettings(
        r=lora.r,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
        target_parameters=tuple(lora.target_parameters),
        modules_to_save=tuple(lora.modules_to_save),
    )


def build_optimizer_settings(optimizer: DictConfig) -> OptimizerSettings:
    """``OptimizerSettings`` of the ``optimizer`` node."""
    return OptimizerSettings(
        lr=optimizer.lr,
        weight_decay=optimizer.weight_decay,
        betas=tuple(optimizer.betas),
        warmup_steps=optimizer.warmup_steps,
        scheduler=optimizer.scheduler.value,
        min_lr_ratio=optimizer.min_lr_ratio,
    )


def build_module(cfg: DictConfig, model: PreTrainedModel) -> CausalLMModule:
    """``CausalLMModule`` around ``model`` with the run's LoRA and optimizer settings."""
    return CausalLMModule(
        model, lora=build_lora_settings(cfg.lora), optimizer=build_optimizer_settings(cfg.optimizer)
    )


def build_precision(precision: DictConfig) -> SlothPrecision:
    """``SlothPrecision`` of the ``precision`` node (``auto`` resolves on this machine)."""
    fp8 = {
        key: precision[key]
        for key, default in (
            ("base_dtype", None),
            ("fp8_grad", "e4m3"),
            ("fp8_training", False),
            ("fp8_fast_accum", True),
            ("fp8_experts", None),
        )
        if precision.get(key, default) != default
    }
    quantize = precision.get("quantize")
    if quantize is None and not fp8:
        return SlothPrecision(precision.precision.value)
    if fp8.get("base_dtype") == "fp8" and precision.get("fp8_skip") is not None:
        fp8["fp8_skip"] = list(precision.fp8_skip)
    return SlothPrecision(
        precision.precision.value, quantize=quantize, quantize_skip=list(precision.quantize_skip), **fp8
    )


def num_processes(trainer: DictConfig) -> int:
    """Processes the run will use: ``trainer.devices`` (``-1``: every visible GPU) times ``num_nodes``."""
    devices = trainer.devices
    if devices == -1:
        import torch

        devices = max(torch.cuda.device_count(), 1) if trainer.accelerator != "cpu" else 1
    return devices * trainer.num_nodes


def ddp_start_method(multirun: bool) -> str:
    """How the DDP strategy starts its processes.

    Lightning's default (``"popen"``) re-runs ``sys.argv`` in every extra process; Lightning
    points the copies at the job's ``hydra.run.dir``, which works for a single run. Under
    ``-m`` the re-run command is the whole sweep (every process would start every job) and a
    job's output dir is not ``hydra.run.dir``, so multirun jobs start their processes with
    ``"spawn"`` instead: the workers are forked from the job itself, unpickling the Trainer's
    model, data and callbacks, and never re-read the command line.
    """
    return "spawn" if multirun else "popen"


def sloth_settings(sloth: DictConfig) -> dict[str, Any]:
    """Keyword arguments of ``SlothStrategy`` / ``SlothDDPStrategy`` from the ``sloth`` node.

    ``kernels: auto`` turns the Triton kernels on where CUDA is available; ``kernel_ops`` with an op
    switched off, and ``compile_options`` when not empty, are passed instead of ``True``.
    """
    import torch

    kernels = sloth.kernels is Switch.on or (sloth.kernels is Switch.auto and torch.cuda.is_available())
    kernel_ops = OmegaConf.to_container(sloth.kernel_ops, resolve=True)
    compile_options = OmegaConf.to_container(sloth.compile_options, resolve=True)
    budget = sloth.memory_budget
    return {
        "packed_attention": sloth.packed_attention,
        "gradient_checkpointing": sloth.gradient_checkpointing,
        "kernels": (True if kernel_ops == _DEFAULT_KERNEL_OPS else kernel_ops) if kernels else None,
        "offload": sloth.offload.value,
        "memory_budget": int(budget) if budget is not None and budget != "auto" else budget,
        "compile": (compile_options or True) if sloth.compile else False,
        "moe": sloth.moe,
        "checkpoint_impl": sloth.checkpoint_impl,
        "cuda_graphs": sloth.cuda_graphs,
        "mlp_chunk_tokens": _chunk_tokens(sloth.get("mlp_chunk_tokens", "auto")),
    }


def _chunk_tokens(value: str | None) -> int | str | None:
    return int(value) if value is not None and value != "auto" else value


def builds_per_shard(cfg: DictConfig) -> bool:
    """Whether the run's model is built on the meta device and made shard by shard on each rank:
    a random-weight model under ``trainer.sharding: fsdp`` (no rank ever holds the whole model)."""
    return cfg.trainer.sharding is Sharding.fsdp and OmegaConf.get_type(cfg.model) is RandomModelConfig


def build_strategy(
    sloth: DictConfig, trainer: DictConfig, multirun: bool = False, meta_weights: Any = None
) -> Strategy:
    """``SlothStrategy`` for one process, else ``SlothDDPStrategy`` (or ``SlothFSDPStrategy`` with
    ``trainer.sharding: fsdp``) started per :func:`ddp_start_method`.

    Args:
        sloth: the ``sloth`` node (the model transformations).
        trainer: the ``trainer`` node (``devices``, ``num_nodes``, ``accelerator``).
        multirun: the job runs under Hydra's ``-m`` (``HydraConfig.get().mode == MULTIRUN``).
        meta_weights: where a meta-device model's shards come from (``SlothFSDPStrategy``).
    """
    settings = sloth_settings(sloth)
    if trainer.sharding is Sharding.fsdp:
        # One process is refused by the strategy itself, with a message saying what to use.
        return SlothFSDPStrategy(
            start_method=ddp_start_method(multirun),
            reshard_after_forward=trainer.fsdp_reshard_after_forward,
            cpu_offload=trainer.fsdp_cpu_offload,
            layers_per_unit=trainer.fsdp_layers_per_unit,
            shard_frozen=trainer.fsdp_shard_frozen,
            meta_weights=meta_weights,
            **settings,
        )
    if num_processes(trainer) == 1:
        return SlothStrategy(**settings)
    return SlothDDPStrategy(start_method=ddp_start_method(multirun), **settings)


def build_loggers(output_dir: str | Path) -> list[Logger]:
    """CSV (``<output_dir>/csv/version_N/metrics.csv``) and TensorBoard (``<output_dir>/tensorboard/version_N``)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    return [
        CSVLogger(save_dir=output_dir, name="csv"),
        TensorBoardLogger(save_dir=output_dir, name="tensorboard"),
    ]


def offload_enabled(cfg: DictConfig) -> bool:
    """Whether the run asks for activation offload (``sloth.offload`` is on or auto)."""
    return cfg.sloth.offload is not Switch.off


def progress_lines(trainer: DictConfig) -> bool:
    """Whether the run shows its progress as log lines (``trainer.progress``; ``auto``: when the
    output is not a terminal) rather than a redrawn bar."""
    mode = trainer.get("progress", ProgressMode.auto)
    return mode is ProgressMode.lines or (mode is ProgressMode.auto and not interactive())


def in_slurm_job() -> bool:
    """Whether this process runs as a SLURM batch job (not an interactive ``srun --pty bash``)."""
    import os

    return bool(os.environ.get("SLURM_JOB_ID")) and os.environ.get("SLURM_JOB_NAME") not in (
        "bash",
        "interactive",
    )


def out_of_memory_hints(cfg: DictConfig) -> list[str]:
    """The settings of this run that would make a step fit, as overrides, most effective first."""
    hints = []
    sloth = cfg.sloth
    if not sloth.gradient_checkpointing:
        hints.append("sloth.gradient_checkpointing=true: keep one input per layer, recompute the rest")
    if sloth.offload is Switch.off:
        hints.append("sloth.offload=on: checkpointed layer inputs to pinned host memory")
    if sloth.memory_budget is None:
        hints.append("sloth.memory_budget=auto: keep, recompute or offload each layer to fit the free memory")
    else:
        hints.append(f"a smaller sloth.memory_budget (now {sloth.memory_budget})")
    hints.append(
        f"data.max_tokens={max(cfg.data.max_tokens // 2, 1)}: fewer tokens per step (now {cfg.data.max_tokens})"
    )
    if cfg.precision.get("quantize") is None and cfg.lora.enabled:
        hints.append("precision.quantize=nf4: the frozen base weights in 4 bits (QLoRA)")
    return hints


RESUME_HINT = "rerun the same command with the same output directory (resume=auto continues from it)"


def build_callbacks(
    trainer: DictConfig,
    output_dir: str | Path,
    offload: bool = False,
    oom_hints: list[str] | None = None,
) -> list[Callback]:
    """Checkpointing (``<output_dir>/checkpoints/last.ckpt``; the random generators seeded per batch;
    on SIGTERM/SIGUSR1/SIGUSR2 after the current step, then a non-zero exit, the SLURM job
    requeued on the warning signal inside a SLURM job), learning-rate and throughput monitors, the gradient-flow guard, the adapter export
    (``<output_dir>/adapter``), greedy samples at each validation (``<output_dir>/samples.jsonl``,
    when ``trainer.samples > 0``), the step progress bar or, where the output is not a terminal,
    progress lines (when enabled; :func:`progress_lines`) and, with activation
    offload on, its statistics (bytes offloaded, pinned pool size, backward wait)."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    output_dir = Path(output_dir)
    every_n_steps = trainer.checkpoint_every_n_steps or trainer.val_check_interval
    checkpoint = ModelCheckpoint(
        dirpath=output_dir / CHECKPOINT_DIR,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=every_n_steps,
        # Resuming into the same directory overwrites last.ckpt instead of writing last-v1.ckpt.
        enable_version_counter=False,
    )
    callbacks = [
        checkpoint,
        LearningRateMonitor(logging_interval="step"),
        SlothThroughputMonitor(window_size=trainer.throughput_window),
        GradientFlowGuard(
            every_n_steps=trainer.grad_guard_every_n_steps, max_nonfinite_steps=trainer.max_nonfinite_steps
        ),
        OutOfMemoryAdvice(*([oom_hints] if oom_hints else [])),
        LongestStepHeadroom(),
        SaveAdapter(output_dir / ADAPTER_DIR),
        ExpertLoadMonitor(every_n_steps=trainer.log_every_n_steps),
        StepRandomState(),
        FinalCheckpoint(output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT, every_n_steps),
        PreemptionCheckpoint(
            output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT, requeue=in_slurm_job(), resume_hint=RESUME_HINT
        ),
    ]
    if trainer.samples:
        samples = SampleGenerations(trainer.samples, trainer.sample_max_new_tokens, output_dir / SAMPLES_FILE)
        callbacks.append(samples)
    if trainer.enable_progress_bar:
        lines = progress_lines(trainer)
        callbacks.append(ProgressLines(trainer.progress_every_n_steps) if lines else StepProgressBar())
    return callbacks + ([OffloadStatsCallback()] if offload else [])


def build_trainer(
    cfg: DictConfig,
    output_dir: str | Path,
    *,
    multirun: bool = False,
    callbacks: list[Callback] | None = None,
    loggers: list[Logger] | bool | None = None,
) -> Trainer:
    """The ``lightning.Trainer`` of the run: sloth strategy, ``SlothPrecision`` plugin, callbacks, loggers.

    Args:
        cfg: the whole run config (``trainer``, ``sloth``, ``precision`` are read).
        output_dir: the job's output directory (``HydraConfig.get().runtime.output_dir`` in the app).
        multirun: the job runs under Hydra's ``-m``; decides how DDP starts processes.
        callbacks: defaults to :func:`build_callbacks`.
        loggers: defaults to :func:`build_loggers`; ``False`` disables logging.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    t = cfg.trainer
    plugins: list[Any] = [build_precision(cfg.precision), AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        # PreemptionCheckpoint stops at a step boundary and requeues; Lightning's auto-requeue
        # would save from inside its signal handler, in the middle of a step.
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg.sloth, t, multirun, _meta_weights(cfg)),
        plugins=plugins,
        callbacks=(
            build_callbacks(t, output_dir, offload_enabled(cfg), out_of_memory_hints(cfg))
            if callbacks is None
            else callbacks
        ),
        logger=build_loggers(output_dir) if loggers is None else loggers,
        default_root_dir=output_dir,
        max_steps=t.max_steps,
        max_epochs=t.max_epochs,
        val_check_interval=t.val_check_interval,
        # Count val_check_interval across epochs, so it may exceed one epoch's batches.
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,  # None: all, without Lightning's notice saying so
        num_sanity_val_steps=t.num_sanity_val_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        # In a log, ProgressLines' first line replaces the parameter table.
        enable_model_summary=not (t.enable_progress_bar and progress_lines(t)),
        deterministic=t.deterministic,
    )


def _meta_weights(cfg: DictConfig):
    """Seeded random shards (the run's seed) for a model built per shard, else None."""
    return RandomWeights(seed=cfg.seed) if builds_per_shard(cfg) else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> str | None:
    """The checkpoint ``Trainer.fit`` resumes from.

    Args:
        resume: ``"auto"`` (``<output_dir>/checkpoints/last.ckpt`` if it exists, else none), a
            checkpoint path (must exist), or ``None`` (start fresh). A sharded (FSDP2)
            checkpoint is a directory.
        output_dir: the job's output directory.

    A sharded checkpoint is checked here, before anything is built, with
    :func:`~lightning_sloth.plugins.checkpoint.verify_checkpoint` (``torch.distributed.checkpoint``
    would unpickle its index and non-tensor entries without restriction). A checkpoint file is
    loaded by :class:`~lightning_sloth.plugins.checkpoint.AtomicCheckpointIO`, which refuses one
    that pickles anything but plain types.
    """
    if resume is None:
        return None
    if resume == "auto":
        last = Path(output_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT
        resume = str(last) if last.exists() else None
    elif not Path(resume).exists():
        raise FileNotFoundError(f"resume: checkpoint {resume!r} does not exist")
    if resume is not None and Path(resume).is_dir():
        verify_checkpoint(resume)
    return None if resume is None else str(resume)
