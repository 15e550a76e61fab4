"""Host time of clipping and one AdamW step over FSDP2-sharded LoRA adapters: torch's ``DTensor``
path against the local shards (``lightning_sloth.plugins.local_shards``), on CPU processes (gloo).

The tensors are Llama-3.2-1B's LoRA adapters in count and shape class (16 layers × 7 projections ×
A and B) at rank 1, so the arithmetic is negligible and what is timed is the host work per tensor::

    python benchmarks/local_shards_bench.py --processes 2 --out benchmarks/results/local_shards_cpu.json

Writes the median milliseconds of ``clip`` and ``step`` per (path, optimizer implementation) and
prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROJECTIONS = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]


def _shapes(layers: int) -> list[tuple[int, int]]:
    return [shape for _ in range(layers) for i, o in PROJECTIONS for shape in ((1, i), (o, 1))]


def _worker(rank: int, world: int, port: int, args, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_sloth.plugins.local_shards import clip_sharded_grads_, stepping_local_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for path in ("dtensor", "local_shards"):
        for impl in ("foreach", "fused"):
            module = torch.nn.Module()
            module.ps = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(s) * 0.01) for s in _shapes(args.layers)]
            )
            fully_shard(module, mesh=mesh)
            params = list(module.parameters())
            optimizer = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
            times: dict[str, list[float]] = {"clip": [], "step": []}
            for iteration in range(args.warmup + args.steps):
                for p in params:
                    p.grad = torch.ones_like(p)
                dist.barrier()
                start = time.perf_counter()
                if path == "local_shards":
                    clip_sharded_grads_(params, 1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                middle = time.perf_counter()
                if path == "local_shards":
                    with stepping_local_shards(optimizer):
                        optimizer.step()
                else:
                    optimizer.step()
                end = time.perf_counter()
                if iteration >= args.warmup:
                    times["clip"].append(middle - start)
                    times["step"].append(end - middle)
            out[f"{path}/{impl}"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(args.processes, port, args, results), nprocs=args.processes)
        timings = dict(results)
    report = {
        "processes": args.processes,
        "tensors": len(_shapes(args.layers)),
        "timed_steps": args.steps,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "milliseconds": timings,
    }
    for name, t in timings.items():
        print(f"{name:24s} clip {t['clip']:6.2f} ms   step {t['step']:6.2f} ms")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
