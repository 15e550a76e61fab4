"""The expert GEMMs of one MoE block's step alone, as CUDA graphs: their time and energy at the card's power cap.

A LoRA step of the block (frozen experts, LoRA on them) multiplies four times per expert: the two
forward products and the two input gradients through the same weights::

    gate_up   [S, H]  @ W1 [H, 2I]      down     [S, I]  @ W2 [I, H]
    d_act     [S, H]  @ W2^T [H, I]     d_x      [S, 2I] @ W1^T [2I, H]

with ``S = tokens * top_k`` rows, here split evenly over the experts. Each way of running the four
products is captured as one CUDA graph and replayed back to back for at least
``moe_bench.ENERGY_WINDOW_S`` seconds, with NVML's energy counter read around the window:

- ``dense``: one ``torch.mm`` per product over all rows with one weight (no grouping; the card's rate
  on these sizes);
- ``grouped_mm``: ``torch._grouped_mm`` over the experts (CUTLASS);
- ``sloth``: lightning_sloth's Triton grouped GEMM (``lightning_sloth.moe.indexed.indexed_grouped_mm``,
  rows already in expert order, the loads the device's default).

Also ``square``: one 8192^3 ``torch.mm``, the card's best case. Their energy per replay is the floor
for the GEMMs of the fused block (``moe_bench.py --fused --graphs``), whose step does these products and
the memory-bound passes around them::

    python benchmarks/gemm_energy.py   # gpu: JSON under $OUT (else benchmarks/results/), a table printed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_bench  # noqa: E402

WAYS = ("dense", "grouped_mm", "sloth")


def products(shape: str, tokens: int) -> dict:
    """The block's rows, experts and four ``(name, K, N, weight, transposed)`` products for ``shape`` of
    :data:`moe_bench.SHAPES`, and their FLOPs per step (``2 * S * K * N`` each)."""
    cfg = moe_bench.SHAPES[shape]
    hidden = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    rows = tokens * cfg["num_experts_per_tok"]
    if rows % experts:
        raise ValueError(f"{shape}: {rows} rows do not split evenly over {experts} experts")
    gemms = [
        ("gate_up", hidden, 2 * inter, "w1", False),
        ("down", inter, hidden, "w2", False),
        ("d_act", hidden, inter, "w2", True),
        ("d_x", 2 * inter, hidden, "w1", True),
    ]
    return {
        "rows": rows,
        "experts": experts,
        "hidden": hidden,
        "intermediate": inter,
        "gemms": gemms,
        "flops": sum(2 * rows * k * n for _, k, n, _, _ in gemms),
    }


def _runner(way: str, spec: dict, device: torch.device):
    """A function doing the four products the ``way`` does them, on fresh random operands."""
    from lightning_sloth.moe.indexed import indexed_grouped_mm

    rows, experts, hidden, inter = spec["rows"], spec["experts"], spec["hidden"], spec["intermediate"]
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    weights = {
        "w1": torch.randn(experts, hidden, 2 * inter, generator=gen, **bf16) * 0.02,
        "w2": torch.randn(experts, inter, hidden, generator=gen, **bf16) * 0.02,
    }
    inputs = {k: torch.randn(rows, k, generator=gen, **bf16) for k in {k for _, k, _, _, _ in spec["gemms"]}}
    per = rows // experts
    offs = torch.arange(per, rows + 1, per, device=device, dtype=torch.int32)

    def weight(name: str, transposed: bool, e: slice | int = slice(None)) -> torch.Tensor:
        w = weights[name][e]
        return w.transpose(-2, -1) if transposed else w

    if way == "dense":
        calls = [lambda k=k, w=w, t=t: inputs[k] @ weight(w, t, 0) for _, k, _, w, t in spec["gemms"]]
    elif way == "grouped_mm":
        calls = [
            lambda k=k, w=w, t=t: torch._grouped_mm(inputs[k], weight(w, t), offs=offs)
            for _, k, _, w, t in spec["gemms"]
        ]
    elif way == "sloth":
        # indexed_grouped_mm: w_is_kn for [E, K, N]; the transposed products read [E, N, K] as stored
        calls = [
            lambda k=k, w=w, t=t: indexed_grouped_mm(inputs[k], weights[w], offs, not t)
            for _, k, _, w, t in spec["gemms"]
        ]
    else:
        raise ValueError(f"unknown way {way!r}; one of {WAYS}")

    def run():
        return [call() for call in calls]

    return run


def _square(device: torch.device):
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return lambda: [a @ b]


def measure(run, flops: float, meter: moe_bench.PowerMeter, window_s: float) -> dict:
    """``run`` captured as one CUDA graph; replays back to back for a warm-up window and then for
    ``window_s`` seconds with the energy read around it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replays = max(10, int(window_s * 1000 / max(start.elapsed_time(end) / 5, 1e-3)))
    for _ in range(replays // 2):  # the clock settles under the cap before the window
        graph.replay()
    torch.cuda.synchronize()
    energy0, t0 = meter.energy_mj() if meter.available else 0, time.perf_counter()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    energy = (meter.energy_mj() - energy0) if meter.available else 0
    clocks, capped = [], []
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        if meter.available:
            clocks.append(meter.sm_clock_mhz())
            capped.append(meter.power_capped())
    ms = start.elapsed_time(end) / replays
    out = {"ms": ms, "tflops": flops / ms / 1e9, "replays": replays}
    if meter.available:
        out.update(moe_bench.power_summary(energy, seconds, replays, clocks, capped))
        out["j_per_pflop"] = out["energy_per_step_j"] / (flops / 1e15)
    return out


def main(argv: list[str] | None = None) -> dict:
    from lightning_sloth.bench.measure import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the JSON report (default: $OUT or benchmarks/results/)")
    parser.add_argument("--shapes", default=",".join(moe_bench.SHAPES))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2, help="every way once per round, interleaved")
    parser.add_argument("--window", type=float, default=moe_bench.ENERGY_WINDOW_S)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("gemm_energy.py measures a CUDA device's GEMMs; no CUDA device is visible")
    device = torch.device("cuda")
    meter = moe_bench.PowerMeter(device)
    shapes = [s for s in args.shapes.split(",") if s]
    ways = [w for w in args.ways.split(",") if w]
    for way in ways:
        if way not in WAYS:
            parser.error(f"unknown way {way!r}; one of {WAYS}")
    cases = [("square", "dense")] + [(s, w) for s in shapes for w in ways]
    results: dict = {}
    for r in range(max(1, args.rounds)):
        for shape, way in cases:
            if shape == "square":
                run, flops = _square(device), 2 * 8192**3
            else:
                spec = products(shape, args.tokens)
                run, flops = _runner(way, spec, device), spec["flops"]
            entry = measure(run, flops, meter, args.window)
            del run
            torch.cuda.empty_cache()
            results.setdefault(shape, {}).setdefault(way, []).append(entry)
            energy = (
                f"{entry['energy_per_step_j']:.2f} J, {entry['mean_power_w']:.0f} W"
                if meter.available
                else "-"
            )
            print(
                f"round {r} {shape:14s} {way:10s} {entry['ms']:8.2f} ms {entry['tflops']:6.0f} TFLOP/s {energy}"
            )
    report = {
        "benchmark": "the expert GEMMs of one MoE block's LoRA step (forward and input gradients) as CUDA graphs",
        "environment": environment(),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "window_s": args.window,
        "nvml": None if meter.available else meter.error,
        "shapes": {s: {k: v for k, v in products(s, args.tokens).items() if k != "gemms"} for s in shapes},
        "results": results,
    }
    print(summary(report))
    out = args.out or str(
        Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "gemm_energy.json"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


def summary(report: dict) -> str:
    """A table: per shape and way, the median over rounds of ms, TFLOP/s and J per replay."""
    lines = [
        f"{'shape':16s} {'way':11s} {'ms':>8s} {'TFLOP/s':>8s} {'J':>7s} {'W':>5s} {'J/PFLOP':>8s} {'MHz':>6s}"
    ]
    for shape, ways in report["results"].items():
        for way, entries in ways.items():

            def med(key, entries=entries):
                values = [e[key] for e in entries if e.get(key) is not None]
                return statistics.median(values) if values else float("nan")

            lines.append(
                f"{shape:16s} {way:11s} {med('ms'):8.2f} {med('tflops'):8.0f} {med('energy_per_step_j'):7.2f} "
                f"{med('mean_power_w'):5.0f} {med('j_per_pflop'):8.0f} {med('sm_clock_mhz_median'):6.0f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
