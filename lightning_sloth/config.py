"""Typed configuration of the ``lightning-sloth`` app: structured-config schemas and their checks.

It is one file: the schemas of every group, their ConfigStore entries and the checks of
:func:`validate` are the app's whole configuration surface, read and changed together.

Every YAML file under ``conf/`` extends one of these dataclasses through its defaults list, so
Hydra rejects an unknown key (``model.hiden_size=3``) or a value of the wrong type or enum
(``precision.precision=bf17``) while composing, before anything is built. :func:`validate`
then checks value ranges and required values, naming the key of every problem at once.

Schemas live in the ``schema/`` config group of Hydra's ConfigStore and are pulled into a
group file with ``- /schema/<group>/<name>@_here_``, which keeps them out of the option
lists of the real groups::

    schema/model/random       RandomModelConfig      model/tiny_llama, model/llama_3_2_1b
    schema/model/pretrained   PretrainedModelConfig  model/tiny_base (the default), model/hf
    schema/data/synthetic     SyntheticDataConfig    data/synthetic
    schema/data/jsonl         JsonlDataConfig        data/jsonl
    schema/data/hf_dataset    HFDatasetDataConfig    data/hf_dataset
    schema/<group>/base       one schema for lora, precision, trainer, sloth, optimizer
    train_schema              TrainConfig            train.yaml (the primary config)
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from lightning_sloth.data.sources import DEFAULT_TASKS
from lightning_sloth.module import LLAMA_PROJECTIONS


class PrecisionMode(Enum):
    """Compute precision; the member name is what a config says, the value is Lightning's string."""

    auto = "auto"
    bf16_mixed = "bf16-mixed"
    bf16_true = "bf16-true"
    fp16_mixed = "16-mixed"
    fp16_true = "16-true"
    fp32 = "32-true"


class OverlongPolicy(Enum):
    """What happens to a sample longer than ``data.max_tokens``."""

    truncate = "truncate"
    split = "split"
    error = "error"


class BadRecordPolicy(Enum):
    """What happens to a malformed record."""

    error = "error"
    skip = "skip"


class LRSchedule(Enum):
    """Learning-rate schedule after the linear warm-up."""

    cosine = "cosine"
    constant = "constant"


class Switch(Enum):
    """A feature that is on, off, or decided for the machine the run is on."""

    auto = "auto"
    on = "on"
    off = "off"


class Sharding(Enum):
    """How several processes split the model: ``ddp`` replicates it, ``fsdp`` shards it (FSDP2)."""

    ddp = "ddp"
    fsdp = "fsdp"


class ProgressMode(Enum):
    """How training progress is shown: ``auto`` a bar on a terminal and lines elsewhere."""

    auto = "auto"
    bar = "bar"
    lines = "lines"


class ExportMode(Enum):
    """What the app exports at the end of training besides the adapter."""

    none = "none"
    merged = "merged"


class ExportDtype(Enum):
    """dtype of the merged export."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class LoadDtype(Enum):
    """dtype a pretrained checkpoint is loaded in (``auto``: the checkpoint's own)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class ModelConfig:
    """What every model option has.

    Attributes:
        tokenizer: ``"char"`` for the built-in character tokenizer, else a local path or hub id
            for ``AutoTokenizer.from_pretrained``.
    """

    tokenizer: str = "char"


@dataclass
class RandomModelConfig(ModelConfig):
    """A transformers model built from its config with random weights (no download).

    Attributes:
        model_type: any ``model_type`` ``transformers.AutoConfig.for_model`` knows (``llama``,
            ``qwen3``, ``mistral``...).
        vocab_size: ``None`` sizes the embedding to the tokenizer.
        extra: further config arguments (``num_experts``, ``rope_scaling``...).
    """

    model_type: str = "llama"
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float | None = None
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PretrainedModelConfig(ModelConfig):
    """A checkpoint loaded with ``AutoModelForCausalLM.from_pretrained`` (local path or hub id)."""

    name_or_path: str = MISSING
    revision: str | None = None
    dtype: LoadDtype = LoadDtype.float32
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    """Packing and loading settings shared by every data source.

    Attributes:
        max_tokens: token budget of one packed batch (the ``[1, T]`` row has ``T <= max_tokens``).
        pad_to_multiple_of: the packed row is padded up to this multiple (capped at ``max_tokens``).
        seed: base seed of the per-epoch shuffles (the run's ``seed`` by default).
    """

    max_tokens: int = 1024
    overlong: OverlongPolicy = OverlongPolicy.truncate
    on_bad_record: BadRecordPolicy = BadRecordPolicy.error
    num_workers: int = 0
    pad_to_multiple_of: int = 64
    shuffle: bool = True
    seed: int = II("seed")


@dataclass
class SyntheticDataConfig(DataConfig):
    """The built-in synthetic instruction task (``SyntheticTask``), train and val from disjoint seeds."""

    num_train: int = 4000
    num_val: int = 256
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))


