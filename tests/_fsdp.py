"""Two-process ``SlothFSDPStrategy`` runs (CPU/gloo and CUDA/NCCL tests) and their one-process reference.

Imported as ``import _fsdp`` (``tests/`` is on ``sys.path``; spawned workers find it the same way).
The workers are started the way torchrun starts them: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in
the environment, so Lightning's cluster environment sees externally created processes, and one
worker pair runs several ``Trainer.fit`` calls on one process group (starting processes is the
slow part on a CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _ddp import WORLD, free_port, leave_at_once, start_and_join
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lightning_sloth import (
    CausalLMModule,
    LoraSettings,
    OptimizerSettings,
    SlothDDPStrategy,
    SlothFSDPStrategy,
    SlothPrecision,
)
from lightning_sloth.data import PackedBatch, PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.plugins import GradientFlowGuard, SaveAdapter
from lightning_sloth.transform import transform_model

ACCUMULATE = 2
# Processes of the current run, set in each worker (Lightning's teardown clears WORLD_SIZE).
world_size = WORLD


def tiny_model(family: str, vocab: int, hidden: int = 64, layers: int = 2, meta: bool = False):
    """Random-weight float32 Llama, Qwen3 or Qwen3-MoE (4 experts, top 2) (seeded), GQA 2:1; on the
    meta device with ``meta``."""
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return tiny_model(family, vocab, hidden, layers)
    common = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        use_cache=False,
    )
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if family == "qwen3_moe":
        moe = dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2, norm_topk_prob=True
        )
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=hidden // 4, **moe, **common))
    return Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))


def lora_settings(family: str, lora: bool) -> LoraSettings | None:
    """Rank-4 LoRA on every projection; on a MoE model also on the experts (PEFT target_parameters)."""
    if not lora:
        return None
    if family == "qwen3_moe":
        experts = ("experts.gate_up_proj", "experts.down_proj")
        return LoraSettings(
            r=4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), target_parameters=experts
        )
    return LoraSettings(r=4)


def datamodule(num_train: int = 48, max_tokens: int = 256, shuffle: bool = True) -> PackedDataModule:
    return PackedDataModule(
        build_char_tokenizer(),
        train=SyntheticTask(num_train, seed=1),
        val=None,
        max_tokens=max_tokens,
        shuffle=shuffle,
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()


class Recorder(Callback):
    """Per optimizer step: this rank's micro-batches; on rank 0 also the full (gathered)
    parameters the step's forward used and the full gradients it produced. ``losses``: every
    micro-batch's loss, in order (the last one of a step ends after the optimizer step)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.losses: list[float] = []
        self._batches: list[PackedBatch] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batches.append(batch.to("cpu"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        named = list(pl_module.named_parameters())
        grads = {n: _full(p.grad) for n, p in named if p.grad is not None}  # collectives: every rank
        params = {n: _full(p) for n, p in named}
        step = {"batches": self._batches}
        if trainer.is_global_zero:
            step |= {"params": params, "grads": grads}
        self.steps.append(step)
        self._batches = []


def _op_spy(names: tuple[str, ...]) -> dict[str, int]:
    """Wrap the ops the kernel forwards call; count calls and calls that saw a ``DTensor``."""
    from torch.distributed.tensor import DTensor

    from lightning_sloth.patching import _forwards

    counts = {"dtensor_args": 0}

    def spy(name: str, op: Callable) -> Callable:
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            values = [*args, *kwargs.values()]
            counts["dtensor_args"] += sum(isinstance(v, DTensor) for v in values)
            if name == "fused_lora_forward":  # the module's weights are read inside
                module = args[0]
                counts["dtensor_args"] += sum(isinstance(p, DTensor) for p in module.parameters())
            return op(*args, **kwargs)

        return call

    for name in names:
        setattr(_forwards, name, spy(name, getattr(_forwards, name)))
    return counts


def _progress(line: str) -> None:
    """Append ``line`` (with the rank and the time) to ``$SLOTH_TEST_PROGRESS`` if set: the multi-GPU
    scenarios run in spawned processes whose output pytest keeps until the test ends, so a run cut
    off by a time limit would otherwise say nothing of where it was."""
    path = os.environ.get("SLOTH_TEST_PROGRESS")
    if path:
        import time

        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} rank {os.environ.get('RANK', '?')}: {line}\n")


def _fp8_settings(base_dtype: str | None) -> dict:
    """FP8 bases (``base_dtype="fp8"``): the linear layers but k/v, and every experts module."""
    return {} if base_dtype is None else {"base_dtype": base_dtype, "fp8_experts": True}


def fit(
    family: str,
    lora: bool,
    *,
    precision: str = "32-true",
    kernels: bool = False,
    offload: str = "off",
    max_steps: int = 2,
    max_epochs: int = -1,
    ckpt_dir: Path | None = None,
    ckpt_path: str | None = None,
    accelerator: str = "cpu",
    num_train: int = 48,
    shuffle: bool = True,
    hidden: int = 64,
    max_tokens: int = 256,
    export_dir: Path | None = None,
    strategy: str = "fsdp",
    quantize: str | None = None,
    checkpoint_impl: str | None = None,
    layers_per_unit: int | None = None,
    compile: bool = False,
    meta_weights=None,
    shard_frozen: bool | str = True,
    reshard_after_forward: bool | None = None,
    base_dtype: str | None = None,
) -> Recorder:
    """One ``Trainer.fit`` with ``SlothFSDPStrategy`` (or ``SlothDDPStrategy``: ``strategy="ddp"``)
    on the current (external) processes; with ``meta_weights`` the model is built on the meta
    device and each rank fills its own shards from that source."""
    seed_everything(0, verbose=False)
    data = datamodule(num_train, max_tokens=max_tokens, shuffle=shuffle)
    model = tiny_model(family, len(data.tokenizer), hidden=hidden, meta=meta_weights is not None)
    module = CausalLMModule(
        model,
        lora=lora_settings(family, lora),
        optimizer=OptimizerSettings(lr=1e-2, scheduler="constant"),
    )
    strategy_class = SlothFSDPStrategy if strategy == "fsdp" else SlothDDPStrategy
    sharding = (
        dict(
            layers_per_unit=layers_per_unit,
            meta_weights=meta_weights,
            shard_frozen=shard_frozen,
            reshard_after_forward=reshard_after_forward,
        )
        if strategy == "fsdp"
        else {}
    )
    if compile:
        sharding["compile"] = True
    recorder = Recorder()
    callbacks: list[Callback] = [recorder, GradientFlowGuard(every_n_steps=1)]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1))
    if export_dir is not None:
        callbacks.append(SaveAdapter(export_dir))
    trainer = Trainer(
        accelerator=accelerator,
        devices=world_size,
        strategy=strategy_class(
            kernels=kernels or None, offload=offload, checkpoint_impl=checkpoint_impl, **sharding
        ),
        plugins=[SlothPrecision(precision, quantize=quantize, **_fp8_settings(base_dtype))],
        callbacks=callbacks,
        max_steps=max_steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1e6,  # clips nothing: the sharded-gradient norm is still computed
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=ckpt_dir or os.getcwd(),
    )
    _progress(
        f"fit {strategy} {family} lora={lora} {precision} kernels={kernels} offload={offload} quantize={quantize}"
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    _progress("  done")
    recorder.grad_norm = callbacks[1].last_grad_norm
    recorder.strategy_report = list(trainer.strategy.sloth_report.applied)
    recorder.shard_stats = getattr(trainer.strategy, "shard_stats", None)
    codes = [p for p in module.parameters() if p.dtype == torch.uint8]  # 4-bit weights' packed codes
    recorder.codes_sharded = (sum(type(p).__name__ == "DTensor" for p in codes), len(codes))
    offloader = trainer.strategy.offloader
    recorder.offload_stats = offloader.stats() if offloader is not None else {}
    if export_dir is not None:
        recorder.export = _compare_export(module, export_dir, lora, trainer.is_global_zero)
    return recorder


def _compare_export(module: CausalLMModule, export_dir: Path, lora: bool, rank_zero: bool) -> dict:
    """What the exported file holds against the trained weights gathered from the shards."""
    from safetensors.torch import load_file

    from lightning_sloth.plugins.sharding import full_state_dict

    weights = full_state_dict(module.model)  # a collective: every rank
    if not rank_zero:
        return {}
    saved = load_file(export_dir / ("adapter_model.safetensors" if lora else "model.safetensors"))
    matched, max_diff = 0, 0.0
    for key, value in saved.items():
        name = key.replace(".weight", ".default.weight") if lora else key
        if name in weights:
            matched += 1
            max_diff = max(max_diff, float((weights[name] - value).abs().max()))
    return {"saved": len(saved), "matched": matched, "max_diff": max_diff}


def _worker(local_rank: int, port: int, scenario: Callable, tmp: str, results, world: int) -> None:
    global world_size
    world_size = world
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        results[local_rank] = scenario(Path(tmp))
    except BaseException:
        import traceback

        _progress("failed:\n" + traceback.format_exc())
        leave_at_once()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run(scenario: Callable[[Path], dict], tmp: Path, world: int = WORLD) -> dict[int, dict]:
    """``{rank: scenario(tmp)}`` from ``world`` processes (two by default) started like torchrun does."""
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        start_and_join(_worker, (free_port(), scenario, str(tmp), results, world), world)
        return dict(results)


def reference_step(
    family: str,
    lora: bool,
    step_rank0: dict,
    *other_ranks: dict,
    device: str = "cpu",
    hidden: int = 64,
    bf16_autocast: bool = False,
    quantize: str | None = None,
    bf16_weights: bool = False,
    base_dtype: str | None = None,
):
    """One process, the same global batch: ``(loss, grads, grad_norm)`` of one optimizer step.

    The loss is the sum of token losses over every micro-batch of both ranks divided by all
    their target tokens; parameters are the ones the sharded run used at that step. Float32
    with plain modules, or (``bf16_autocast``) bf16 autocast with the kernels on. With
    ``quantize`` the base weights are stored in 4 bits first (the same seeded weights give the
    same codes and block scales, which are buffers and not recorded): the codes gathered from
    the shards must equal them bit for bit; with ``base_dtype="fp8"`` the same for FP8 codes (the
    linear layers but k/v, and the experts). ``bf16_weights`` (with ``bf16_autocast``) stores the
    floating parameters in bf16 as FSDP2's ``param_dtype`` does, so activations between ops
    (the residual stream too) are bf16, where autocast alone keeps float32 weights' outputs.
    """
    data_vocab = len(build_char_tokenizer())
    model = tiny_model(family, data_vocab, hidden=hidden)
    module = CausalLMModule(model, lora=lora_settings(family, lora))
    if quantize is not None or base_dtype is not None:
        from lightning_sloth.quant import quantize_model
        from lightning_sloth.quant.fp8 import FP8_SKIP, fp8_base_model

        if quantize is not None:
            quantize_model(module, quantize, device=device)  # where the sharded run quantised them
        else:
            fp8_base_model(module, ("lm_head", *FP8_SKIP), device=device, experts=True)
        params = dict(module.named_parameters())
        codes = {n: p for n, p in step_rank0["params"].items() if p.dtype == torch.uint8}
        assert codes and all(torch.equal(params[n].cpu(), p.cpu()) for n, p in codes.items())
        floats = {n: p for n, p in step_rank0["params"].items() if n not in codes}
        missing, unexpected = module.load_state_dict(floats, strict=False)
        assert not unexpected and set(missing) == codes.keys() | {
            n for n in missing if n.endswith("_extra_state") or n in dict(module.named_buffers())
        }
    else:
        module.load_state_dict(step_rank0["params"], strict=True)
    module.to(device).train()
    if bf16_weights:
        for param in module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(torch.bfloat16)
    transform_model(
        module, packed_attention=True, gradient_checkpointing=False, kernels=bf16_autocast or None
    )
    total, count = 0.0, 0
    for batch in [b for step in (step_rank0, *other_ranks) for b in step["batches"]]:
        batch = batch.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16_autocast):
            out = module.model(**batch.model_inputs(), labels=batch.labels)
        total = total + out.loss.float() * batch.num_target_tokens
        count += batch.num_target_tokens
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in module.named_parameters() if p.grad is not None}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    return loss.detach().cpu(), grads, float(norm)


