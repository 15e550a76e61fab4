"""``SlothStrategy``: transforms the model once at ``setup``, then lets Lightning place and wrap it.

At ``setup(trainer)`` — after ``configure_model``, before DDP wrapping — the strategy applies
:func:`lightning_sloth.transform.transform_model` to the transformers model inside the
LightningModule, in place: kernels, MoE experts, packed attention, checkpointing with the
offloader's hooks, regional compile or CUDA graphs.

Placement, precision conversion and DDP wrapping are Lightning's own: ``SlothStrategy`` extends
``SingleDeviceStrategy`` and ``SlothDDPStrategy`` extends ``DDPStrategy``. ``SlothFSDPStrategy``
extends ``ModelParallelStrategy`` (FSDP2) and shards the transformed model itself: ``fully_shard``
on the decoder layers (small consecutive layers share a unit), then the root
(``lightning_sloth.plugins.sharding``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.plugins.shard_init import materialize_shards, weight_source
from lightning_sloth.plugins.sharding import (
    ShardingError,
    check_layers_per_unit,
    check_reshard_after_forward,
    convert_before_sharding,
    frozen_to_replicate,
    full_state_dict,
    grouped_units_take_partial_forwards,
    mixed_precision_policy,
    resolve_reshard_after_forward,
    shard_model,
    shardable_layers,
)
from lightning_sloth.quant import check_checkpoint_quantization
from lightning_sloth.transform import SlothReport, transform_model

log = logging.getLogger(__name__)


class _SlothSetup:
    """The model transformation shared by the single-device and DDP strategies.

    Takes the :func:`transform_model` settings and passes every other argument on to the
    Lightning strategy it is mixed into.
    """

    default_checkpoint_impl = "node"  # what checkpoint_impl=None means for this strategy

    def __init__(
        self,
        packed_attention: bool = True,
        gradient_checkpointing: bool = True,
        kernels: Any = None,
        offload: str = "off",
        memory_budget: int | str | None = None,
        compile: bool | dict = False,
        moe: bool | str = True,
        checkpoint_impl: str | None = None,
        cuda_graphs: bool = False,
        mlp_chunk_tokens: int | str | None = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if cuda_graphs and not isinstance(self, SingleDeviceStrategy):
            raise ValueError(
                f"cuda_graphs runs on one device only: its graphs set the parameters' gradients "
                f"directly, which the gradient hooks of {type(self).__name__} would never see"
            )
        if checkpoint_impl is None:  # the strategy's own: the node (FSDP2: chosen at setup)
            checkpoint_impl = self.default_checkpoint_impl
        self.sloth_settings = dict(
            packed_attention=packed_attention,
            gradient_checkpointing=gradient_checkpointing,
            kernels=kernels,
            offload=offload,
            memory_budget=memory_budget,
            compile=compile,
            moe=moe,
            checkpoint_impl=checkpoint_impl,
            cuda_graphs=cuda_graphs,
            mlp_chunk_tokens=mlp_chunk_tokens,
        )
        self.offloader = None
        self.sloth_report: SlothReport | None = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # A 4-bit model's checkpoint fits the model only once the precision plugin has quantised it
        # (in setup); Lightning otherwise restores the weights before.
        return (
            getattr(self.precision_plugin, "quantize", None) is not None
            or super().restore_checkpoint_after_setup
        )

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        # A sharded (FSDP2) checkpoint is loaded into the model by the strategy itself: no flat state dict.
        if "state_dict" in checkpoint:
            check_checkpoint_quantization(self.lightning_module, checkpoint["state_dict"])
        super().load_model_state_dict(checkpoint, strict=strict)

    def setup(self, trainer) -> None:
        report = self.apply_transformations()
        log.info("SlothStrategy applied: %s", ", ".join(report.applied) or "nothing")
        super().setup(trainer)

    def on_exception(self, exception: BaseException) -> None:
        """A failure on this rank ends the ranks its launcher started on this node (Lightning's script
        launcher, on local rank 0). They would otherwise wait in their next collective until the
        process group times out (NCCL: minutes), holding their GPUs. Runs before Lightning's
        teardown, which may wait on them itself. A preemption stop and Ctrl-C are Lightning's to
        handle; ranks started by torchrun, SLURM or ``mp.spawn`` are their launcher's."""
        super().on_exception(exception)
        if isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            return
        launcher = self.launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            log.error(
                "%s on this rank: stopping the %d other local rank(s) it started",
                type(exception).__name__,
                len(launcher.procs),
            )
            launcher.kill(_get_sigkill_signal())

    def apply_transformations(self) -> SlothReport:
        """:func:`transform_model` on the LightningModule, before Lightning places and wraps it."""
        report = transform_model(self.lightning_module, **self.sloth_settings)
        self.sloth_report = report
        self.offloader = report.offloader
        return report


