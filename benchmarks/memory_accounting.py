"""Every GiB of a training step by category: what the model holds, and what the step adds at its peak.

Two parts. What lives on the device before the step is counted from the objects that own it::

    4-bit weights          Linear4bit codes, block scales and code books
    compute-dtype weights  every other frozen parameter (embeddings, lm head, norms) and buffers
                           (rotary tables)
    LoRA parameters        the trainable parameters
    optimizer state        the optimizer's per-parameter tensors (AdamW: two float32 moments)
    dequant buffer         the 4-bit layers' shared dequantisation scratch (ops/nf4.py)

What the step adds at its peak comes from the CUDA allocator's history (``torch.cuda.memory``, as
``benchmarks/probes/memory_probe.py`` records it): the allocations alive at the highest allocated
total, each put in a category by the code that allocated it (:func:`category_of`)::

    loss, MLP intermediates, attention, LoRA products, 4-bit products, layer inputs and hidden
    states (the checkpoint inputs and the residual stream), gradients, optimizer state, other

``allocator fragmentation`` is the reserved bytes at the peak over the allocated ones. On a CPU
(the test at tiny size) only the first part is measured; the step's rows read ``null``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

GIB = 2**30

# (category, substrings of an allocation site, first match wins); sites are "file:line fn < ..."
_SITE_CATEGORIES = (
    ("loss", ("linear_cross_entropy", "cross_entropy", "target_rows", "causal_lm_forward")),
    ("MLP intermediates", ("ops/glu.py", "mlp_chunks.py", "swiglu", "geglu", "_project_fresh")),
    ("attention", ("attention/", "attention.py", "sdpa", "varlen", "flash")),
    ("4-bit products", ("ops/nf4.py", "kernels/nf4", "quant/lora.py", "quant/linear.py")),
    ("LoRA products", ("lora_layers.py", "lora_groups.py", "ops/lora.py", "peft/")),
    ("layer inputs and hidden states", ("offload/", "rms_norm", "_forwards.py", "rope", "modeling_")),
    ("optimizer state", ("torch/optim",)),
)


def category_of(site: str) -> str:
    """The category of an allocation site (``memory_probe.allocation_site``'s string)."""
    for category, parts in _SITE_CATEGORIES:
        if any(part in site for part in parts):
            return category
    return "other"


def model_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes the model and optimizer hold on their devices, by category (see the module notes)."""
    from lightning_sloth.ops.nf4 import scratch_bytes
    from lightning_sloth.quant import Linear4bit

    four_bit: set[int] = set()
    rows: dict[str, int] = defaultdict(int)
    for module in model.modules():
        if isinstance(module, Linear4bit):
            for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                if id(t) not in four_bit:
                    four_bit.add(id(t))
                    rows["4-bit weights"] += t.numel() * t.element_size()
    seen = set(four_bit)
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = "LoRA parameters" if p.requires_grad else "compute-dtype weights"
        rows[name] += p.numel() * p.element_size()
        if p.grad is not None:
            rows["gradients"] += p.grad.numel() * p.grad.element_size()
    for b in model.buffers():
        if id(b) not in seen:
            seen.add(id(b))
            rows["compute-dtype weights"] += b.numel() * b.element_size()
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    rows["optimizer state"] += value.numel() * value.element_size()
    rows["dequant buffer"] = scratch_bytes()
    return dict(rows)


def step_bytes(trace: list[dict]) -> dict:
    """The allocations alive at the peak of a recorded step, by category (``peak_breakdown`` of
    ``benchmarks/probes/memory_probe.py`` with every site kept)."""
    from probes.memory_probe import peak_breakdown  # benchmarks/ is on sys.path when run as a script

    breakdown = peak_breakdown(trace, top=10**9)
    rows: dict[str, int] = defaultdict(int)
    for site in breakdown["sites"]:
        rows[category_of(site["site"])] += site["bytes"]
    return {"peak_bytes": breakdown["peak_bytes"], "peak_site": breakdown["peak_site"], "rows": dict(rows)}


def table(
    held: dict[str, int], step: dict | None, peak_allocated: int | None, peak_reserved: int | None
) -> dict:
    """The accounting as one JSON-ready dict: rows in GiB, the total, and what is left unexplained."""
    rows = [
        {"part": "held", "category": k, "gib": v / GIB}
        for k, v in sorted(held.items(), key=lambda kv: -kv[1])
    ]
    if step is not None:
        rows += [
            {"part": "step peak", "category": k, "gib": v / GIB}
            for k, v in sorted(step["rows"].items(), key=lambda kv: -kv[1])
        ]
    if peak_allocated is not None and peak_reserved is not None:
        rows.append(
            {"part": "allocator", "category": "fragmentation", "gib": (peak_reserved - peak_allocated) / GIB}
        )
    counted = sum(held.values()) + (step["peak_bytes"] if step is not None else 0)
    return {
        "rows": rows,
        "counted_gib": counted / GIB,
        "peak_allocated_gib": None if peak_allocated is None else peak_allocated / GIB,
        "peak_reserved_gib": None if peak_reserved is None else peak_reserved / GIB,
        "unexplained_gib": None if peak_allocated is None else (peak_allocated - counted) / GIB,
        "peak_site": None if step is None else step["peak_site"],
    }


def print_table(result: dict) -> None:
    for row in result["rows"]:
        print(f"  {row['part']:<10} {row['category']:<32} {row['gib']:8.3f} GiB")
    print(f"  {'':<10} {'counted':<32} {result['counted_gib']:8.3f} GiB")
    if result["peak_allocated_gib"] is not None:
        print(
            f"  peak allocated {result['peak_allocated_gib']:.3f} GiB, reserved "
            f"{result['peak_reserved_gib']:.3f} GiB, unexplained {result['unexplained_gib']:.3f} GiB"
        )


def write(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