def global_loss(record0: dict, *others: dict, step: int) -> float:
    """Step ``step``'s loss over all ranks from the recorded per-micro-batch means and counts."""
    window = slice(step * ACCUMULATE, (step + 1) * ACCUMULATE)
    records = (record0, *others)
    batches = [b for r in records for b in r["steps"][step]["batches"]]
    losses = [loss for r in records for loss in r["losses"][window]]
    count = sum(b.num_target_tokens for b in batches)
    return sum(loss * b.num_target_tokens for loss, b in zip(losses, batches)) / count


PARITY_CASES = (
    ("llama", True, True),
    ("llama", False, False),
    ("qwen3", True, False),
    ("qwen3", False, True),
)


def parity_and_resume(tmp: Path) -> dict:
    """The CPU scenario: LoRA and full fine-tuning of tiny Llama and Qwen3 (kernels on for two of
    them, the ops spied on), then a run of two epochs and one resumed from its first epoch's
    sharded checkpoint."""
    out: dict = {}
    ops = _op_spy(("rms_norm", "linear_cross_entropy", "fused_lora_forward"))
    for family, lora, kernels in PARITY_CASES:
        recorder = fit(family, lora, kernels=kernels, export_dir=tmp / f"export_{family}_{lora}")
        out[(family, lora)] = {
            "export": recorder.export,
            "steps": recorder.steps,
            "losses": recorder.losses,
            "grad_norm": recorder.grad_norm,
            "report": recorder.strategy_report,
        }
    out["ops"] = dict(ops)
    # The same packing every epoch: Lightning sets the sampler epoch of the first epoch after a
    # resume from an epoch-end checkpoint to the checkpoint's epoch (its "processed" count), so a
    # reshuffled epoch would differ from the uninterrupted run for reasons unrelated to sharding.
    ckpt_dir = tmp / "ckpt"
    settings = dict(max_steps=-1, max_epochs=2, num_train=32, shuffle=False)
    full = fit("llama", True, ckpt_dir=ckpt_dir, **settings)
    first = sorted(ckpt_dir.iterdir())[0]
    resumed = fit("llama", True, ckpt_path=str(first), **settings)
    out["resume"] = {
        "full": full.losses,
        "resumed": resumed.losses,
        "checkpoint": first.name,
        "checkpoint_is_dir": first.is_dir(),
        "checkpoint_files": sorted(p.name for p in first.iterdir()) if first.is_dir() else [],
    }
    return out


