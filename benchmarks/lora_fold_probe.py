"""Probe: one grouped LoRA node (``_SharedInputLora``) on a Llama-3.2-1B shape's 16k-token row, its
``B`` products folded into the base products (``[x | x A^T] [W | s B]^T``) or added after them.

    python benchmarks/lora_fold_probe.py  # writes $OUT/lora_fold_probe.json

Forward and backward times per group (CUDA events, 3 warm-up + 20 timed), each way measured twice
in alternation; the largest output difference and gradient difference between the two ways (bf16).
Both ways are forced for both groups (``WIDE_OUTPUTS_PER_INPUT = 0``), so the q/k/v group shows why
the default leaves it as it is.
"""

from __future__ import annotations

import json
import os

import torch

from lightning_sloth.ops import lora_groups as lora

ROWS, INPUTS, RANK = 16384, 2048, 16
GROUPS = {"qkv": (2048, 512, 512), "gate_up": (8192, 8192)}
WAYS = [("separate", float("inf")), ("folded", 4), ("separate2", float("inf")), ("folded2", 4)]


def _bf16(*shape, scale=1.0, grad=False):
    return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale).requires_grad_(grad)


def _time(run, steps: int = 20) -> tuple[float, float]:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    forward = backward = 0.0
    for _ in range(steps):
        run(events)
        torch.cuda.synchronize()
        forward += events[0].elapsed_time(events[1])
        backward += events[1].elapsed_time(events[2])
    return forward / steps, backward / steps


def probe_group(outs: tuple[int, ...]) -> dict:
    x = _bf16(ROWS, INPUTS, grad=True)
    weights = [_bf16(o, INPUTS, scale=0.02) for o in outs]
    adapters_a = [_bf16(RANK, INPUTS, scale=0.02, grad=True) for _ in outs]
    adapters_b = [_bf16(o, RANK, scale=0.02, grad=True) for o in outs]
    grads = [_bf16(ROWS, o) for o in outs]
    leaves = (x, *adapters_a, *adapters_b)
    scales = (2.0,) * len(outs)

    def run(events=None):
        if events:
            events[0].record()
        ys = lora._SharedInputLora.apply(x, scales, *weights, *adapters_a, *adapters_b)
        if events:
            events[1].record()
        got = torch.autograd.grad(ys, leaves, grads)
        if events:
            events[2].record()
        return ys, got

    row, reference = {}, None
    lora.WIDE_OUTPUTS_PER_INPUT = 0
    for label, rows_per_input in WAYS:
        lora.WIDE_ROWS_PER_INPUT = rows_per_input
        ys, got = run()
        if reference is None:
            reference = (ys, got)
        elif label == "folded":
            row["max_out_diff"] = max(float((a - b).abs().max()) for a, b in zip(ys, reference[0]))
            row["max_grad_rel"] = max(
                float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, reference[1])
            )
        row[label + "_fwd_ms"], row[label + "_bwd_ms"] = _time(run)
    return row


def main() -> None:
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name, outs in GROUPS.items():
        row = {"group": name, **probe_group(outs)}
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "lora_fold_probe.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