@dataclass
class JsonlDataConfig(DataConfig):
    """JSON Lines files of ``{"prompt", "response"}`` or ``{"messages": [...]}`` records."""

    train_path: str = MISSING
    val_path: str | None = None


@dataclass
class HFDatasetDataConfig(DataConfig):
    """A Hugging Face dataset (hub id or local directory) through ``datasets.load_dataset``.

    Rows must carry ``prompt``/``response`` or ``messages`` columns.
    """

    path: str = MISSING
    name: str | None = None
    train_split: str = "train"
    val_split: str | None = None


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT); ``enabled: false`` trains every parameter (full fine-tuning)."""

    enabled: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LLAMA_PROJECTIONS))
    target_parameters: list[str] = field(default_factory=list)
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class PrecisionConfig:
    """``auto``: bf16-mixed on a CUDA GPU with bfloat16 support, else fp32.

    ``quantize``: ``nf4``, ``nf4-dq`` or ``fp4`` stores the frozen base linear layers in 4 bits
    (QLoRA); ``quantize_skip`` names the modules kept in the compute dtype.

    ``base_dtype: fp8`` stores the frozen base linear layers in FP8 e4m3 (LoRA, or QLoRA with
    ``quantize``), ``fp8_grad`` the input gradient's format (``e4m3``, ``e5m2``, ``bf16``),
    ``fp8_skip`` the layers whose products stay in the compute dtype (the key and value projections),
    ``fp8_fast_accum`` whether the FP8 products accumulate in the tensor cores' fast mode (default),
    ``fp8_experts`` MoE expert weights in FP8 (null: experts at least 2,048 wide; true; false);
    ``fp8_training: true`` is full fine-tuning in FP8 through torchao.
    """

    precision: PrecisionMode = PrecisionMode.auto
    quantize: str | None = None
    quantize_skip: list[str] = field(default_factory=lambda: ["lm_head"])
    base_dtype: str | None = None
    fp8_grad: str = "e4m3"
    fp8_training: bool = False
    fp8_skip: list[str] = field(default_factory=lambda: ["k_proj", "v_proj"])
    fp8_fast_accum: bool = True
    fp8_experts: bool | None = None


@dataclass
class TrainerConfig:
    """``lightning.Trainer`` arguments the app exposes, plus its callbacks' cadence.

    Attributes:
        devices: devices per node; ``-1`` takes every visible GPU. More than one process in all
            selects the DDP strategy (see ``lightning_sloth.build.build_strategy``).
        sharding: with several processes, ``ddp`` (replicas) or ``fsdp`` (FSDP2 shards,
            ``SlothFSDPStrategy``; ``trainer=fsdp``).
        fsdp_reshard_after_forward: FSDP2 frees each layer's gathered weights after its forward
            (``true``) or keeps them for the backward (``false``); ``null`` (the default): keeps
            them for LoRA / QLoRA where the gathered model takes at most a quarter of the GPU.
        fsdp_cpu_offload: FSDP2 keeps sharded weights, gradients and optimizer states on the host.
        fsdp_shard_frozen: shard a LoRA / QLoRA base too (``true``), keep it whole on every GPU
            (``false``), or ``auto`` (the default): whole where it takes at most a quarter of the
            GPU, the adapters then in one FSDP2 unit.
        fsdp_layers_per_unit: consecutive decoder layers FSDP2 gathers and reduces as one unit
            (``null``: as many as hold 250M parameters, at least one).
        max_epochs: ``-1`` lets ``max_steps`` alone end the run.
        val_check_interval: validate every this many training batches (counted across epochs).
        limit_val_batches: validate on at most this many batches (``None``: all).
        checkpoint_every_n_steps: save ``checkpoints/last.ckpt`` every this many optimizer steps
            (``None``: every ``val_check_interval`` steps); written atomically.
        samples: validation prompts greedy-decoded and scored at each validation (0: none).
        sample_max_new_tokens: most tokens generated per sample.
        grad_guard_every_n_steps: cadence of ``GradientFlowGuard``'s all-zero gradient check.
        max_nonfinite_steps: consecutive non-finite steps skipped (``train/skipped_steps``) before
            the run stops (0: at the first; ``null``: no per-step check, one host read less).
        throughput_window: batches in ``SlothThroughputMonitor``'s rolling average.
        progress: ``bar`` (redrawn), ``lines`` (loss, real tokens/s, MFU every
            ``progress_every_n_steps``; ``None``: about 15 a run), ``auto``: a bar on a terminal.
    """

    accelerator: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    sharding: Sharding = Sharding.ddp
    fsdp_reshard_after_forward: bool | None = None
    fsdp_cpu_offload: bool = False
    fsdp_shard_frozen: Any = "auto"
    fsdp_layers_per_unit: int | None = None
    max_steps: int = 300
    max_epochs: int = -1
    val_check_interval: int = 50
    limit_val_batches: int | None = None
    num_sanity_val_steps: int = 2
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    deterministic: bool = False
    checkpoint_every_n_steps: int | None = None
    samples: int = 32
    sample_max_new_tokens: int = 40
    grad_guard_every_n_steps: int = 50
    max_nonfinite_steps: int | None = 3
    throughput_window: int = 20
    progress: ProgressMode = ProgressMode.auto
    progress_every_n_steps: int | None = None


@dataclass
class KernelOpsConfig:
    """Which op families the Triton kernels replace (``lightning_sloth.patching.KernelSettings``)."""

    rms_norm: bool = True
    rope: bool = True
    glu: bool = True
    cross_entropy: bool = True
    lora: bool = True
    add_rms_norm: bool = True


@dataclass
class SlothConfig:
    """``SlothStrategy`` settings: the model transformations applied at ``setup``.

    Attributes:
        kernels: Triton kernels as torch.library ops; ``auto`` turns them on where CUDA is.
        kernel_ops: which op families the kernels replace when they are on.
        offload: offload checkpointed layer inputs to pinned host memory (needs checkpointing).
        memory_budget: device bytes for the per-layer keep/recompute/offload plan, ``"auto"``,
            or ``None`` (checkpoint every layer).
        compile: regional ``torch.compile`` of each decoder layer.
        compile_options: keyword arguments for ``torch.compile`` (``mode``, ``dynamic``...).
        moe: MoE models run their experts through ``lightning_sloth.moe``; ``false`` keeps
            transformers' experts implementation; ``fused`` also reads and writes the token rows
            through the routing permutation inside the grouped GEMMs.
        checkpoint_impl: ``node`` (each checkpointed layer one autograd node: less host time per
            layer), ``torch`` (torch's non-reentrant checkpoint per layer), or null (the
            strategy's default: ``node``, and ``torch`` under ``sloth_fsdp``).
        cuda_graphs: replay each checkpointed layer's forward and recompute + backward as CUDA
            graphs (one device; the packed rows are padded to ``data.max_tokens``; no dropout).
        mlp_chunk_tokens: run the gated MLPs over token chunks of this many rows, so their
            ``[tokens, intermediate]`` tensors never exist whole: ``auto`` (chunks of 2 GiB of
            intermediates, only past that length), a number of tokens, or null (never).
    """

    packed_attention: bool = True
    gradient_checkpointing: bool = True
    kernels: Switch = Switch.auto
    kernel_ops: KernelOpsConfig = field(default_factory=KernelOpsConfig)
    offload: Switch = Switch.off
    memory_budget: str | None = None
    compile: bool = False
    compile_options: dict[str, Any] = field(default_factory=dict)
    moe: Any = True  # true, false or fused
    checkpoint_impl: str | None = None
    cuda_graphs: bool = False
    mlp_chunk_tokens: str | None = "auto"


@dataclass
class OptimizerConfig:
    """AdamW with a linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (or constant)."""

    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 10
    scheduler: LRSchedule = LRSchedule.cosine
    min_lr_ratio: float = 0.1


@dataclass
class TrainConfig:
    """The whole run.

    Attributes:
        resume: ``"auto"`` resumes from ``<output_dir>/checkpoints/last.ckpt`` when it exists,
            a path resumes from that checkpoint, ``None`` always starts fresh.
        export: ``merged`` also writes ``<output_dir>/merged`` (adapter merged into the base,
            ``export_dtype``) when training ends; ``none`` writes only the adapter.
    """

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    lora: LoraConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING
    sloth: SlothConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    seed: int = 0
    resume: str | None = "auto"
    export: ExportMode = ExportMode.none
    export_dtype: ExportDtype = ExportDtype.bfloat16


_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"random": RandomModelConfig, "pretrained": PretrainedModelConfig},
    "data": {"synthetic": SyntheticDataConfig, "jsonl": JsonlDataConfig, "hf_dataset": HFDatasetDataConfig},
    "lora": {"base": LoraConfig},
    "precision": {"base": PrecisionConfig},
    "trainer": {"base": TrainerConfig},
    "sloth": {"base": SlothConfig},
    "optimizer": {"base": OptimizerConfig},
}


#: Models shipped inside the package, named in configs as ``${sloth_asset:<name>}``.
ASSETS_DIR = Path(__file__).parent / "assets"


def asset_path(name: str) -> str:
    """The directory of a model shipped in the package (the ``sloth_asset`` resolver)."""
    path = ASSETS_DIR / name
    if not path.is_dir():
        raise ValueError(f"no packaged asset {name!r} in {ASSETS_DIR}")
    return str(path)


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore and register the ``sloth_asset`` resolver
    (idempotent; runs when ``lightning_sloth.conf`` loads)."""
    if not OmegaConf.has_resolver("sloth_asset"):
        OmegaConf.register_new_resolver("sloth_asset", asset_path)
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, schemas in _SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=schema)


