"""Probe: would expert parallelism beat FSDP2 of the experts for Qwen3-30B-A3B on four GPUs?

Under ``sloth_fsdp`` every rank runs every expert on its own tokens and FSDP2 all-gathers one
layer's expert stacks (``[E, 2I, H]`` and ``[E, H, I]``, bf16) before its forward and again before
its backward (``reshard_after_forward``; the checkpoint's recompute reuses the backward's gather),
prefetched while the previous layer computes. Expert parallelism would keep ``E / W`` experts per
rank and move tokens instead: an all-to-all dispatching each token's hidden state to the ranks of
its experts and one combining the outputs, in the forward, again in the recompute, and twice in
the backward (the gradients of both), with the expert GEMMs waiting on them.

Per layer and step this probe times, with NCCL on ``--gpus`` GPUs::

    all-gather     one layer's expert weights (each rank holds 1/W)       x 2 per step (FSDP2)
    all-to-all     16k tokens x hidden x copies, bf16, split evenly      x 6 per step (EP)
    compute        one MoE block (router + "sloth" experts) forward + backward on 16k tokens, one GPU

``copies``: 1 (each token to one rank), the expected number of distinct ranks a top-8 token
reaches over 4 ranks of 32 experts (3.6, measured as 4), and 8 (one copy per expert, no
de-duplication). FSDP2's gathers are prefetched under the previous layer's compute: what they add
to a step is ``max(0, 2 x all-gather - layer compute)``, and the layer's compute is at least the MoE
block's forward + backward (plus the recompute's forward). EP's all-to-alls wait on the router and
feed the expert GEMMs: all ``6 x all-to-all`` is added. EP is worth building only if it adds less.

    python benchmarks/ep_probe.py --gpus 4            # JSON under $OUT (or benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_ms(fn, warmup: int, iters: int, barrier: bool = True) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if barrier:
            dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _moe_block_ms(args) -> float:
    """Forward + backward of one Qwen3-30B-A3B MoE block (router + "sloth" experts, frozen, bf16) on
    ``args.tokens`` tokens."""
    from transformers import AutoModelForCausalLM

    from lightning_sloth.bench.workload import shape_config
    from lightning_sloth.patching import apply_experts

    config = shape_config("qwen3_30b_a3b")
    config.num_hidden_layers = 1
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    apply_experts(model)
    block = model.model.layers[0].mlp.requires_grad_(False)
    x = torch.randn(1, args.tokens, args.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return _time_ms(step, args.warmup, args.iters, barrier=False)


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    try:
        result: dict = {}
        experts, hidden, inter = args.experts, args.hidden, args.moe_intermediate
        layer_elements = experts * (2 * inter * hidden + hidden * inter)
        shard = torch.randn(-(-layer_elements // world), dtype=torch.bfloat16, device="cuda")
        gathered = torch.empty(shard.numel() * world, dtype=torch.bfloat16, device="cuda")
        result["all_gather_ms"] = _time_ms(
            lambda: dist.all_gather_into_tensor(gathered, shard), args.warmup, args.iters
        )
        result["all_gather_bytes"] = gathered.numel() * 2
        for copies in args.copies:
            rows = args.tokens * copies // world * world
            send = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
            recv = torch.empty_like(send)
            result[f"all_to_all_ms_copies_{copies}"] = _time_ms(
                lambda send=send, recv=recv: dist.all_to_all_single(recv, send), args.warmup, args.iters
            )
            result[f"all_to_all_bytes_copies_{copies}"] = send.numel() * 2
        if rank == 0:  # the compute the gathers hide under, measured alone
            result["moe_block_fwd_bwd_ms"] = _moe_block_ms(args)
        dist.barrier()
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _collective_figures(ranks: list[dict]) -> tuple[dict, dict]:
    """Each collective's median time (the slowest rank's: it sets the pace) and its bytes, by name."""
    timed = {k: max(r[k] for r in ranks) for k in ranks[-1] if "_ms" in k}
    sizes = {k: ranks[0][k] for k in ranks[0] if "_bytes" in k}
    return timed, sizes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--copies", default="1,4,8", help="copies of each token sent (routing fan-out)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.copies = [int(c) for c in args.copies.split(",")]
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} CUDA GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker, args=(args.gpus, _free_port(), args, out_dir), nprocs=args.gpus, start_method="spawn"
        )
        ranks = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(args.gpus)]
    timed, sizes = _collective_figures(ranks)
    compute_ms = ranks[0]["moe_block_fwd_bwd_ms"]
    fsdp_ms = 2 * timed["all_gather_ms"]
    fsdp_added = max(0.0, fsdp_ms - compute_ms)  # prefetched under at least this much compute
    verdicts = {}
    for copies in args.copies:
        ep_ms = 6 * timed[f"all_to_all_ms_copies_{copies}"]
        verdicts[str(copies)] = {
            "ep_ms_per_layer_step": ep_ms,
            "ep_wins_on_communication": ep_ms < fsdp_ms,
            "ep_adds_less_to_a_step": ep_ms < fsdp_added,
        }
    report = {
        "environment": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "gpus": args.gpus,
        },
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "median_ms": timed,
        "bytes": sizes,
        "moe_block_fwd_bwd_ms": compute_ms,
        "fsdp2_ms_per_layer_step": fsdp_ms,
        "fsdp2_ms_added_per_layer_step": fsdp_added,
        "expert_parallel": verdicts,
    }
    out = Path(args.out or Path(os.environ.get("OUT", "benchmarks/results")) / "ep_probe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
