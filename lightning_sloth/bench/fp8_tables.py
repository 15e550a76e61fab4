"""FP8 result tables of the benchmark report: one projection's speed and error per base format
(``benchmarks/fp8_gemm_bench.py``), the bare FP8 products with and without fast accumulation
(its ``--accum``), and the loss of FP8 bases against bf16 over a run, over one seed
or several (``benchmarks/fp8_loss_curves.py``). The cells they share with the other tables come
from :mod:`lightning_sloth.bench.tables`."""

from __future__ import annotations

from lightning_sloth.bench.tables import DASH, num

__all__ = ["render_fp8_accum", "render_fp8_gemm", "render_fp8_loss"]


FP8_GEMM_SYSTEMS = {
    "bf16": "bf16",
    "fp8_e4m3": "FP8, e4m3 gradient",
    "fp8_e5m2": "FP8, e5m2 gradient",
    "fp8_bf16grad": "FP8, bf16 gradient",
    "nf4": "NF4",
    "nf4_fp8_e4m3": "NF4 storage, FP8 compute",
}


def render_fp8_gemm(reports: list[dict], sources: list[str], params: dict) -> str:
    """One projection (``benchmarks/fp8_gemm_bench.py``): forward + input-gradient ms and the error of
    ``y`` against float64 for each base format, bf16 first, per ``(in, out, tokens)`` shape."""
    report = reports[-1]
    header = ["in → out, tokens"] + [
        f"{title}: fwd+bwd ms (× bf16), y error" for title in FP8_GEMM_SYSTEMS.values()
    ]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for shape in report["shapes"]:
        systems = shape["systems"]
        base = systems.get("bf16", {}).get("forward_backward_ms")
        cells = []
        for key in FP8_GEMM_SYSTEMS:
            r = systems.get(key)
            if not r or r.get("forward_backward_ms") is None:
                cells.append(DASH)
                continue
            speed = f" ({base / r['forward_backward_ms']:.2f}×)" if base else ""
            cells.append(f"{r['forward_backward_ms']:.3f}{speed}, {r['y_error']:.3f}")
        lines.append(f"| {shape['in']} → {shape['out']}, {shape['tokens']:,} | " + " | ".join(cells) + " |")
    caption = (
        f"Generated from {', '.join(f'`{s}`' for s in sources)}: {report.get('device', '?')}, "
        f"torch {report.get('torch', '?')}; error: relative norm of ``y`` against float64."
    )
    return caption + "\n\n" + "\n".join(lines) + "\n"


def render_fp8_accum(reports: list[dict], sources: list[str], params: dict) -> str:
    """The bare row-wise ``torch._scaled_mm`` products (``benchmarks/fp8_gemm_bench.py --accum``): per
    shape and product, bf16's TFLOP/s, FP8's with ``use_fast_accum`` off and on with the error of
    each against the float64 product of the same FP8 operands, and fast over exact."""
    report = reports[-1]
    header = [
        "in → out, tokens",
        "product",
        "bf16 TFLOP/s",
        "FP8 TFLOP/s (error)",
        "FP8 fast accumulation TFLOP/s (error)",
        "fast / exact",
    ]
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    for shape in report["shapes"]:
        for product, r in shape["products"].items():
            cells = [num(r.get("bf16_tflops"), ",.0f")]
            for key in ("exact", "fast"):
                tflops, error = r.get(f"{key}_tflops"), r.get(f"{key}_error")
                cells.append(DASH if tflops is None else f"{tflops:,.0f} ({error:.1e})")
            exact, fast = r.get("exact_ms"), r.get("fast_ms")
            cells.append(f"{exact / fast:.2f}×" if exact and fast else DASH)
            name = product.replace("_", " ")
            lines.append(
                f"| {shape['in']} → {shape['out']}, {shape['tokens']:,} | {name} | "
                + " | ".join(cells)
                + " |"
            )
    env = report.get("environment", {})
    device = report.get("device") or env.get("device", "?")
    caption = (
        f"Generated from {', '.join(f'`{s}`' for s in sources)}: {device}, torch {report.get('torch', '?')}; "
        "error: relative norm against the float64 product of the same FP8 operands."
    )
    return caption + "\n\n" + "\n".join(lines) + "\n"


def _over_seeds(run: dict, key: str) -> float | None:
    """A run's figure, averaged over its seeds where it has several (``--seeds``)."""
    values = [r.get(key) for r in run.get("seeds", [run])]
    return None if any(v is None for v in values) else sum(values) / len(values)


def _median_over_seeds(run: dict, key: str) -> float | None:
    """A rate's median over a run's seeds (one slow first run aside), or the run's own."""
    values = sorted(r[key] for r in run.get("seeds", []) if r.get(key) is not None)
    return values[len(values) // 2] if values else run.get(key)


def render_fp8_loss(reports: list[dict], sources: list[str], params: dict) -> str:
    """FP8 against bf16 bases over a run (``benchmarks/fp8_loss_curves.py``): per file (task) and
    variant, the final training loss (mean of the last steps) and its change against bf16, the
    validation loss and greedy exact match with its change, real tokens/s; and whether each
    variant meets the targets (loss within 1%, exact match within 0.02). Runs over several seeds
    show means over the seeds (tokens/s: the median), each seed's own loss change and bf16's spread
    over its seeds."""
    header = [
        "task, steps, compute",
        "bases",
        "final train loss: mean of the last 20 steps (vs bf16)",
        "val loss",
        "val exact match (vs bf16)",
    ]
    header += [
        "real tokens/s",
        "seeds: each seed's loss change; bf16's spread",
        "targets: loss within 1% / exact match within 0.02",
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "| --- | --- |" + " ---: |" * (len(header) - 4) + " --- | --- |",
    ]
    for report in reports:
        task = f"{report['task']}, {report['steps']}"
        if report.get("compute"):
            task += f", {report['compute']}"
        for variant, run in report["results"].items():
            cmp = report.get("against_baseline", {}).get(variant)
            loss = f"{_over_seeds(run, 'final_train_loss'):.4f}"
            match = num(_over_seeds(run, "val_exact_match"), ".3f")  # none: a run without validation
            targets = seeds = DASH
            if "seeds" in run:
                seeds = f"{len(run['seeds'])} seeds"
            if cmp is not None:
                loss += f" ({cmp['final_loss_relative']:+.1%})"
                if cmp["exact_match_change"] is not None:
                    match += f" ({cmp['exact_match_change']:+.3f})"
                yes = {True: "yes", False: "**no**", None: DASH}
                targets = f"{yes[cmp['loss_within_1pct']]} / {yes[cmp['exact_match_within_0_02']]}"
                if "per_seed_final_loss_relative" in cmp:
                    each = ", ".join(f"{v:+.1%}" for v in cmp["per_seed_final_loss_relative"].values())
                    seeds = f"{cmp['seeds']} seeds: {each}; ±{cmp['baseline_seed_spread']:.1%}"
            lines.append(
                f"| {task} | {variant} | {loss} | {num(_over_seeds(run, 'val_loss'), '.4f')} | {match} "
                f"| {num(_median_over_seeds(run, 'real_tokens_per_s'), ',.0f')} | {seeds} | {targets} |"
            )
    caption = "Generated from " + ", ".join(f"`{s}`" for s in sources)
    first = reports[0]
    caption += f": {first.get('device', DASH)}, torch {first.get('torch', DASH)}."
    return caption + "\n\n" + "\n".join(lines) + "\n"