class SlothStrategy(_SlothSetup, SingleDeviceStrategy):
    """Single-device strategy that applies lightning_sloth's model transformations.

    ``Trainer(strategy="sloth")`` or ``Trainer(strategy=SlothStrategy(...))``.

    Args:
        packed_attention: use the packed "sloth" attention (needs ``PackedBatch`` inputs or
            unpadded rows).
        gradient_checkpointing: non-reentrant activation checkpointing of every decoder layer.
        kernels: Triton kernels as torch.library ops (``KernelSettings``, dict, ``True``/``None``).
        offload: ``"off"``/``"on"``/``"auto"``: offload checkpointed layer inputs to host memory.
        memory_budget: device bytes (or ``"auto"``) for the per-layer keep/recompute/offload plan.
        compile: regional ``torch.compile`` of each decoder layer (``True`` or compile kwargs).
        moe: grouped "sloth" experts for MoE models (``False`` keeps transformers' own;
            ``"fused"`` / ``"separate"``: the token permutation inside the grouped GEMMs or in
            separate passes; ``True``: the process-wide switch, by default fused on CUDA).
        checkpoint_impl: ``"node"`` (each checkpointed layer one autograd node; the default) or
            ``"torch"``.
        cuda_graphs: replay each checkpointed layer's passes as CUDA graphs (static shapes, no
            dropout; see :mod:`lightning_sloth.offload.graphs`).
        mlp_chunk_tokens: gated MLPs over token chunks of this many rows at long sequences
            (``"auto"``, an int, or ``None``; see :mod:`lightning_sloth.patching.mlp_chunks`).
        device: the device; by default the one the Trainer's accelerator picks.

    See :func:`transform_model` for the order the transformations are applied in.
    """

    strategy_name = "sloth"

    def __init__(self, *args: Any, device: torch.device | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, device=device or "cpu", **kwargs)
        self._device_given = device is not None

    def setup_environment(self) -> None:
        if not self._device_given:
            # Registered strategies are built without a device: take the accelerator's first.
            devices = self.lightning_module.trainer._accelerator_connector._parallel_devices
            self._root_device = devices[0] if devices else torch.device("cpu")
        super().setup_environment()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning_sloth, single device")


class SlothDDPStrategy(_SlothSetup, DDPStrategy):
    """DDP with lightning_sloth's model transformations (``Trainer(strategy="sloth_ddp")``).

    Takes the same arguments as :class:`SlothStrategy` plus everything ``DDPStrategy`` takes
    (``start_method="spawn"`` is what the Hydra app uses under ``-m`` multirun).

    Args:
        global_token_loss: ``CausalLMModule`` normalises a step's loss by the global number of
            target tokens (all ranks, all micro-batches of the accumulation window; one all-reduce
            of a count per optimizer step), which gives the gradients of one process on the whole
            global batch (:class:`~lightning_sloth.token_loss.GlobalTokenLoss`). ``False``: the
            mean of per-rank, per-micro-batch means (DDP's plain averaging), which weights a token
            of a short packed batch more than one of a long batch.
    """

    strategy_name = "sloth_ddp"

    def __init__(self, *args: Any, global_token_loss: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # CausalLMModule reads this (as it does for SlothFSDPStrategy).
        self.global_token_loss = global_token_loss

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning_sloth, DDP (subprocess launch)"
        )
        strategy_registry.register(
            "sloth_ddp_spawn", cls, description="lightning_sloth, DDP (spawn launch)", start_method="spawn"
        )


