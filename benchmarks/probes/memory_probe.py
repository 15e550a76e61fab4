"""Where the peak GPU memory of one training step goes: the live allocations at the peak, by site.

Trains one system of ``lightning_sloth.bench`` (same model shape, workload and optimizer) for a few
steps, records the CUDA caching allocator's history during the last one
(``torch.cuda.memory._record_memory_history``), replays the allocations and frees to find the moment
of the highest allocated total, and groups what is alive then by the code that allocated it::

    python benchmarks/probes/memory_probe.py --system sloth_kernels_offload --out mem.json
    python benchmarks/probes/memory_probe.py --system sloth_kernels --snapshot step.pickle --out mem.json

``--snapshot`` also writes the raw snapshot, which https://pytorch.org/memory_viz displays.
Memory allocated before the recorded step (weights, optimizer state, pinned-pool bookkeeping) is
reported as ``before_step_bytes`` with the model's parameter bytes split out.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from collections.abc import Iterable

# Frames from these files say *how* something was called, not *what* asked for the memory.
_PLUMBING = (
    "torch/autograd/",
    "torch/utils/checkpoint.py",
    "torch/_ops.py",
    "torch/_library/",
    "torch/nn/modules/module.py",
    "torch/_compile.py",
    "torch/_dynamo/",
    "torch/utils/_contextlib.py",
    "torch/_tensor.py",
    "lightning_sloth/ops/_registry.py",
    "lightning_sloth/kernels/_utils.py",
    "contextlib.py",
    "functools.py",
    "<",
)


def allocation_site(frames: Iterable[dict], depth: int = 2) -> str:
    """The innermost ``depth`` frames that are not call plumbing, as ``file:line fn < file:line fn``."""
    picked = []
    for frame in frames:
        filename = frame.get("filename", "?")
        if any(part in filename for part in _PLUMBING):
            continue
        short = "/".join(filename.split("/")[-2:])
        picked.append(f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}")
        if len(picked) == depth:
            break
    return " < ".join(picked) if picked else "(no python frame)"


def peak_breakdown(trace: list[dict], top: int = 15) -> dict:
    """Replay one device's allocator trace and describe the moment of the highest allocated total.

    Args:
        trace: ``torch.cuda.memory._snapshot()["device_traces"][device]``: dicts with ``action``
            (``alloc``, ``free_completed``, ...), ``addr``, ``size`` and ``frames``.
        top: Sites to list.

    Returns:
        ``peak_bytes`` (over what was allocated before recording began), ``peak_event`` (index into
        the trace), ``peak_site`` (who allocated the block that made the peak) and ``sites``: the
        ``top`` allocation sites alive at the peak with their bytes and block counts, largest first.
    """
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_event, peak_live, peak_site = -1, {}, ""
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            site = allocation_site(event.get("frames", []))
            live[event["addr"]] = (event["size"], site)
            total += event["size"]
            if total > peak:
                peak, peak_event, peak_live, peak_site = total, index, dict(live), site
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in peak_live.values():
        sites[site][0] += size
        sites[site][1] += 1
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return {
        "peak_bytes": peak,
        "peak_event": peak_event,
        "peak_site": peak_site,
        "sites": [{"site": s, "bytes": b, "blocks": n} for s, (b, n) in ranked],
    }


def main(argv: list[str] | None = None) -> dict:
    import torch

    from lightning_sloth.bench.measure import environment, forward_backward, make_optimizer, stage_batch
    from lightning_sloth.bench.systems import resolve_system
    from lightning_sloth.bench.workload import SHAPES, Workload

    parser = argparse.ArgumentParser(description="peak-memory breakdown of one training step (CUDA)")
    parser.add_argument("--system", default="sloth_kernels_offload")
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3, help="steps run; the last one is recorded")
    parser.add_argument(
        "--record-steps",
        type=int,
        default=1,
        help="record this many last steps; the peak is over all of them",
    )
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--snapshot", default=None, help="also write the raw allocator snapshot here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the memory probe needs a CUDA GPU")

    workload = Workload(
        shape=args.shape, tokens_per_step=args.tokens_per_step, warmup_steps=args.steps, timed_steps=0
    )
    samples = workload.samples(SHAPES[args.shape].get("vocab_size", 32000))
    setup, batches = resolve_system(args.system)
    model = setup(workload).train()
    optimizer = make_optimizer(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    report: dict = {"environment": environment(), "system": args.system, "shape": args.shape}
    for step, (micro_batches, *_rest, targets) in enumerate(batches(workload, samples, 0)):
        if step == args.steps:
            break
        record = step >= args.steps - args.record_steps
        micro_batches, num_items = stage_batch(micro_batches, targets)
        torch.cuda.synchronize()
        if step == args.steps - args.record_steps:
            report["before_step_bytes"] = torch.cuda.memory_allocated()
            report["parameter_bytes"] = param_bytes
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        # Recording Python stacks breaks checkpointing's early stop on torch 2.11 (pytorch#179536:
        # "apply ... returned NULL without setting an exception"), so the recorded step recomputes
        # whole layers; the recomputed tail's outputs are freed at once.
        with torch.utils.checkpoint.set_checkpoint_early_stop(not record):
            forward_backward(model, micro_batches, num_items, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if args.snapshot:
        with open(args.snapshot, "wb") as fh:
            pickle.dump(snapshot, fh)
    device = torch.cuda.current_device()
    breakdown = peak_breakdown(snapshot["device_traces"][device], args.top)
    report |= breakdown
    report["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)

    gib = 2**30
    print(
        f"{args.system}: peak {report['max_memory_allocated_bytes'] / gib:.2f} GiB = before the step "
        f"{report['before_step_bytes'] / gib:.2f} GiB (parameters {param_bytes / gib:.2f}) + step "
        f"{breakdown['peak_bytes'] / gib:.2f} GiB; peak reached at: {breakdown['peak_site']}"
    )
    for row in breakdown["sites"]:
        print(f"  {row['bytes'] / 2**20:9.1f} MiB {row['blocks']:5d} blocks  {row['site']}")
    return report


if __name__ == "__main__":
    main()
