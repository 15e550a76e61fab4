"""Multi-GPU benchmark: lightning_sloth on one GPU, DDP and FSDP2 vs Lightning's stock FSDP2.

Every system trains through a Lightning ``Trainer`` on the same seeded packed rows: each rank
takes its own bins of ``--tokens`` real tokens (weak scaling: the per-GPU work is the same for one
and two GPUs), bf16 mixed precision, gradient clipping at 1.0, fused AdamW::

    sloth_1gpu   SlothStrategy(kernels=True)                       1 process
    sloth_ddp    SlothDDPStrategy(kernels=True)                    N processes
    sloth_fsdp   SlothFSDPStrategy(kernels=True)                   N processes
    sloth_fsdp_no_reshard   the same with reshard_after_forward=False (weights stay gathered
                 from a layer's forward to its backward: one all-gather per layer per step)
    sloth_fsdp_node   SlothFSDPStrategy(kernels=True, checkpoint_impl="node") (each checkpointed
                 layer one autograd node, as on one GPU and under DDP)
    sloth_fsdp_unit4  layers_per_unit=4 (four decoder layers per FSDP2 unit); suffixes combine:
                 sloth_fsdp[_node][_unitN][_no_reshard]
    stock_fsdp   ModelParallelStrategy + fully_shard per layer in configure_model, transformers'
                 own modules and gradient checkpointing, SDPA on the packed rows  N processes

    python benchmarks/fsdp_bench.py --shape llama_3_2_1b --lora --systems sloth_1gpu,sloth_ddp,sloth_fsdp
    python benchmarks/fsdp_bench.py --shape llama_3_1_8b --systems sloth_fsdp,stock_fsdp --out r.json

Processes start the way torchrun starts them (``WORLD_SIZE``/``RANK``/``LOCAL_RANK``), one fresh
set per system. Step time: ``torch.cuda.synchronize`` at the start and end of each training batch
(forward, backward, clipping, optimizer step); warm-up steps excluded; tokens/s per GPU is each
rank's real tokens over its timed steps; MFU counts ``CausalLMModule``'s model FLOPs over the
device's dense bf16 peak. Peak memory is per GPU (the largest over ranks). With ``--profile`` each process runs one more
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

SYSTEM_PROCESSES = {"sloth_1gpu": 1, "sloth_ddp": None, "stock_fsdp": None}


def fsdp_options(system: str) -> dict | None:
    """``SlothFSDPStrategy`` options of a ``sloth_fsdp[_node][_unitN][_no_reshard]`` system name
    (``None`` for the other systems)."""
    if system != "sloth_fsdp" and not system.startswith("sloth_fsdp_"):
        return None
    options: dict = {}
    rest = system.removeprefix("sloth_fsdp")
    if rest.startswith("_node"):
        options["checkpoint_impl"] = "node"
        rest = rest.removeprefix("_node")
    if rest.startswith("_unit"):
        digits = rest.removeprefix("_unit").split("_")[0]
        if not digits.isdigit():
            raise ValueError(f"unknown system {system!r}: _unit takes a number of layers")
        options["layers_per_unit"] = int(digits)
        rest = rest.removeprefix(f"_unit{digits}")
    if rest == "_no_reshard":
        options["reshard_after_forward"] = False
    elif rest:
        raise ValueError(f"unknown system {system!r}: sloth_fsdp[_node][_unitN][_no_reshard]")
    return options


def processes(system: str, gpus: int) -> int:
    """How many processes ``system`` trains with."""
    if fsdp_options(system) is not None:
        return gpus
    if system not in SYSTEM_PROCESSES:
        raise ValueError(f"unknown system {system!r}: one of {sorted(SYSTEM_PROCESSES)} or sloth_fsdp[...]")
    return SYSTEM_PROCESSES[system] or gpus


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


def _model(args, attn: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_sloth.bench.workload import shape_config

    torch.manual_seed(0)
    config = shape_config(args.shape, attn)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run only
    # A LoRA base is built in bf16 directly (a 14B float32 copy would not fit beside it).
    dtype = torch.bfloat16 if args.lora else torch.float32
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not args.lora:
        return model  # float32 master weights, bf16 compute
    # frozen bf16 base, float32 adapters (PEFT's default)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=projections, task_type="CAUSAL_LM")
    )


def _stock_module_class():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_sloth import CausalLMModule
    from lightning_sloth.hf_model import find_hf_model

    class StockFSDPModule(CausalLMModule):
        """Lightning's documented FSDP2 recipe: shard in ``configure_model``, transformers' modules."""

        def configure_model(self) -> None:
            super().configure_model()
            model = find_hf_model(self)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)

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
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_sloth import (
        CausalLMModule,
        OptimizerSettings,
        SlothDDPStrategy,
        SlothFSDPStrategy,
        SlothPrecision,
        SlothStrategy,
    )
    from lightning_sloth.plugins import GradientFlowGuard

    seed_everything(0, verbose=False)
    result: dict = {"system": system, "rank": rank, "world": world}
    try:
        stock = system == "stock_fsdp"
        model = _model(args, "sdpa")
        vocab = model.config.vocab_size
        optimizer = OptimizerSettings(lr=1e-4 if args.lora else 1e-5, scheduler="constant")
        # The model is PEFT-wrapped already (as built above); CausalLMModule takes it as is.
        module = (_stock_module_class() if stock else CausalLMModule)(model, optimizer=optimizer)
        sharded = fsdp_options(system)
        strategy = (
            SlothFSDPStrategy(kernels=True, **sharded)
            if sharded is not None
            else {
                "sloth_1gpu": lambda: SlothStrategy(kernels=True),
                "sloth_ddp": lambda: SlothDDPStrategy(kernels=True),
                "stock_fsdp": lambda: ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            }[system]()
        )
        timer = StepTimer()
        guard = GradientFlowGuard(every_n_steps=args.warmup + args.steps - 1)
        profiled = ProfiledStep(args.warmup + args.steps) if args.profile and cuda else None
        trainer = Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=world,
            strategy=strategy,
            precision="bf16-mixed" if stock else None,
            plugins=None if stock else [SlothPrecision("bf16-mixed")],
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
        if profiled:
            result |= profiled.result
    except torch.OutOfMemoryError as error:
        result |= {"error": f"out of memory: {str(error).splitlines()[0]}"}
    except Exception as error:  # recorded, so the other systems still run
        result |= {"error": f"{type(error).__name__}: {error}"[:2000]}
    Path(out_dir, f"{system}_{rank}.json").write_text(json.dumps(result))


def run_system(system: str, args) -> dict:
    world = processes(system, args.gpus)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker,
            args=(world, free_port(), system, args, out_dir),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        deadline = time.monotonic() + args.system_timeout
        # A rank that failed leaves the other waiting in a collective: stop both at the deadline.
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                return {"system": system, "world": world, "error": f"timed out after {args.system_timeout} s"}
        files = [Path(out_dir, f"{system}_{r}.json") for r in range(world)]
        ranks = [json.loads(f.read_text()) for f in files if f.is_file()]
        if len(ranks) < world:
            return {"system": system, "world": world, "error": "a rank wrote no result"}
    merged = next((r for r in ranks if "error" in r), ranks[0]).copy()
    merged.pop("rank")
    if "error" not in merged:
        merged["peak_allocated_gib"] = max(r["peak_allocated_gib"] for r in ranks)
        merged["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in ranks)
        merged["tokens_per_s_per_gpu"] = statistics.mean(r["tokens_per_s_per_gpu"] for r in ranks)
        merged["mfu"] = statistics.mean(r["mfu"] for r in ranks)
        for key in ("gpu_busy_share", "compute_busy_share", "nccl_busy_share"):
            if key in merged:
                merged[key] = statistics.mean(r[key] for r in ranks)
    return merged


def main(argv: list[str] | None = None) -> dict:
    from lightning_sloth.bench.measure import environment
    from lightning_sloth.bench.workload import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on the 7 projections (else full)")
    parser.add_argument("--systems", default="sloth_1gpu,sloth_ddp,sloth_fsdp")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384, help="real-token budget per GPU per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    parser.add_argument("--system-timeout", type=float, default=180, help="seconds per system")
    parser.add_argument("--profile", action="store_true", help="one more step, profiled (CUDA)")
    parser.add_argument("--git-commit", default=None, help="recorded with each result")
    parser.add_argument("--out", default=None, help="JSON file; results of earlier runs in it are kept")
    args = parser.parse_args(argv)

    out = Path(args.out) if args.out else None
    report = (
        json.loads(out.read_text()) if out and out.is_file() else {"environment": environment(), "runs": []}
    )
    systems = args.systems.split(",")
    for system in systems:
        processes(system, args.gpus)  # an unknown name stops before any system runs
    for system in systems:
        result = run_system(system, args)
        result |= {"shape": args.shape, "lora": args.lora, "gpus": processes(system, args.gpus)}
        result |= {"warmup_steps": args.warmup, "tokens_budget_per_gpu": args.tokens}
        if args.git_commit:
            result["git_commit"] = args.git_commit
        report["runs"].append(result)
        print(json.dumps(result), flush=True)
        if out:
            out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
