"""One MoE block step's kernels in order, from a Chrome trace of ``moe_block_gaps.py --trace``.

Each kernel's device time, its grid and the idle time before it, grouped into the expert GEMMs (with
their TFLOP/s from the shape's base FLOPs), the LoRA side products and weight gradients, the
activation, the slot sums and the rest; the step's busy and idle time::

    python benchmarks/probes/moe_block_gaps.py --systems sloth_fused --trace traces --out gaps.json  # gpu
    python benchmarks/probes/moe_step_kernels.py traces/gpt_oss_20b_sloth_fused.json.gz --out kernels.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_bench

GROUPS = (
    ("activation", ("swiglu",)),
    ("slot sums", ("_slot_sum", "_slot_dot")),
    ("LoRA weight gradients (indexed)", ("_indexed_weight_grad",)),
    ("rank-r products through torch._grouped_mm", ("cutlass",)),
    ("tile table", ("_tile_table",)),
)


def _open(path: str):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def expert_gemm_flops(shape: str, tokens: int) -> tuple[float, float]:
    """Base FLOPs of the first (gate/up) and the second (down) expert GEMM of ``shape``, per call."""
    import moe_bench

    spec = moe_bench.SHAPES[shape]
    rows = tokens * spec["num_experts_per_tok"]
    hidden = spec["hidden_size"]
    inter = spec.get("moe_intermediate_size", spec.get("intermediate_size"))
    return 2.0 * rows * hidden * 2 * inter, 2.0 * rows * inter * hidden


def summarise(path: str, shape: str | None = None, tokens: int = 16384, gemm_min_us: float = 300.0) -> dict:
    """Kernels of the traced step in order, and their time by group (µs)."""
    with _open(path) as fh:
        events = json.load(fh)["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    rows, end, busy = [], kernels[0]["ts"], 0.0
    for e in kernels:
        rows.append(
            {
                "at_us": round(e["ts"] - kernels[0]["ts"], 1),
                "idle_before_us": round(max(0.0, e["ts"] - end), 1),
                "us": e["dur"],
                "grid": e.get("args", {}).get("grid"),
                "name": e["name"][:120],
            }
        )
        end, busy = max(end, e["ts"] + e["dur"]), busy + e["dur"]
    gemms = [r for r in rows if "_indexed_grouped_mm" in r["name"] and r["us"] >= gemm_min_us]
    sides = [r for r in rows if "_indexed_grouped_mm" in r["name"] and r["us"] < gemm_min_us]
    groups = {
        "expert GEMMs": sum(r["us"] for r in gemms),
        "rank-r side passes (indexed)": sum(r["us"] for r in sides),
    }
    for label, keys in GROUPS:
        groups[label] = sum(r["us"] for r in rows if any(k in r["name"] for k in keys))
    groups["other (router, casts, sort, copies)"] = busy - sum(groups.values())
    report = {
        "trace": os.path.basename(path),
        "busy_us": busy,
        "wall_us": end - kernels[0]["ts"],
        "groups_us": groups,
        "kernels": rows,
    }
    if shape is not None and len(gemms) == 4:
        first, second = expert_gemm_flops(shape, tokens)
        # forward order: first, second; backward: the second's input gradient, then the first's
        for row, flops, role in zip(
            gemms, (first, second, second, first), ("first fwd", "second fwd", "second dgrad", "first dgrad")
        ):
            row["role"], row["tflops"] = role, flops / row["us"] / 1e6
        report["expert_gemm_tflops"] = 2 * (first + second) / groups["expert GEMMs"] / 1e6
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="<shape>_<system>.json[.gz] from moe_block_gaps.py --trace")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import moe_bench

    reports = []
    for path in args.traces:
        base = os.path.basename(path)
        shape = next((s for s in moe_bench.SHAPES if base.startswith(s)), None)
        report = summarise(path, shape, args.tokens)
        reports.append(report)
        print(f"{base}: busy {report['busy_us'] / 1e3:.2f} ms, wall {report['wall_us'] / 1e3:.2f} ms")
        for label, us in report["groups_us"].items():
            print(f"  {label:45s} {us / 1e3:6.3f} ms")
        for row in report["kernels"]:
            if "role" in row:
                print(f"  GEMM {row['role']:13s} {row['us'] / 1e3:6.3f} ms  {row['tflops']:5.0f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"results": reports}, fh, indent=2)
    return {"results": reports}


if __name__ == "__main__":
    main()