# (name, family, lora, fit settings): DDP's global-token loss, the MoE path (LoRA on the
# experts too), NF4 base weights, activation offload, and the one-node checkpoint (LoRA with
# offload, and full fine-tuning), each against one process. The NF4 run lasts two epochs (one step
# each), exports its adapter and is resumed from its first epoch's sharded checkpoint.
_ONE_STEP = dict(max_steps=1)
_TWO_EPOCHS = dict(max_steps=-1, max_epochs=2, num_train=32, shuffle=False)
MORE_CASES = (
    ("ddp", "llama", False, dict(strategy="ddp", **_ONE_STEP)),
    ("moe", "qwen3_moe", True, dict(_ONE_STEP)),
    ("fp8", "qwen3_moe", True, dict(base_dtype="fp8", **_ONE_STEP)),
    ("nf4", "qwen3_moe", True, dict(quantize="nf4", **_TWO_EPOCHS)),
    ("offload", "llama", True, dict(offload="on", layers_per_unit=1, **_ONE_STEP)),
    # A LoRA base kept whole on every rank (shard_frozen=False): only the adapters are sharded, all in
    # the root's unit, under the node (what the default picks on a GPU with room for the base).
    (
        "replicated_base",
        "llama",
        True,
        dict(shard_frozen=False, kernels=True, checkpoint_impl="node", **_ONE_STEP),
    ),
    # The same for a 4-bit base: codes and their scales whole on every rank; two epochs, the adapter
    # exported and the second epoch resumed from the first's sharded checkpoint.
    ("nf4_whole_base", "qwen3_moe", True, dict(quantize="nf4", shard_frozen=False, **_TWO_EPOCHS)),
    ("node_offload", "llama", True, dict(offload="on", checkpoint_impl="node", **_ONE_STEP)),
    # The same with the gathered weights kept from forward to backward (what reshard_after_forward=None
    # picks for LoRA on a GPU with room for the model).
    (
        "node_gathered",
        "llama",
        True,
        dict(offload="on", checkpoint_impl="node", reshard_after_forward=False, **_ONE_STEP),
    ),
    (
        "node_unit2_gathered",
        "llama",
        True,
        dict(
            offload="on", checkpoint_impl="node", reshard_after_forward=False, layers_per_unit=2, **_ONE_STEP
        ),
    ),
    ("full", "llama", False, dict(layers_per_unit=1, **_ONE_STEP)),
    ("node_full", "llama", False, dict(checkpoint_impl="node", **_ONE_STEP)),
    # Both (tiny) decoder layers in one FSDP2 unit: the automatic grouping, and asked for.
    ("unit2_offload", "llama", True, dict(offload="on", **_ONE_STEP)),
    ("unit2_full", "llama", False, dict(layers_per_unit=2, **_ONE_STEP)),
    # Regional compile of each layer before sharding (the last transformation), with offload.
    ("compile", "llama", True, dict(offload="on", compile=True, layers_per_unit=1, **_ONE_STEP)),
    # NF4 under bf16-mixed, and the same with FSDP2's dtype rule as torch 2.11 has it (it casts
    # integer parameters too): the strategy's back-port must make the two runs identical.
    ("nf4_bf16", "qwen3_moe", True, dict(quantize="nf4", precision="bf16-mixed", **_ONE_STEP)),
    ("nf4_bf16_torch_2_11", "qwen3_moe", True, dict(quantize="nf4", precision="bf16-mixed", **_ONE_STEP)),
)


