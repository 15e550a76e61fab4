"""Multi-GPU benchmark: lightning_sloth on one GPU, DDP and FSDP2 vs Lightning's stock FSDP.

Every system trains through a Lightning ``Trainer`` on the same seeded packed rows: each rank
takes its own bins of ``--tokens`` real tokens (weak scaling: the per-GPU work is the same at
every size), bf16 mixed precision, gradient clipping at 1.0, fused AdamW::

    sloth_1gpu   SlothStrategy(kernels=True)                       1 process
    sloth_ddp    SlothDDPStrategy(kernels=True)                    N processes
    sloth_fsdp   SlothFSDPStrategy(kernels=True), its defaults     N processes
                 (LoRA with room on the GPU: the frozen base kept whole on every rank and the
                 adapters in the root's unit, the one-node checkpoint; otherwise sharded and
                 resharded, torch's checkpoint)
    A suffixed name spells the whole configuration; what it does not name is torch's checkpoint,
    resharding after the forward, automatic units and a sharded base (the strategy's defaults
    before they chose):
    sloth_fsdp_no_reshard   reshard_after_forward=False (weights stay gathered from a layer's
                 forward to its backward: one all-gather per layer per step)
    sloth_fsdp_node   checkpoint_impl="node" (each checkpointed layer one autograd node, as on one
                 GPU and under DDP)
    sloth_fsdp_unit4  layers_per_unit=4 (four decoder layers per FSDP2 unit); suffixes combine:
                 sloth_fsdp[_node][_unitN][_no_reshard][_whole_base]
    sloth_fsdp_node_no_reshard_whole_base   ... with shard_frozen=False (a LoRA base kept whole)
    stock_fsdp   ModelParallelStrategy + fully_shard per layer in configure_model (Lightning's
                 FSDP2), transformers' own modules (MoE: ``grouped_mm`` experts, PEFT
                 target_parameters LoRA) and gradient checkpointing, SDPA on the packed rows
    stock_fsdp1  Lightning's FSDPStrategy (FSDP1 flat parameters, one unit per decoder layer,
                 use_orig_params for PEFT), the same modules                  N processes

    python benchmarks/fsdp_bench.py --shape llama_3_2_1b --lora --systems sloth_1gpu,sloth_ddp,sloth_fsdp
    python benchmarks/fsdp_bench.py --shape llama_3_1_8b --systems sloth_fsdp,stock_fsdp --out r.json
    python benchmarks/fsdp_bench.py --shape llama_3_2_1b --finetune lora,full --gpus 1,2,4 \
        --systems sloth_ddp,sloth_fsdp --profile          # a scaling sweep
    python benchmarks/fsdp_bench.py --shape qwen3_30b_a3b --lora --gpus 4 --systems sloth_fsdp,stock_fsdp
    python benchmarks/fsdp_bench.py --shape llama_3_1_70b --lora --quantize nf4 --gpus 4 --systems sloth_fsdp

``--gpus 1,2,4`` runs every system at every size, each size its own set of processes, and records
``scaling_efficiency``: tokens/s per GPU at that size over the same system's at the smallest size
measured. One GPU holds no shards: a ``sloth_fsdp`` system runs there as ``SlothStrategy`` (the
record says ``"ran_as": "sloth_1gpu"``); DDP and the stock systems run their own strategy on one
process. Models larger than ``--meta-init-gib`` of bf16 weights (``--init auto``) are built on the
meta device and each rank makes only its own shards (``SlothFSDPStrategy(meta_weights=...)``,
seeded random weights; the stock peer fills its shards the same way after ``fully_shard``): no
rank ever holds the whole model. ``--quantize nf4`` stores the frozen base in NF4, each rank
quantising only its own shards. MoE shapes take LoRA on attention and experts, and count the
active experts' parameters only in MFU.

Processes start the way torchrun starts them (``WORLD_SIZE``/``RANK``/``LOCAL_RANK``), one fresh
set per system and size. Step time: ``torch.cuda.synchronize`` at the start and end of each training batch
(forward, backward, clipping, optimizer step); warm-up steps excluded; tokens/s per GPU is each
rank's real tokens over its timed steps; MFU counts ``CausalLMModule``'s model FLOPs over the
device's dense bf16 peak. Tokens/s in total is the sum over ranks. Peak memory is per GPU (the largest over ranks). With ``--profile`` each process runs one more
step (the first timed batch again) under the CUDA profiler and records the share of its wall time
with any kernel running, with a compute kernel running, and with an NCCL kernel running (NCCL
kernels also count their wait for the other rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback

SYSTEM_PROCESSES = {"sloth_1gpu": 1, "sloth_ddp": None, "stock_fsdp": None, "stock_fsdp1": None}
STOCK = ("stock_fsdp", "stock_fsdp1")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fsdp_options(system: str) -> dict | None:
    """``SlothFSDPStrategy`` options of a ``sloth_fsdp[_node][_unitN][_no_reshard][_whole_base]``
    system name (``None`` for the other systems): ``{}`` (the strategy's defaults) for plain
    ``sloth_fsdp``; a suffixed name sets ``checkpoint_impl``, ``reshard_after_forward`` and
    ``shard_frozen`` either way (``"torch"``, ``True`` and ``True`` unless it says ``_node`` /
    ``_no_reshard`` / ``_whole_base``), so its records mean what they meant before the defaults
    chose them (``_shard_frozen``, the old spelling of a sharded base, is still read)."""
    if system != "sloth_fsdp" and not system.startswith("sloth_fsdp_"):
        return None
    options: dict = {}
    rest = system.removeprefix("sloth_fsdp")
    if not rest:
        return options
    options |= {"checkpoint_impl": "torch", "reshard_after_forward": True, "shard_frozen": True}
    if rest.startswith("_node"):
        options["checkpoint_impl"] = "node"
        rest = rest.removeprefix("_node")
    if rest.startswith("_unit"):
        digits = rest.removeprefix("_unit").split("_")[0]
        if not digits.isdigit():
            raise ValueError(f"unknown system {system!r}: _unit takes a number of layers")
        options["layers_per_unit"] = int(digits)
        rest = rest.removeprefix(f"_unit{digits}")
    if rest.endswith("_shard_frozen"):
        rest = rest.removesuffix("_shard_frozen")
    elif rest.endswith("_whole_base"):
        options["shard_frozen"] = False
        rest = rest.removesuffix("_whole_base")
    if rest == "_no_reshard":
        options["reshard_after_forward"] = False
    elif rest:
        raise ValueError(f"unknown system {system!r}: sloth_fsdp[_node][_unitN][_no_reshard][_whole_base]")
    return options


def processes(system: str, gpus: int) -> int:
    """How many processes ``system`` trains with."""
    if fsdp_options(system) is not None:
        return gpus
    if system not in SYSTEM_PROCESSES:
        raise ValueError(f"unknown system {system!r}: one of {sorted(SYSTEM_PROCESSES)} or sloth_fsdp[...]")
    return SYSTEM_PROCESSES[system] or gpus


def ran_as(system: str, gpus: int) -> str:
    """The system a run of ``system`` on ``gpus`` GPUs trains as: one GPU holds no shards, so a
    ``sloth_fsdp`` system runs there as ``sloth_1gpu``."""
    return "sloth_1gpu" if gpus == 1 and fsdp_options(system) is not None else system


def gpu_sizes(text: str) -> list[int]:
    """``--gpus``: ``"4"`` or ``"1,2,4"`` (ascending, distinct, positive)."""
    sizes = [int(t) for t in text.split(",")]
    if any(n < 1 for n in sizes) or sizes != sorted(set(sizes)):
        raise ValueError(f"--gpus takes ascending distinct positive counts, got {text!r}")
    return sizes


def add_scaling(records: list[dict]) -> None:
    """``scaling_efficiency`` of every measured record: its tokens/s per GPU over that of the same
    system, shape and fine-tuning at the smallest size measured (1.0 there), or over the
    ``sloth_1gpu`` record of that shape and fine-tuning where the system has no one-GPU record of
    its own (``--systems sloth_1gpu,sloth_fsdp,sloth_fsdp_no_reshard --gpus 4`` measures the one
    GPU once for every variant); in place."""
    base: dict[tuple, tuple[int, float]] = {}
    measured = [r for r in records if "tokens_per_s_per_gpu" in r]
    for r in measured:
        key = (r["system"], r["shape"], r["lora"], r.get("quantize"))
        if key not in base or r["gpus"] < base[key][0]:
            base[key] = (r["gpus"], r["tokens_per_s_per_gpu"])
    for r in measured:
        key = (r["system"], r["shape"], r["lora"], r.get("quantize"))
        one_gpu = base.get(("sloth_1gpu",) + key[1:])
        if base[key][0] > 1 and one_gpu is not None and one_gpu[0] == 1:
            gpus, tps = one_gpu
        else:
            gpus, tps = base[key]
        r["scaling_base_gpus"] = gpus
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / tps


def shape_bf16_gib(shape: str) -> float:
    """GiB of the shape's weights in bf16 (counted on the meta device)."""
    from transformers import AutoModelForCausalLM

    from lightning_sloth.bench.workload import shape_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape, "sdpa"))
    return sum(p.numel() for p in model.parameters()) * 2 / 2**30