class ConfigError(ValueError):
    """A configuration value is out of range or missing; the message lists every offending key."""


def _missing(node: DictConfig, key: str) -> bool:
    return OmegaConf.is_missing(node, key)


def _check_keys(node: DictConfig, prefix: str, errors: list[str]) -> None:
    """Keys a schema does not have: Hydra lets ``+key=value`` add them to a structured config."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    # Unresolved: a missing value interpolated elsewhere is reported by the checks below.
    for key, value in node.items_ex(resolve=False):
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            errors.append(f"{prefix}{key}: not a key of {schema.__name__}{hint}")
        elif isinstance(value, DictConfig):
            _check_keys(value, f"{prefix}{key}.", errors)


def _check_model(model: DictConfig, errors: list[str]) -> None:
    kind = OmegaConf.get_type(model)
    if kind is PretrainedModelConfig and _missing(model, "name_or_path"):
        errors.append("model.name_or_path: required for a pretrained model (a local path or hub id)")
    elif kind is PretrainedModelConfig:
        path = str(model.name_or_path)
        # A hub id looks like a relative path; only paths that cannot be hub ids are checked here.
        if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
            errors.append(f"model.name_or_path: no such directory {path!r}")
    if kind is not RandomModelConfig:
        return
    shape = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    for key in shape:
        if _missing(model, key):
            errors.append(f"model.{key}: required to build a model from its config")
        elif model[key] <= 0:
            errors.append(f"model.{key}: must be > 0, got {model[key]}")
    if any(_missing(model, key) or model[key] <= 0 for key in shape):
        return
    if model.num_attention_heads % model.num_key_value_heads:
        errors.append(
            f"model.num_key_value_heads: must divide num_attention_heads ({model.num_attention_heads}), "
            f"got {model.num_key_value_heads}"
        )
    if model.head_dim is None and model.hidden_size % model.num_attention_heads:
        errors.append(
            f"model.hidden_size: must be a multiple of num_attention_heads ({model.num_attention_heads}) "
            f"unless model.head_dim is set, got {model.hidden_size}"
        )
    for key in ("head_dim", "vocab_size", "max_position_embeddings"):
        if model[key] is not None and model[key] <= 0:
            errors.append(f"model.{key}: must be > 0, got {model[key]}")


def _check_data(data: DictConfig, errors: list[str]) -> None:
    if data.max_tokens <= 0:
        errors.append(f"data.max_tokens: must be > 0, got {data.max_tokens}")
    if data.pad_to_multiple_of <= 0:
        errors.append(f"data.pad_to_multiple_of: must be > 0, got {data.pad_to_multiple_of}")
    if data.num_workers < 0:
        errors.append(f"data.num_workers: must be >= 0, got {data.num_workers}")
    kind = OmegaConf.get_type(data)
    if kind is SyntheticDataConfig:
        if data.num_train <= 0:
            errors.append(f"data.num_train: must be > 0, got {data.num_train}")
        if data.num_val < 0:
            errors.append(f"data.num_val: must be >= 0, got {data.num_val}")
        from lightning_sloth.data.sources import SYNTHETIC_TASKS

        unknown = sorted(set(data.tasks) - set(SYNTHETIC_TASKS))
        if unknown or not data.tasks:
            errors.append(
                f"data.tasks: must be a non-empty subset of {sorted(SYNTHETIC_TASKS)}, got {list(data.tasks)}"
            )
    elif kind is JsonlDataConfig:
        if _missing(data, "train_path"):
            errors.append("data.train_path: required for jsonl data (a .jsonl file)")
        for key in ("train_path", "val_path"):
            if not _missing(data, key) and data[key] is not None and not Path(data[key]).is_file():
                errors.append(f"data.{key}: no such file {data[key]!r} (relative to {Path.cwd()})")
    elif kind is HFDatasetDataConfig and _missing(data, "path"):
        errors.append("data.path: required for hf_dataset data (a hub id or local dataset directory)")


def _check_lora(lora: DictConfig, errors: list[str]) -> None:
    if not lora.enabled:
        return
    if lora.r <= 0:
        errors.append(f"lora.r: must be > 0, got {lora.r}")
    if lora.alpha <= 0:
        errors.append(f"lora.alpha: must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        errors.append(f"lora.dropout: must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules and not lora.target_parameters:
        errors.append("lora.target_modules: empty together with lora.target_parameters; adapt at least one")


def _check_trainer(trainer: DictConfig, errors: list[str]) -> None:
    if trainer.max_steps <= 0 and not (trainer.max_steps == -1 and trainer.max_epochs > 0):
        errors.append(
            f"trainer.max_steps: must be > 0 (or -1 with trainer.max_epochs > 0), got {trainer.max_steps}"
        )
    if trainer.devices == 0 or trainer.devices < -1:
        errors.append(f"trainer.devices: must be >= 1 or -1 (all), got {trainer.devices}")
    positive = ("num_nodes", "val_check_interval", "accumulate_grad_batches", "log_every_n_steps")
    positive += ("grad_guard_every_n_steps", "throughput_window")
    for key in positive:
        if trainer[key] <= 0:
            errors.append(f"trainer.{key}: must be > 0, got {trainer[key]}")
    for key in ("samples", "sample_max_new_tokens", "max_nonfinite_steps"):
        if trainer[key] is not None and trainer[key] < 0:
            errors.append(f"trainer.{key}: must be >= 0, got {trainer[key]}")
    for key in ("limit_val_batches", "checkpoint_every_n_steps", "progress_every_n_steps"):
        if trainer[key] is not None and trainer[key] <= 0:
            errors.append(f"trainer.{key}: must be > 0 or null, got {trainer[key]}")
    if trainer.num_sanity_val_steps < -1:
        errors.append(f"trainer.num_sanity_val_steps: must be >= -1, got {trainer.num_sanity_val_steps}")
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val < 0:
        errors.append(f"trainer.gradient_clip_val: must be >= 0 or null, got {trainer.gradient_clip_val}")


def _check_sloth(sloth: DictConfig, errors: list[str]) -> None:
    budget = sloth.memory_budget
    if budget is not None and budget != "auto" and not (budget.isdigit() and int(budget) > 0):
        errors.append(
            f"sloth.memory_budget: must be a positive number of bytes, 'auto' or null, got {budget!r}"
        )
    if sloth.offload is not Switch.off and not sloth.gradient_checkpointing:
        errors.append(
            "sloth.offload: needs sloth.gradient_checkpointing=true (it offloads checkpointed inputs)"
        )
    if sloth.get("cuda_graphs") and not sloth.gradient_checkpointing:
        errors.append(
            "sloth.cuda_graphs: needs sloth.gradient_checkpointing=true (it graphs the checkpointed layers)"
        )
    if sloth.get("cuda_graphs") and sloth.get("compile"):
        errors.append("sloth.cuda_graphs: excludes sloth.compile (choose one)")
    chunk = sloth.get("mlp_chunk_tokens", "auto")
    if chunk is not None and chunk != "auto" and not (str(chunk).isdigit() and int(chunk) > 0):
        errors.append(
            f"sloth.mlp_chunk_tokens: must be a positive number of tokens, 'auto' or null, got {chunk!r}"
        )
    moe = sloth.get("moe", True)
    if not (isinstance(moe, bool) or moe in ("fused", "separate")):
        errors.append(f"sloth.moe: must be true, false, fused or separate, got {moe!r}")
    if sloth.get("checkpoint_impl") not in (None, "torch", "node"):
        errors.append(
            f"sloth.checkpoint_impl: must be 'torch', 'node' or null, got {sloth.checkpoint_impl!r}"
        )


def _check_optimizer(optimizer: DictConfig, errors: list[str]) -> None:
    if optimizer.lr <= 0:
        errors.append(f"optimizer.lr: must be > 0, got {optimizer.lr}")
    if optimizer.weight_decay < 0:
        errors.append(f"optimizer.weight_decay: must be >= 0, got {optimizer.weight_decay}")
    if len(optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in optimizer.betas):
        errors.append(f"optimizer.betas: must be two values in [0, 1), got {list(optimizer.betas)}")
    if optimizer.warmup_steps < 0:
        errors.append(f"optimizer.warmup_steps: must be >= 0, got {optimizer.warmup_steps}")
    if not 0.0 <= optimizer.min_lr_ratio <= 1.0:
        errors.append(f"optimizer.min_lr_ratio: must be in [0, 1], got {optimizer.min_lr_ratio}")


def validate(cfg: DictConfig) -> None:
    """Check value ranges and required values of a composed :class:`TrainConfig`.

    Types, enums and key names were checked by Hydra while composing; this adds keys slipped
    in with ``+key=value`` and what a type cannot say (``data.max_tokens > 0``, ``lora.r > 0``,
    a jsonl source needs its path...).

    Raises:
        ConfigError: one line per problem, each starting with the full key.
    """
    errors: list[str] = []
    _check_keys(cfg, "", errors)
    _check_model(cfg.model, errors)
    _check_data(cfg.data, errors)
    _check_lora(cfg.lora, errors)
    _check_trainer(cfg.trainer, errors)
    _check_sloth(cfg.sloth, errors)
    if cfg.sloth.get("cuda_graphs") and (cfg.trainer.devices != 1 or cfg.trainer.get("num_nodes", 1) != 1):
        errors.append(
            "sloth.cuda_graphs: runs on one device (trainer.devices=1, one node); its graphs set "
            "gradients directly, which DDP/FSDP hooks would not see"
        )
    _check_optimizer(cfg.optimizer, errors)
    if cfg.precision.get("quantize") not in (None, "nf4", "nf4-dq", "fp4"):
        errors.append(
            f"precision.quantize: must be null, 'nf4', 'nf4-dq' or 'fp4', got {cfg.precision.quantize!r}"
        )
    if cfg.precision.get("base_dtype") not in (None, "fp8"):
        errors.append(f"precision.base_dtype: must be null or 'fp8', got {cfg.precision.base_dtype!r}")
    if cfg.precision.get("fp8_grad", "e4m3") not in ("e4m3", "e5m2", "bf16"):
        errors.append(f"precision.fp8_grad: must be 'e4m3', 'e5m2' or 'bf16', got {cfg.precision.fp8_grad!r}")
    if cfg.resume is not None and not cfg.resume:
        errors.append("resume: must be 'auto', a checkpoint path or null, got ''")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