class _ShardedSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, handing the main process the trained weights gathered from
    the shards (the stock one sends rank 0's ``state_dict()``, whose ``DTensor`` shards cannot be
    loaded into the main process's plain module)."""

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        weights = full_state_dict(module)  # a collective: every rank takes part
        module.state_dict = lambda *args, **kwargs: weights
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


class SlothFSDPStrategy(_SlothSetup, ModelParallelStrategy):
    """FSDP2 with lightning_sloth's model transformations (``Trainer(strategy="sloth_fsdp")``).

    At ``setup`` the model is transformed as by :class:`SlothStrategy` (kernels, packed attention,
    checkpointing and offload hooks, regional compile), then sharded over all processes:
    ``fully_shard`` on the decoder layers, one or a few per unit (LoRA adapters share their
    layer's unit with the frozen base weights), then on the transformers model as root. Mixed
    precision is FSDP2's ``MixedPrecisionPolicy`` derived from the Trainer's precision plugin
    (:func:`~lightning_sloth.plugins.sharding.mixed_precision_policy`); ``clip_grad_norm_`` and
    AdamW (fused on CUDA) work on the sharded ``DTensor`` parameters. With
    ``SlothPrecision(quantize=...)`` the frozen base weights are stored in 4 bits before sharding,
    and FSDP2 shards their packed codes (:func:`~lightning_sloth.plugins.sharding.convert_before_sharding`).
    ``CausalLMModule``
    normalises the loss by the step's global number of target tokens
    (:class:`~lightning_sloth.token_loss.GlobalTokenLoss`). Checkpoints are Lightning's
    distributed (sharded) checkpoints: ``last.ckpt`` is a directory.

    Args:
        start_method: ``"popen"`` (Lightning re-runs the script per process; the default) or
            ``"spawn"`` (processes forked from this one; the Hydra app uses it under ``-m``).
            Ignored where the cluster starts the processes (torchrun, SLURM).
        reshard_after_forward: free each layer's gathered weights after its forward (``True``), or
            keep them for the backward (``False``: one all-gather per layer and step instead of
            two, the whole model gathered at the peak). ``None`` (the default): keep them for a
            LoRA / QLoRA model whose gathered weights take at most a quarter of the GPU's memory,
            reshard otherwise (full fine-tuning, a model built on the meta device, ``cpu_offload``,
            off CUDA; see
            :func:`~lightning_sloth.plugins.sharding.resolve_reshard_after_forward`). After
            setup the attribute holds the value applied.
        cpu_offload: FSDP2's ``CPUOffloadPolicy``: sharded weights, gradients and optimizer
            states in host memory.
        layers_per_unit: consecutive decoder layers sharded as one FSDP2 unit (gathered and
            reduced together, one set of FSDP2 hooks): less host time and fewer collectives per
            step for more gathered weights at a time. ``None`` (the default): as many layers as
            hold 250M parameters (:func:`~lightning_sloth.plugins.sharding.auto_layers_per_unit`:
            four of a Llama-3.2-1B, one of an 8B), one per unit under ``checkpoint_impl="node"``.
        meta_weights: where a model built on the meta device gets its weights: ``"random"``
            (seeded, the same values for any number of ranks), a local safetensors checkpoint
            directory, or a :class:`~lightning_sloth.quant.loading.RandomWeights` /
            :class:`~lightning_sloth.quant.loading.CheckpointWeights`. After ``fully_shard`` each
            rank allocates and fills only its own shards (a 4-bit weight's codes and scales are
            quantised from just the elements they cover): no rank ever holds the whole model
            (:mod:`~lightning_sloth.plugins.shard_init`). Build the model with
            ``torch.device("meta")`` (or in ``configure_model`` under it). ``None``: the model must
            be real; a meta model is refused.
        shard_frozen: shard the frozen weights too (``True``), keep them whole on every rank
            (``False``), or ``"auto"`` (the default): whole where the frozen weights, in the
            compute dtype, take at most a quarter of a GPU's memory, sharded otherwise (full
            fine-tuning has none; a meta-device model always shards;
            :func:`~lightning_sloth.plugins.sharding.frozen_to_replicate`). A LoRA base kept whole
            is stored in the compute dtype and leaves FSDP2 only the adapters and their optimizer
            states: unless ``layers_per_unit`` is given, the decoder layers get no unit of their
            own and the root's unit holds every adapter (one all-gather and one reduce-scatter
            per step, no per-layer FSDP2 hooks).
        save_distributed_checkpoint: sharded checkpoints (``False``: one file gathered on rank 0).
        checkpoint_impl: ``"torch"``, ``"node"`` or ``None`` (the default): the node where the
            gathered weights are kept from forward to backward (one layer per unit; measured the
            faster pair on four H200s), torch's checkpoint where they are resharded. Under FSDP2 the node's
            forward runs FSDP2's hooks without a graph (gather, reshard, and the post-forward
            order that backward prefetching follows); its recompute runs inside the backward,
            where FSDP2 neither reshards nor records, so a layer is gathered once in the forward
            and once (prefetched) in the backward, as with torch's checkpoint. The node takes
            one layer per FSDP2 unit where the weights are resharded after the forward (with
            several, a unit's weights were found resharded before its other layers' recompute on
            two GPUs); with ``reshard_after_forward=False`` and torch >= 2.13 an explicit
            ``layers_per_unit`` groups layers under the node too (bit for bit as one layer per unit
            on two CPU processes; refused on older torch, whose FSDP2 reshards the unit after the
            first layer's backward; never chosen automatically).
        *args, **kwargs: :class:`SlothStrategy`'s transformation settings; ``process_group_backend``
            and ``timeout`` go to ``ModelParallelStrategy``.

    Raises:
        ShardingError: fewer than two processes, a model without a decoder-layer stack, a model
            already sharded, trainable parameters outside the transformers model, ``16-mixed``,
            no process group, or a meta-device model without ``meta_weights``.
    """

    strategy_name = "sloth_fsdp"
    default_checkpoint_impl = None  # chosen with reshard_after_forward in apply_transformations
    # CausalLMModule reads this: the loss of a step is normalised by the global target tokens.
    global_token_loss = True

    def __init__(
        self,
        *args: Any,
        start_method: str = "popen",
        reshard_after_forward: bool | None = None,
        cpu_offload: bool = False,
        layers_per_unit: int | None = None,
        meta_weights: Any = None,
        shard_frozen: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if shard_frozen not in (True, False, "auto"):
            raise ShardingError(f"shard_frozen takes True, False or 'auto', got {shard_frozen!r}")
        self.shard_frozen = shard_frozen
        self.meta_weights = meta_weights
        self.shard_stats = None
        if start_method not in ("popen", "spawn"):
            raise ValueError(f"start_method must be 'popen' or 'spawn', got {start_method!r}")
        self._start_method = start_method
        self.reshard_after_forward = check_reshard_after_forward(reshard_after_forward)
        self.cpu_offload = cpu_offload
        self.layers_per_unit = check_layers_per_unit(layers_per_unit)
        self._layers_per_unit_given = self.layers_per_unit is not None
        if self.sloth_settings["checkpoint_impl"] == "node":
            if self.layers_per_unit not in (None, 1) and reshard_after_forward is not False:
                raise ShardingError(
                    f"checkpoint_impl='node' takes one decoder layer per FSDP2 unit where the unit's "
                    f"weights are resharded after its forward, got layers_per_unit={layers_per_unit!r}: "
                    f"use checkpoint_impl='torch' to group layers, or keep the weights gathered "
                    f"(reshard_after_forward=False)"
                )
            if self.layers_per_unit not in (None, 1) and not grouped_units_take_partial_forwards():
                raise ShardingError(
                    f"checkpoint_impl='node' with layers_per_unit={layers_per_unit!r} needs torch >= "
                    f"2.13, whose FSDP2 keeps a unit of several layers gathered until each layer's "
                    f"recompute and backward ran (this is torch {torch.__version__}): use one layer "
                    f"per unit, or checkpoint_impl='torch' to group layers"
                )
            self.layers_per_unit = self.layers_per_unit or 1

    def _configure_launcher(self) -> None:
        if self.num_nodes * self.num_processes < 2:
            raise ShardingError(
                "sloth_fsdp shards the model over several processes but this run has one device; "
                "use strategy='sloth' on one device, or devices>=2 / num_nodes>=2"
            )
        if self._start_method == "spawn" and not self.cluster_environment.creates_processes_externally:
            self._launcher = _ShardedSpawnLauncher(self, start_method="spawn")
        else:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        # One data-parallel dimension over every process (ModelParallelStrategy's "auto" would
        # make the processes of a node a tensor-parallel group).
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def apply_transformations(self) -> SlothReport:
        """Transform, quantise / convert to a true half dtype if asked, then ``fully_shard`` (in this order)."""
        policy = mixed_precision_policy(self.precision_plugin.precision)
        hf_model = find_hf_model(self.lightning_module)
        shardable_layers(hf_model)  # refuse before transforming anything
        meta = any(p.is_meta for p in hf_model.parameters())
        if meta and self.meta_weights is None:
            raise ShardingError(
                "the model is on the meta device: give SlothFSDPStrategy(meta_weights='random' or a "
                "checkpoint directory) so each rank can fill its own shards"
            )
        source = weight_source(self.meta_weights, hf_model) if meta else None
        self._choose_resharding(hf_model, policy)
        report = super().apply_transformations()
        if report.checkpointing is not None:
            # The embedding's weight is sharded from here on: its output stays saved, not looked up
            # again in the backward (where the root's weights might be resharded).
            report.checkpointing.rebuild_embedding = False
        quantized = convert_before_sharding(self.precision_plugin, self.lightning_module, self.root_device)
        if quantized:
            report.applied.append(f"4-bit base weights ({quantized} tensors, sharded)")
        replicate = frozen_to_replicate(hf_model, self.root_device, self.shard_frozen, policy)
        # A base kept whole leaves the layers only adapters: the root's unit holds them all.
        layers_per_unit = 0 if replicate and not self._layers_per_unit_given else self.layers_per_unit
        layers, per_unit = shard_model(
            self.lightning_module,
            hf_model,
            self.device_mesh["data_parallel"],
            policy,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            layers_per_unit=layers_per_unit,
            replicate=replicate,
        )
        grouped = f", {per_unit} per unit" if per_unit > 1 else ""
        if per_unit == 0:
            grouped = ", their adapters in the root's unit"
        elif not self.reshard_after_forward:
            grouped += ", gathered from forward to backward"
        whole = f"; {len(replicate)} frozen tensors kept whole on every rank" if replicate else ""
        report.applied.append(f"fully_shard ({layers} decoder layers{grouped}, then the root{whole})")
        if source is not None:
            device = torch.device("cpu") if self.cpu_offload else self.root_device
            self.shard_stats = materialize_shards(hf_model, source, device)
            report.applied.append(f"shards made per rank ({type(source).__name__})")
        return report

    def _choose_resharding(self, hf_model: torch.nn.Module, policy) -> None:
        """Resolve ``reshard_after_forward=None`` and ``checkpoint_impl=None`` for this model and
        device: the node with the gathered weights kept (one layer per unit), torch's checkpoint
        with resharding."""
        device = self.root_device
        memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        if self.cpu_offload:  # weights kept in host memory to spare the GPU: never hold them gathered
            memory = None
        self.reshard_after_forward = resolve_reshard_after_forward(
            hf_model, self.reshard_after_forward, memory, policy
        )
        if self.sloth_settings["checkpoint_impl"] is None:
            node = not self.reshard_after_forward and self.layers_per_unit in (None, 1)
            self.sloth_settings["checkpoint_impl"] = "node" if node else "torch"
            if node:
                self.layers_per_unit = 1

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning_sloth, FSDP2 (subprocess launch)"
        )
        strategy_registry.register(
            "sloth_fsdp_spawn", cls, description="lightning_sloth, FSDP2 (spawn launch)", start_method="spawn"
        )


SlothStrategy.register_strategies(StrategyRegistry)
SlothDDPStrategy.register_strategies(StrategyRegistry)
SlothFSDPStrategy.register_strategies(StrategyRegistry)