def _batches(args, vocab: int, world: int, rank: int) -> list:
    from lightning_sloth.bench.workload import Workload
    from lightning_sloth.data import PackedCollator, pack_best_fit_decreasing

    steps = args.warmup + args.steps
    workload = Workload(
        shape=args.shape,
        tokens_per_step=args.tokens,
        max_len=min(2048, args.tokens),
        median_len=min(250, args.tokens // 4),
        warmup_steps=world * args.warmup,
        timed_steps=world * steps,
    )
    samples = workload.samples(vocab)
    collate = PackedCollator(max_tokens=args.tokens, pad_token_id=0)
    bins = pack_best_fit_decreasing([len(s[0]) for s in samples], args.tokens)
    mine = bins[rank::world][:steps]
    if len(mine) < steps:
        raise RuntimeError(f"only {len(mine)} bins for rank {rank}; {steps} needed")
    return [collate([samples[i] for i in b]) for b in mine]


def _is_moe(shape: str) -> bool:
    from lightning_sloth.bench.workload import MOE_FAMILIES, SHAPE_FAMILIES

    return SHAPE_FAMILIES.get(shape) in MOE_FAMILIES


def _model(args, attn: str, stock: bool, meta: bool):
    """The shape's random-weight model: on the GPU, or on the meta device (``meta``: each rank
    makes its shards later); PEFT LoRA r=16 with ``--lora`` (a MoE shape: attention and experts)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_sloth.bench.workload import MOE_LORA, shape_config

    torch.manual_seed(0)
    config = shape_config(args.shape, attn)
    if stock and _is_moe(args.shape):
        config._experts_implementation = "grouped_mm"  # transformers' fast experts
    device = torch.device("meta" if meta else "cuda" if torch.cuda.is_available() else "cpu")
    # A LoRA base is built in bf16 directly (a 14B float32 copy would not fit beside it).
    dtype = torch.bfloat16 if args.lora else torch.float32
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not args.lora:
        return model  # float32 master weights, bf16 compute
    # frozen bf16 base, float32 adapters (PEFT's default)
    targets = MOE_LORA if _is_moe(args.shape) else {"target_modules": PROJECTIONS}
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, **targets, task_type="CAUSAL_LM"))


def active_flop_parameters(model) -> int:
    """:func:`~lightning_sloth.module.flop_parameters` with a MoE layer's experts counted at
    ``top_k / num_experts`` of their size (the experts a token runs through)."""
    from lightning_sloth.hf_model import find_hf_model
    from lightning_sloth.module import flop_parameters

    config = find_hf_model(model).config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    total = flop_parameters(model)
    if not experts:
        return total
    stacks = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 3 and "lora_" not in n)
    return total - int(stacks * (1 - config.num_experts_per_tok / experts))


def _stock_module_class(fsdp2: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_sloth import CausalLMModule
    from lightning_sloth.hf_model import find_hf_model
    from lightning_sloth.plugins.shard_init import materialize_shards
    from lightning_sloth.quant.loading import RandomWeights

    class StockFSDPModule(CausalLMModule):
        """Lightning's documented FSDP recipes: FSDP2 shards in ``configure_model`` (a meta-device
        model then gets its shards filled, seeded random weights); FSDP1 is wrapped by the strategy."""

        def configure_model(self) -> None:
            super().configure_model()
            model = find_hf_model(self)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not fsdp2:
                return
            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            if any(p.is_meta for p in model.parameters()):
                device = self.trainer.strategy.root_device
                materialize_shards(model, RandomWeights(std=model.config.initializer_range), device)

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ):
            if fsdp2 or not gradient_clip_val:
                return super().configure_gradient_clipping(
                    optimizer, gradient_clip_val, gradient_clip_algorithm
                )
            # Lightning's FSDPPrecision refuses to clip by norm: FSDP1's root module clips its shards.
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)

        def configure_optimizers(self):
            # Lightning's MixedPrecision refuses to clip the gradients of an optimizer that
            # unscales inside its step (fused AdamW), so the stock recipe steps foreach AdamW.
            params = [p for p in self.model.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=self.optim.lr, foreach=True)

    return StockFSDPModule


class StepTimer(Callback):
    """Synchronised wall time, real tokens, FLOPs and loss of every training batch."""

    def __init__(self) -> None:
        self.times, self.tokens, self.flops, self.losses = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _synchronize()
        self.times.append(time.perf_counter() - self._start)
        self.tokens.append(batch.num_tokens)
        self.flops.append(pl_module.flops_per_batch)
        self.losses.append(float(outputs["loss"]))


class ProfiledStep(Callback):
    """Profile one training batch (CUDA activity): wall time and the shares of it with any kernel,
    a compute kernel, or an NCCL kernel running."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx, self.result = batch_idx, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            _synchronize()
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.__enter__()
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.batch_idx:
            return
        from lightning_sloth.bench.measure import gpu_busy_ms

        _synchronize()
        wall_ms = (time.perf_counter() - self._start) * 1e3
        self._profiler.__exit__(None, None, None)
        events = [e for e in self._profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        nccl = [e for e in events if "nccl" in e.name.lower()]
        compute = [e for e in events if "nccl" not in e.name.lower()]
        self.result = {
            "profiled_step_ms": wall_ms,
            "gpu_busy_share": gpu_busy_ms(events) / wall_ms,
            "compute_busy_share": gpu_busy_ms(compute) / wall_ms,
            "nccl_busy_share": gpu_busy_ms(nccl) / wall_ms,
        }


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strategy(system: str, world: int, args, meta: bool, decoder_layer: type):
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lightning_sloth import SlothDDPStrategy, SlothFSDPStrategy, SlothStrategy
    from lightning_sloth.quant.loading import RandomWeights

    sloth = dict(kernels=True, offload=args.offload)
    sharded = fsdp_options(system)
    if sharded is not None:
        return SlothFSDPStrategy(meta_weights=RandomWeights() if meta else None, **sloth, **sharded)
    if system == "stock_fsdp1":
        # PEFT mixes frozen and trained parameters in a unit: FSDP1 needs use_orig_params.
        return FSDPStrategy(
            auto_wrap_policy={decoder_layer}, use_orig_params=True, sharding_strategy="FULL_SHARD"
        )
    return {
        "sloth_1gpu": lambda: SlothStrategy(**sloth),
        "sloth_ddp": lambda: SlothDDPStrategy(**sloth),
        "stock_fsdp": lambda: ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    }[system]()


def _worker(rank: int, world: int, port: int, system: str, args, out_dir: str) -> None:
    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    from dataclasses import asdict

    from lightning.pytorch import Trainer, seed_everything

    from lightning_sloth import CausalLMModule, OptimizerSettings, SlothPrecision
    from lightning_sloth.hf_model import find_decoder_layers
    from lightning_sloth.plugins import GradientFlowGuard

    seed_everything(0, verbose=False)
    result: dict = {"system": system, "rank": rank, "world": world}
    try:
        stock = system in STOCK
        model = _model(args, "sdpa", stock, args.meta)
        vocab = model.config.vocab_size
        optimizer = OptimizerSettings(lr=1e-4 if args.lora else 1e-5, scheduler="constant")
        # The model is PEFT-wrapped already (as built above); CausalLMModule takes it as is.
        module = (_stock_module_class(system == "stock_fsdp") if stock else CausalLMModule)(
            model, optimizer=optimizer
        )
        module._flop_params = active_flop_parameters(model)  # MoE: the experts a token runs through
        strategy = _strategy(system, world, args, args.meta, type(find_decoder_layers(model)[0]))
        timer = StepTimer()
        guard = GradientFlowGuard(every_n_steps=args.warmup + args.steps - 1)
        profiled = ProfiledStep(args.warmup + args.steps) if args.profile and cuda else None
        trainer = Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=world,
            strategy=strategy,
            precision="bf16-mixed" if stock else None,
            plugins=None if stock else [SlothPrecision("bf16-mixed", quantize=args.quantize)],
            callbacks=[timer, guard] + ([profiled] if profiled else []),
            max_steps=args.warmup + args.steps + (1 if profiled else 0),
            gradient_clip_val=1.0,
            use_distributed_sampler=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        batches = _batches(args, vocab, world, rank)
        if profiled:
            batches.append(batches[args.warmup])
        loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
        trainer.fit(module, train_dataloaders=loader)
        timed = slice(args.warmup, args.warmup + args.steps)
        times, tokens, flops = timer.times[timed], timer.tokens[timed], timer.flops[timed]
        result |= {
            "tokens_per_s_per_gpu": sum(tokens) / sum(times),
            "median_step_s": statistics.median(times),
            "tokens_per_step_per_gpu": statistics.median(tokens),
            "mfu": sum(flops) / sum(times) / (args.peak_tflops * 1e12),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
            "first_loss": timer.losses[0],
            "last_loss": timer.losses[timed][-1],
            "grad_norm_last_step": guard.last_grad_norm,
            "timed_steps": len(times),
            "applied": list(getattr(getattr(strategy, "sloth_report", None), "applied", []) or []),
        }
        if getattr(strategy, "shard_stats", None) is not None:
            result["shard_stats"] = asdict(strategy.shard_stats)
        if profiled:
            result |= profiled.result
    except torch.OutOfMemoryError as error:
        result |= {"error": f"out of memory: {str(error).splitlines()[0]}"}
    except Exception as error:  # recorded, so the other systems still run
        import traceback

        result |= {
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc()[-3000:],
        }
    Path(out_dir, f"{system}_{rank}.json").write_text(json.dumps(result))


def run_system(system: str, args, gpus: int | None = None) -> dict:
    """One system at one size (``gpus``, default ``args.gpus``'s largest), in its own processes;
    the ranks' records merged (peak memory: the largest; tokens/s per GPU: the mean; in total: the sum)."""
    gpus = gpus or gpu_sizes(str(args.gpus))[-1]
    world = processes(system, gpus)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker,
            args=(world, free_port(), system, args, out_dir),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        deadline = time.monotonic() + args.system_timeout
        # A rank that failed leaves the others waiting in a collective: stop them at the deadline.
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                break
        files = [Path(out_dir, f"{system}_{r}.json") for r in range(world)]
        ranks = [json.loads(f.read_text()) for f in files if f.is_file()]
        if len(ranks) < world:
            failed = [r["error"] for r in ranks if "error" in r]  # why the others were left waiting
            timed_out = time.monotonic() > deadline
            why = f"timed out after {args.system_timeout} s" if timed_out else "a rank wrote no result"
            return {"system": system, "world": world, "error": "; ".join([why, *failed])}
    merged = next((r for r in ranks if "error" in r), ranks[0]).copy()
    merged.pop("rank")
    if "error" not in merged:
        merged["peak_allocated_gib"] = max(r["peak_allocated_gib"] for r in ranks)
        merged["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in ranks)
        merged["tokens_per_s_per_gpu"] = statistics.mean(r["tokens_per_s_per_gpu"] for r in ranks)
        merged["tokens_per_s_total"] = sum(r["tokens_per_s_per_gpu"] for r in ranks)
        merged["mfu"] = statistics.mean(r["mfu"] for r in ranks)
        for key in ("gpu_busy_share", "compute_busy_share", "nccl_busy_share"):
            if key in merged:
                merged[key] = statistics.mean(r[key] for r in ranks)
        if "shard_stats" in merged:
            merged["shard_stats_per_rank"] = [r["shard_stats"] for r in ranks]
    return merged


def _plan(args) -> list[tuple[str, int, str]]:
    """``(system, gpus, trains as)`` of every run, in order; refuses unknown names and impossible
    runs before any starts."""
    plan = []
    for system in args.systems.split(","):
        processes(system, 1)  # an unknown name stops before any system runs
        if args.quantize and system in STOCK:
            raise ValueError(
                f"{system} has no 4-bit base weights: --quantize is for lightning_sloth's systems"
            )
        if args.meta and system in ("sloth_1gpu", "sloth_ddp", "stock_fsdp1"):
            raise ValueError(
                f"{system} holds the whole model on each GPU: --init meta shards it (sloth_fsdp, stock_fsdp)"
            )
        sizes = [1] if system == "sloth_1gpu" else gpu_sizes(str(args.gpus))
        plan += [(system, gpus, ran_as(system, gpus)) for gpus in sizes]
    return plan


def main(argv: list[str] | None = None) -> dict:
    from lightning_sloth.bench.measure import environment
    from lightning_sloth.bench.workload import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on the 7 projections (else full)")
    parser.add_argument("--finetune", default=None, help="lora, full or lora,full (overrides --lora)")
    parser.add_argument("--quantize", default=None, choices=["nf4", "fp4"], help="4-bit frozen base (LoRA)")
    parser.add_argument("--systems", default="sloth_1gpu,sloth_ddp,sloth_fsdp")
    parser.add_argument("--gpus", default="2", help="GPUs per run, or an ascending list: 1,2,4")
    parser.add_argument("--tokens", type=int, default=16384, help="real-token budget per GPU per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--offload", default="off", choices=["off", "on", "auto"], help="activation offload")
    parser.add_argument(
        "--init", default="auto", choices=["auto", "full", "meta"], help="meta: per-rank shards"
    )
    parser.add_argument("--meta-init-gib", type=float, default=40.0, help="--init auto: meta above this")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    parser.add_argument("--system-timeout", type=float, default=180, help="seconds per system and size")
    parser.add_argument("--profile", action="store_true", help="one more step, profiled (CUDA)")
    parser.add_argument("--git-commit", default=None, help="recorded with each result")
    parser.add_argument("--out", default=None, help="JSON file; results of earlier runs in it are kept")
    args = parser.parse_args(argv)
    finetunes = (args.finetune or ("lora" if args.lora else "full")).split(",")
    if not set(finetunes) <= {"lora", "full"}:
        raise ValueError(f"--finetune takes lora, full or lora,full, got {args.finetune!r}")
    if args.quantize and finetunes != ["lora"]:
        raise ValueError("--quantize stores the frozen base in 4 bits: it trains LoRA only (--lora)")
    gpu_sizes(args.gpus)
    args.meta = args.init == "meta" or (
        args.init == "auto" and shape_bf16_gib(args.shape) > args.meta_init_gib
    )
    plan = _plan(args)

    out = Path(args.out) if args.out else None
    report = (
        json.loads(out.read_text()) if out and out.is_file() else {"environment": environment(), "runs": []}
    )
    records = []
    for finetune in finetunes:
        args.lora = finetune == "lora"
        for system, gpus, trains_as in plan:
            if args.meta and gpus == 1:
                result = {
                    "system": system,
                    "world": 1,
                    "error": "a model built per shard (--init meta) needs >= 2 GPUs",
                }
            else:
                result = run_system(trains_as, args, gpus) | {"system": system}
            result |= {"shape": args.shape, "lora": args.lora, "gpus": gpus, "quantize": args.quantize}
            result |= {
                "warmup_steps": args.warmup,
                "tokens_budget_per_gpu": args.tokens,
                "init": "meta" if args.meta else "full",
            }
            if trains_as != system:
                result["ran_as"] = trains_as
            if args.git_commit:
                result["git_commit"] = args.git_commit
            records.append(result)
            report["runs"].append(result)
            add_scaling(records)
            print(json.dumps(result), flush=True)
            if out:
                out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