def _offload_any_size():
    """Let the strategy's offloader take tensors of any size (the tiny layer inputs are below
    its 1 MiB default); returns the undo."""
    import lightning_sloth.transform as transform  # where transform_model makes the offloader

    original = transform.ActivationOffloader

    class AnySize(original):
        def __init__(self, policy="auto", **kwargs):
            super().__init__(policy, **(kwargs | {"min_offload_bytes": 0}))

    transform.ActivationOffloader = AnySize
    return lambda: setattr(transform, "ActivationOffloader", original)


def init_dtype_attrs_torch_2_11(self, mp_policy) -> None:
    """``FSDPParam.init_dtype_attrs`` as torch 2.11 has it: every parameter, integer ones too, is
    cast to ``param_dtype`` (torch 2.13 leaves non-floating ones alone)."""
    self.orig_dtype = self.sharded_param.dtype
    reduce_dtype = None if mp_policy.reduce_dtype == mp_policy.param_dtype else mp_policy.reduce_dtype
    self.param_dtype = None if mp_policy.param_dtype == self.orig_dtype else mp_policy.param_dtype
    self.reduce_dtype = reduce_dtype


def ddp_moe_nf4_offload(tmp: Path) -> dict:
    """The second CPU scenario: :data:`MORE_CASES`, one ``Trainer.fit`` each (and the NF4 resume)."""
    from torch._dynamo.utils import counters as dynamo_counters
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from lightning_sloth.offload.checkpoint import _LayerNode

    out: dict = {}
    undo = _offload_any_size()
    gather, node_forward = _fsdp_param_group.foreach_all_gather, _LayerNode.forward
    counts = {"all_gathers": 0, "node_forwards": 0, "compiled_graphs": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    _fsdp_param_group.foreach_all_gather = counted("all_gathers", gather)
    _LayerNode.forward = staticmethod(counted("node_forwards", node_forward))
    try:
        for name, family, lora, settings in MORE_CASES:
            counts.update(all_gathers=0, node_forwards=0, compiled_graphs=0)
            ckpt_dir = tmp / name if "max_epochs" in settings else None
            export_dir = tmp / f"export_{name}" if ckpt_dir is not None else None
            fsdp_param = _fsdp_param_group.FSDPParam
            init_dtype_attrs = fsdp_param.init_dtype_attrs
            if name.endswith("_torch_2_11"):
                fsdp_param.init_dtype_attrs = init_dtype_attrs_torch_2_11
            graphs = dynamo_counters["stats"]["unique_graphs"]
            try:
                recorder = fit(family, lora, ckpt_dir=ckpt_dir, export_dir=export_dir, **settings)
            finally:
                fsdp_param.init_dtype_attrs = init_dtype_attrs
            counts["compiled_graphs"] = dynamo_counters["stats"]["unique_graphs"] - graphs
            out[name] = {
                "steps": recorder.steps,
                "losses": recorder.losses,
                "report": recorder.strategy_report,
                "offload": recorder.offload_stats,
                "codes_sharded": recorder.codes_sharded,
                **counts,  # FSDP2 all-gathers and checkpoint nodes of the whole fit
            }
            if ckpt_dir is not None:
                out[name]["export"] = recorder.export
                first = sorted(ckpt_dir.iterdir())[0]
                out[name]["resumed"] = fit(family, lora, ckpt_path=str(first), **settings).losses
    finally:
        undo()
        _fsdp_param_group.foreach_all_gather = gather
        _LayerNode.forward = staticmethod(node_forward)
    return out


def gpu_parity_and_offload(tmp: Path) -> dict:
    """The CUDA scenario: bf16-mixed with the Triton kernels (LoRA and full fine-tuning of a
    Llama; LoRA of a Qwen3-MoE in NF4, projections and experts, built whole and built on the meta
    device shard by shard), and LoRA with activation offload on and off (float32, layer inputs
    over 1 MiB).

    The offload runs need enough samples that every rank packs full 1024-token batches: with 48
    samples a rank's only batch can be 320 tokens, a 640 KiB layer input that stays below the
    offloader's 1 MiB threshold (nothing offloaded on that rank, as designed)."""
    out: dict = {}
    # Saved before the first fit: once a process group exists, transformers (5.17+) writes
    # save_pretrained's files on global rank 0 only, and the other ranks' directories stay empty.
    checkpoint = tmp / f"checkpoint_{os.environ['RANK']}"
    tiny_model("qwen3_moe", len(build_char_tokenizer()), hidden=256).save_pretrained(checkpoint)
    ops = _op_spy(("rms_norm", "linear_cross_entropy", "fused_lora_forward"))
    for lora in (True, False):
        recorder = fit("llama", lora, precision="bf16-mixed", kernels=True, accelerator="gpu", hidden=256)
        out[lora] = {"steps": recorder.steps, "losses": recorder.losses, "report": recorder.strategy_report}
    # The strategy's defaults for LoRA on a GPU with room: the base kept whole on every rank, the
    # adapters in the root's unit, the node checkpoint.
    recorder = fit(
        "llama",
        True,
        precision="bf16-mixed",
        kernels=True,
        accelerator="gpu",
        hidden=256,
        shard_frozen="auto",
    )
    out["default"] = {"steps": recorder.steps, "losses": recorder.losses, "report": recorder.strategy_report}
    out["ops"] = dict(ops)
    moe = dict(precision="bf16-mixed", kernels=True, accelerator="gpu", hidden=256, quantize="nf4")
    recorder = fit("qwen3_moe", True, **moe)
    out["moe_nf4"] = {"steps": recorder.steps, "losses": recorder.losses, "report": recorder.strategy_report}
    # The same model built on the meta device, each rank quantising its shards from a checkpoint.
    recorder = fit("qwen3_moe", True, meta_weights=str(checkpoint), **moe)
    out["meta_moe_nf4"] = {
        "steps": recorder.steps,
        "losses": recorder.losses,
        "report": recorder.strategy_report,
    }
    for offload in ("off", "on"):
        recorder = fit(
            "llama",
            True,
            kernels=True,
            offload=offload,
            accelerator="gpu",
            hidden=512,
            max_tokens=1024,
            num_train=96 * world_size,  # every rank packs full batches
        )
        out[offload] = {
            "grads": recorder.steps[0].get("grads"),
            "losses": recorder.losses,
            "stats": recorder.offload_stats,
        }
    return out


def sharded_clipping(tmp: Path) -> dict:
    """Norm clipping of sharded gradients (uneven shards, an empty one, float32 and bf16) by torch's
    ``clip_grad_norm_`` on the ``DTensor``\\ s and by :func:`clip_sharded_grads_` on the local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_sloth.plugins.local_shards import clip_sharded_grads_, sharded_grad_norm

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    shapes = [(3, 5), (7,), (16, 4), (1, 9), (6, 6)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=generator).to(d) for s, d in zip(shapes, dtypes)]

    def params(scale: float) -> list[torch.nn.Parameter]:
        out = []
        for g in full:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)]))
            p.grad = distribute_tensor(g * scale, mesh, [Shard(0)])
            out.append(p)
        return out

    result: dict = {}
    for scale, max_norm in ((1.0, 1.0), (1e-3, 1.0)):  # clipped, and left as it is
        ours, theirs = params(scale), params(scale)
        result[(scale, "given")] = [g * scale for g in full]  # in each gradient's dtype
        result[(scale, "float64")] = float(
            torch.stack([g.double().norm() for g in result[(scale, "given")]]).norm()
        )
        result[(scale, "norm")] = float(sharded_grad_norm([p.grad for p in ours]))
        result[(scale, "ours")] = float(clip_sharded_grads_(ours, max_norm))
        result[(scale, "torch")] = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm))
        result[(scale, "grads")] = [
            (a.grad.full_tensor(), b.grad.full_tensor()) for a, b in zip(ours, theirs)
        ]
    plain = [torch.nn.Parameter(torch.zeros(2))]
    plain[0].grad = torch.ones(2)
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    replicated.grad = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    result["declined"] = (clip_sharded_grads_(plain, 1.0), sharded_grad_norm([replicated.grad]))
    return result


def local_shard_steps_cuda(tmp: Path) -> dict:
    """:func:`local_shard_steps` on this rank's GPU over NCCL."""
    return local_shard_steps(tmp, device="cuda")


def local_shard_steps(tmp: Path, device: str = "cpu") -> dict:
    """Three optimizer steps over FSDP2-sharded parameters (uneven and empty shards), stepped on the
    local shards (:func:`stepping_local_shards`) and as ``DTensor``\\ s, for AdamW (foreach and
    fused), Adam with amsgrad and SGD with momentum; one parameter without a gradient in the second
    step. Returns, per optimizer, the largest parameter and state differences and the state types."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_sloth.plugins.local_shards import stepping_local_shards, steps_on_local_shards

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (int(os.environ["WORLD_SIZE"]),))
    shapes = [(3, 5), (7,), (16, 4), (1, 9), (6, 6)]
    optimizers = {
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }

    def sharded() -> list[torch.nn.Parameter]:
        generator = torch.Generator().manual_seed(1)
        module = torch.nn.Module()
        module.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
        )
        fully_shard(module.to(device), mesh=mesh)
        return list(module.parameters())

    result: dict = {}
    for name, make in optimizers.items():
        ours_params, theirs_params = sharded(), sharded()
        ours, theirs = make(ours_params), make(theirs_params)
        generator = torch.Generator().manual_seed(2)
        for step in range(3):
            for index, (a, b) in enumerate(zip(ours_params, theirs_params)):
                grad = torch.randn(a.shape, generator=generator).to(device)
                skip = step == 1 and index == 2
                a.grad = None if skip else distribute_tensor(grad, mesh, [Shard(0)])
                b.grad = None if skip else distribute_tensor(grad, mesh, [Shard(0)])
            with stepping_local_shards(ours):
                ours.step()
            theirs.step()
        param_diff = max(
            float((a.full_tensor() - b.full_tensor()).abs().max()) for a, b in zip(ours_params, theirs_params)
        )
        state_diff, kinds = 0.0, set()
        for a, b in zip(ours_params, theirs_params):
            assert ours.state[a].keys() == theirs.state[b].keys(), (name, ours.state[a].keys())
            for key, value in ours.state[a].items():
                other = theirs.state[b][key]
                kinds.add((key, type(value).__name__, type(other).__name__))
                if isinstance(value, DTensor):
                    assert value.placements == other.placements and value.shape == other.shape
                    value, other = value.full_tensor(), other.full_tensor()
                state_diff = max(state_diff, float((value.float() - other.float()).abs().max()))
        result[name] = {"params": param_diff, "states": state_diff, "kinds": sorted(kinds)}
    result["applies"] = {
        "adamw": steps_on_local_shards(torch.optim.AdamW(sharded())),
        "adagrad": steps_on_local_shards(torch.optim.Adagrad(sharded())),
        "plain": steps_on_local_shards(
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, device=device))])
        ),
    }
    return result
