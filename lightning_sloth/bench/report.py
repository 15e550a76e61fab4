"""README benchmark tables and plots, generated from the committed JSON under ``benchmarks/results/``.

    python -m lightning_sloth.bench report            # rewrite the README blocks, draw the plots
    python -m lightning_sloth.bench report --check    # exit 1 if the README differs from the JSON

A README block is everything between two markers; its content is generated, never typed::

    <!-- bench:NAME sources=a.json,b.json baseline=hf_padded -->
    ...
    <!-- /bench:NAME -->

``kind`` picks the renderer: ``suite`` (default: files of the suite and of the argparse harness),
``compact`` (end-to-end MoE, QLoRA), ``fsdp``, ``moe_layer``, ``kernels``, ``offload``.
``sources`` (default ``NAME.json``) are read in order; a system measured in several keeps the last
file's record, in the place it first appeared. ``baseline`` adds a column with each system's
throughput relative to that system. A block of suite files (with a ``scenario``) gets a plot,
``NAME.png`` beside them (tokens/s with the min-max spread of the timed steps, and peak memory),
linked under its table; a suite file in no block gets ``<stem>.png``. Older result files lack some fields (spread,
measured MFU, LoRA A/B norms, status): their cells read "—".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

MARKER = re.compile(
    r"<!-- bench:(?P<name>[\w.-]+)(?P<params>[^>]*?) -->\n(?P<body>.*?)<!-- /bench:(?P=name) -->",
    re.S,
)

# Names of systems measured by earlier versions of the harness (bench.SYSTEMS).
EXTRA_LABELS = {
    "sloth_kernels_compile": "lightning_sloth + regional compile",
    "sloth_kernels_planned": 'lightning_sloth + memory plan for the whole card (offload="auto", memory_budget="auto")',
    "sloth_kernels_no_checkpointing": "lightning_sloth kernels, no checkpointing at all",
    "sloth_bf16": "lightning_sloth, bf16 base weights (kernels=True)",
    "hf_packed_flex": "transformers + PEFT, packed rows, its FlexAttention",
}
DASH = "—"


def system_label(record: dict) -> str:
    """What a table and a plot call a system."""
    if record.get("label"):
        return record["label"]
    from lightning_sloth.bench.systems import SUITE_SYSTEMS

    name = record["system"]
    if name in SUITE_SYSTEMS:
        return SUITE_SYSTEMS[name].label
    if name in EXTRA_LABELS:
        return EXTRA_LABELS[name]
    match = re.fullmatch(r"sloth_kernels_offload_budget_(.+)gib", name)
    if match:
        return f"lightning_sloth + offload and a {match.group(1)} GiB activation budget"
    return name


def status(record: dict) -> str:
    """``ok``, ``failed``, ``oom`` or ``error`` (older files mark only out-of-memory)."""
    if "status" in record:
        return record["status"]
    return "oom" if record.get("oom") else "ok"


def tokens_per_s(record: dict) -> float | None:
    """Median real tokens/s over the timed steps (older files: total tokens over total time)."""
    return record.get("tokens_per_s_median", record.get("tokens_per_s"))


def merged_results(reports: list[dict]) -> list[dict]:
    """The records of several result files, in order; a repeated system keeps the last record."""
    order: list[str] = []
    latest: dict[str, dict] = {}
    for report in reports:
        for record in report["results"]:
            if record["system"] not in latest:
                order.append(record["system"])
            latest[record["system"]] = record
    return [latest[name] for name in order]


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return DASH
    return format(value, fmt)


def _pct(value) -> str:
    return DASH if value is None else f"{value:.1%}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(record: dict, baseline: float | None) -> list[str]:
    state = status(record)
    label = _cell(system_label(record))
    if state != "ok":
        reason = record.get("reason") or record.get("error") or ""
        return [label, f"**{state}**: {_cell(reason[:120])}"] + [DASH] * (6 if baseline else 5)
    tps = tokens_per_s(record)
    spread = DASH
    if "tokens_per_s_min" in record:
        spread = f"{record['tokens_per_s_min']:,.0f} – {record['tokens_per_s_max']:,.0f}"
    cells = [label, f"{tps:,.0f}", spread]
    if baseline:
        cells.append(f"{tps / baseline:.2f}×")
    cells.append(
        f"{_num(record.get('peak_allocated_gib'), '.2f')} / {_num(record.get('peak_reserved_gib'), '.2f')}"
    )
    measured = record.get("mfu_measured")
    datasheet = record.get("mfu_datasheet", record.get("mfu"))
    cells.append(f"{_pct(measured)} / {_pct(datasheet)}")
    cells.append(f"{_num(record.get('first_loss'), '.4f')} → {_num(record.get('last_loss'), '.4f')}")
    a, b = record.get("lora_A_grad_norm"), record.get("lora_B_grad_norm")
    if a is None and b is None:
        grads = f"{_num(record.get('trainable_grad_norm'), '.3g')} (all)"
    else:
        grads = f"{_num(a, '.3g')} / {_num(b, '.3g')}"
    cells.append(grads)
    return cells


def caption(reports: list[dict], sources: list[str]) -> str:
    """One generated line naming the files, device, versions and workload behind a table; where
    several runs make one table, each file's commit and measured matmul rate are named."""
    env, work = reports[-1]["environment"], reports[-1]["workload"]
    parts = [env.get("device", "?")]
    for key in ("torch", "triton", "transformers", "peft", "liger_kernel", "unsloth"):
        value = next((r["environment"][key] for r in reports if r["environment"].get(key)), None)
        if value:
            parts.append(f"{key.replace('_', '-')} {value}")
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    for source, report in zip(sources, reports):
        run_env, run = report["environment"], []
        if run_env.get("matmul_probe_tflops"):
            run.append(f"measured bf16 matmul {run_env['matmul_probe_tflops']:.0f} TFLOP/s")
        if run_env.get("git_commit"):
            run.append(f"commit {run_env['git_commit'][:10]}")
        if run:
            parts.append((f"`{source}`: " if len(reports) > 1 else "") + ", ".join(run))
    steps = {(r["workload"]["warmup_steps"], r["workload"]["timed_steps"]) for r in reports}
    if len(steps) == 1:
        steps_text = f"{work['warmup_steps']} warm-up + {work['timed_steps']} timed steps"
    else:  # runs of different lengths: each file's own
        steps_text = ", ".join(
            f"`{source}`: {r['workload']['warmup_steps']} warm-up + {r['workload']['timed_steps']} timed steps"
            for source, r in zip(sources, reports)
        )
    workload = f"{work['tokens_per_step']:,} tokens per step, LoRA r={work['lora_r']}, {steps_text}"
    files = ", ".join(f"`{s}`" for s in sources)
    return f"Generated from {files}: {', '.join(parts)}; {workload}."


def render_table(reports: list[dict], sources: list[str], baseline_system: str | None) -> str:
    """The markdown of one README block (caption and table)."""
    rows = merged_results(reports)
    baseline = None
    if baseline_system:
        base = next((r for r in rows if r["system"] == baseline_system and status(r) == "ok"), None)
        baseline = tokens_per_s(base) if base else None
    header = ["system", "real tokens/s", "min – max over steps"]
    if baseline:
        header.append(f"vs `{baseline_system}`")
    header += [
        "peak allocated / reserved GiB",
        "MFU measured / datasheet",
        "loss first → last",
        "grad norm LoRA A / B",
    ]
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = [caption(reports, sources), "", "| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_row(r, baseline)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _params(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def _block_sources(match: re.Match) -> tuple[str, dict[str, str], list[str]]:
    name, params = match.group("name"), _params(match.group("params"))
    return name, params, params.get("sources", f"{name}.json").split(",")


def _load(results_dir: Path, name: str, sources: list[str]) -> list[dict]:
    reports = []
    for source in sources:
        path = results_dir / source
        if not path.exists():
            raise FileNotFoundError(f"README block {name!r}: no result file {path}")
        reports.append(json.loads(path.read_text()))
    return reports


def merged_report(reports: list[dict]) -> dict:
    """One report of several files of a scenario: the last file's environment, all records."""
    return reports[-1] | {"results": merged_results(reports)}


def update_readme(text: str, results_dir: Path, readme_dir: Path) -> str:
    """``text`` with every ``bench:`` block regenerated from the JSON in ``results_dir``.

    A block whose files all come from the suite links its plot, ``<results_dir>/<NAME>.png``.
    """

    def block(match: re.Match) -> str:
        name, params, sources = _block_sources(match)
        reports = _load(results_dir, name, sources)
        kind = params.get("kind", "suite")
        if kind == "suite":
            body = render_table(reports, sources, params.get("baseline"))
        elif kind in RENDERERS:
            body = RENDERERS[kind](reports, sources, params)
        else:
            raise ValueError(
                f"README block {name!r}: unknown kind {kind!r}; choose from {['suite', *RENDERERS]}"
            )
        if kind == "suite" and all("scenario" in r for r in reports):
            png = results_dir / f"{name}.png"
            title = reports[0]["scenario"].get("title", name)
            body += f"\n![{title}]({Path(os.path.relpath(png, readme_dir)).as_posix()})\n"
        return f"<!-- bench:{name}{match.group('params')} -->\n{body}<!-- /bench:{name} -->"

    return MARKER.sub(block, text)


def plots(text: str, results_dir: Path) -> list[Path]:
    """Draw the plot of every README block of suite files (``<NAME>.png``), and of every other
    suite file (``<stem>.png``); returns the paths written."""
    written, used = [], set()
    for match in MARKER.finditer(text):
        name, _, sources = _block_sources(match)
        reports = _load(results_dir, name, sources)
        if (
            all("scenario" in r for r in reports)
            and _params(match.group("params")).get("kind", "suite") == "suite"
        ):
            plot(merged_report(reports), results_dir / f"{name}.png")
            written.append(results_dir / f"{name}.png")
            used.update(sources)
    for path in suite_files(results_dir):
        if path.name not in used:
            plot(json.loads(path.read_text()), path.with_suffix(".png"))
            written.append(path.with_suffix(".png"))
    return written


def plot(report: dict, path: Path) -> None:
    """A PNG of one scenario: real tokens/s per system (bar: median, whisker: min-max over the
    timed steps) and peak memory (allocated; reserved as the outline); failed systems marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [system_label(r) + ("" if status(r) == "ok" else f"  [{status(r)}]") for r in rows]
    ok = [status(r) == "ok" for r in rows]
    median = [tokens_per_s(r) if good else 0.0 for r, good in zip(rows, ok)]
    low = [m - r.get("tokens_per_s_min", m) if good else 0.0 for r, m, good in zip(rows, median, ok)]
    high = [r.get("tokens_per_s_max", m) - m if good else 0.0 for r, m, good in zip(rows, median, ok)]
    alloc = [(r.get("peak_allocated_gib") or 0.0) if good else 0.0 for r, good in zip(rows, ok)]
    reserved = [(r.get("peak_reserved_gib") or 0.0) if good else 0.0 for r, good in zip(rows, ok)]
    y = list(range(len(rows)))[::-1]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 0.42 * len(rows) + 1.6), sharey=True, gridspec_kw={"width_ratios": [3, 2]}
    )
    colors = ["#2a7ab9" if r["system"].startswith("sloth") else "#8a8a8a" for r in rows]
    left.barh(y, median, xerr=[low, high], color=colors, capsize=3)
    left.set_xlabel("real (non-padding) tokens/s: median, whiskers min-max over timed steps")
    left.set_yticks(y, labels, fontsize=8)
    right.barh(y, reserved, color="none", edgecolor="#444444", linewidth=0.8, label="reserved")
    right.barh(y, alloc, color=colors, label="allocated")
    right.set_xlabel("peak GPU memory, GiB")
    right.legend(loc="lower right", fontsize=8)
    for axis in (left, right):
        axis.grid(axis="x", alpha=0.3)
    env = report["environment"]
    title = report.get("scenario", {}).get("title", report["workload"]["shape"])
    fig.suptitle(f"{title}: {env.get('device', '?')}, {report['workload']['tokens_per_step']:,} tokens/step")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def suite_files(results_dir: Path) -> list[Path]:
    """The suite's result files (those with a ``scenario``), sorted by name."""
    out = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "scenario" in data and "results" in data:
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_sloth.bench report",
        description="Regenerate the README's benchmark tables and the plots from the result JSON.",
    )
    parser.add_argument("--results", default="benchmarks/results", help="folder of result JSON")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the README is stale")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    results, readme = Path(args.results), Path(args.readme)
    text = readme.read_text()
    new = update_readme(text, results, readme.resolve().parent)
    if args.check:
        if new != text:
            print(
                f"{readme}: benchmark tables differ from {results}; run `python -m lightning_sloth.bench report`"
            )
            return 1
        print(f"{readme}: benchmark tables match {results}")
        return 0
    if new != text:
        readme.write_text(new)
    print(f"{readme}: {len(MARKER.findall(new))} benchmark tables generated")
    if not args.no_plots:
        for path in plots(new, results):
            print(f"plot {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# Renderers of the other result files (``kind=`` in a block's marker). Each takes the loaded files
# and their names and returns the block's markdown; the numbers are the files', never retyped.


def _env_caption(reports: list[dict], sources: list[str], steps: str = "") -> str:
    env = reports[-1].get("environment", {})
    parts = [env.get("device", "?")]
    for key in ("torch", "triton", "transformers", "peft", "liger_kernel", "bitsandbytes"):
        if env.get(key):
            parts.append(f"{key.replace('_', '-')} {env[key]}")
    files = ", ".join(f"`{s}`" for s in sources)
    return f"Generated from {files}: {', '.join(parts)}{'; ' + steps if steps else ''}."


def _steps_of(record: dict, report: dict) -> tuple | None:
    work = record.get("workload") or report.get("workload") or {}
    if "timed_steps" not in work and "timed_steps" not in record:
        return None
    return work.get("warmup_steps"), record.get("timed_steps", work.get("timed_steps"))


def render_compact(reports: list[dict], sources: list[str], params: dict) -> str:
    """Records of the argparse harnesses (end-to-end MoE, QLoRA): one row per system (a system in
    several sources keeps its last record) with real tokens/s, median step, peak allocated, MFU
    (recounted where the file has it), loss, grad norm."""
    rows, steps = merged_results(reports), []  # a system measured again keeps its last record
    for report in reports:
        for record in report["results"]:
            pair = _steps_of(record, report)
            if any(record is row for row in rows) and pair and pair not in steps:
                steps.append(pair)
    header = ["system", "real tokens/s", "step", "peak allocated", "MFU", "loss first → last", "grad norm"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for r in rows:
        label = _cell(system_label(r))
        if status(r) != "ok" or tokens_per_s(r) is None:
            reason = r.get("reason") or r.get("error") or ""
            lines.append(f"| {label} | **{status(r)}**: {_cell(reason[:120])} |" + f" {DASH} |" * 5)
            continue
        mfu = r.get("mfu_recounted", r.get("mfu_datasheet", r.get("mfu")))
        norm = r.get("trainable_grad_norm", r.get("grad_norm"))
        lines.append(
            f"| {label} | {tokens_per_s(r):,.0f} | {_num(r.get('median_step_s'), '.2f')} s | "
            f"{_num(r.get('peak_allocated_gib'), '.2f')} GiB | {_pct(mfu)} | "
            f"{_num(r.get('first_loss'), '.3f')} → {_num(r.get('last_loss'), '.3f')} | {_num(norm, '#.3g')} |"
        )
    text = ", ".join(f"{w} warm-up + {t} timed" for w, t in steps)
    caption = _env_caption(reports, sources, f"{text} steps, median" if text else "")
    return caption + "\n\n" + "\n".join(lines) + "\n"


def render_fsdp(reports: list[dict], sources: list[str], params: dict) -> str:
    """Multi-GPU runs (``benchmarks/fsdp_bench.py``): per run tokens/s per GPU, with the scaling
    against the one-GPU run of the same shape and LoRA setting where there is one."""
    runs = [run for report in reports for run in report["runs"]]
    single = {
        (r["shape"], r["lora"]): r["tokens_per_s_per_gpu"]
        for r in runs
        if r.get("world") == 1 and "tokens_per_s_per_gpu" in r
    }
    header = [
        "shape",
        "LoRA",
        "system",
        "GPUs",
        "tokens/s per GPU",
        "step",
        "peak allocated (reserved) per GPU",
    ]
    header += ["MFU", "loss first → last", "grad norm", "steps"]
    busy = any("gpu_busy_share" in r for r in runs)  # fsdp_bench --profile
    if busy:
        header.append("GPU busy (compute / NCCL)")
    lines = ["| " + " | ".join(header) + " |", "| --- | --- | --- |" + " ---: |" * (len(header) - 3)]
    for r in runs:
        head = f"| {r['shape']} | {'r=16' if r.get('lora') else 'full'} | `{r['system']}` | {r.get('gpus', r.get('world'))} |"
        if "tokens_per_s_per_gpu" not in r:
            first = r.get("error", "").split(". ")[0]  # the first sentence of the error
            lines.append(head + f" **error**: {_cell(first[:200])} |" + f" {DASH} |" * (len(header) - 5))
            continue
        tps = f"{r['tokens_per_s_per_gpu']:,.0f}"
        base = single.get((r["shape"], r.get("lora")))
        if base and r.get("world", 1) > 1:
            tps += f" ({r['tokens_per_s_per_gpu'] / base:.1%} scaling)"
        lines.append(
            head + f" {tps} | {r['median_step_s']:.3f} s | {r['peak_allocated_gib']:.2f} GiB "
            f"({r['peak_reserved_gib']:.1f}) | {_pct(r.get('mfu'))} | {r['first_loss']:.3f} → "
            f"{r['last_loss']:.3f} | {r['grad_norm_last_step']:.4g} | {r.get('warmup_steps')} + {r['timed_steps']} |"
            + (
                f" {_pct(r['gpu_busy_share'])} ({_pct(r['compute_busy_share'])} / {_pct(r['nccl_busy_share'])}) |"
                if "gpu_busy_share" in r
                else f" {DASH} |"
                if busy
                else ""
            )
        )
    return _env_caption(reports, sources) + "\n\n" + "\n".join(lines) + "\n"


MOE_SHAPE_NAMES = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "gpt_oss_20b": "GPT-OSS-20B"}


def render_moe_layer(reports: list[dict], sources: list[str], params: dict) -> str:
    """One MoE layer (``benchmarks/moe_bench.py``): median ms and peak over the layer's inputs per
    experts implementation, with the speed-up and the memory ratio against ``grouped_mm``."""
    header = ["shape, experts", "transformers `eager`", "transformers `grouped_mm`", "lightning_sloth"]
    header += ["speed-up vs `grouped_mm`", "peak vs `grouped_mm`"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for report in reports:
        for case, result in report["results"].items():
            shape, mode = case.split("/")
            cfg = report["shapes"][shape]
            experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            inter = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
            name = MOE_SHAPE_NAMES.get(shape, shape)
            label = f"{name} ({cfg['hidden_size']}, {experts} × {inter}, top-{cfg['num_experts_per_tok']}), "
            label += "LoRA on experts" if mode == "lora" else mode
            cells = []
            for impl in ("eager", "grouped_mm", "sloth"):
                m = result.get(impl)
                cells.append(f"{m['median_ms']:.1f} ms / {m['peak_over_base_gib']:.2f} GiB" if m else DASH)
            cells[-1] = f"**{cells[-1]}**"
            speed, memory = result.get("speedup_vs_grouped_mm"), result.get("memory_ratio_vs_grouped_mm")
            lines.append(
                f"| {label} | " + " | ".join(cells) + f" | {_num(speed, '.2f')}× | {_num(memory, '.2f')} |"
            )
    tokens = reports[-1].get("tokens")
    return (
        _env_caption(reports, sources, f"{tokens:,} tokens" if tokens else "")
        + "\n\n"
        + "\n".join(lines)
        + "\n"
    )


KERNEL_NAMES = {
    "rms_norm": "RMSNorm",
    "rope": "RoPE",
    "swiglu": "SwiGLU",
    "geglu": "GeGLU",
    "lora_linear": "LoRA linear",
    "linear_cross_entropy": "linear cross-entropy",
}
KERNEL_IMPLS = (("ours", "ours"), ("eager", "eager"), ("compile", "`torch.compile`"), ("liger", "Liger"))


def _g3(value: float) -> str:
    return f"{value:#.3g}"


def render_kernels(reports: list[dict], sources: list[str], params: dict) -> str:
    """Kernels alone (``benchmarks/kernels_bench.py``): wall / GPU ms per call for every
    implementation, peak memory where it matters, and ours against the copy bandwidth or in TFLOP/s."""
    records = [r for report in reports for r in report["records"]]
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in records:
        cases.setdefault((r["op"], r["shape"]), {})[r["impl"]] = r
    header = ["op (shape)"] + [f"{title}, wall / GPU ms" for _, title in KERNEL_IMPLS]
    header.append("ours: % of copy bandwidth (others) or TFLOP/s")
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for (op, shape), impls in cases.items():
        cells = []
        for impl, _ in KERNEL_IMPLS:
            r = impls.get(impl)
            if r is None or r.get("status", "ok") != "ok":
                cells.append(DASH)
                continue
            wall = f"{r['median_ms']:.2f}" if r["median_ms"] < 10 else _g3(r["median_ms"])
            cell = f"{wall} / {_g3(r['device_ms'])}" if r.get("device_ms") else wall
            if r.get("gbps") is None:  # compute-bound ops: their memory is the point
                cell += f", {r['peak_mib'] / 1024:.2f} GiB"
            cells.append(cell)
        ours = impls.get("ours", {})
        if ours.get("copy_fraction") is not None:
            others = [
                f"{title} {impls[impl]['copy_fraction']:.0%}"
                for impl, title in KERNEL_IMPLS[1:]
                if impls.get(impl, {}).get("copy_fraction") is not None
            ]
            last = f"{ours['copy_fraction']:.0%} ({', '.join(others)})"
        elif ours.get("tflops") is not None:
            last = f"{ours['tflops']:.0f} TFLOP/s"
        else:
            last = DASH
        lines.append(f"| {KERNEL_NAMES.get(op, op)} (`{shape}`) | " + " | ".join(cells) + f" | {last} |")
    copy = reports[-1].get("copy_bandwidth_gbps")
    steps = f"copy bandwidth measured {copy / 1000:.2f} TB/s" if copy else ""
    return _env_caption(reports, sources, steps) + "\n\n" + "\n".join(lines) + "\n"


OFFLOAD_SETUPS = {
    "none": "(a) no checkpointing",
    "checkpoint": "(b) plain checkpointing",
    "offload_single": "(c) offload, single-buffered",
    "offload_double": "(d) offload, double-buffered",
    "save_on_cpu": "(e) `torch.autograd.graph.save_on_cpu`",
    "planned": "memory plan with the whole card",
}


def render_offload(reports: list[dict], sources: list[str], params: dict) -> str:
    """Checkpointing and offload (``benchmarks/offload_bench.py``): tokens/s and peak per setup for
    each timed file's shape, and the longest step of a ``max_tokens`` file."""
    setups: list[str] = []
    columns: list[tuple[str, dict]] = []
    for report in reports:
        if "max_tokens" in report:
            shape = report["runs"][0]["config"]["shape"]
            values = {s: f"{v['tokens']:,}" for s, v in report["max_tokens"].items()}
            columns.append((f"{shape} longest step", values))
        else:
            shape = report["config"]["shape"]
            speed, peak = {}, {}
            for r in report["results"]:
                oom = r.get("oom")
                speed[r["setup"]] = "OOM" if oom else f"{r['tokens_per_s']:,.0f}"
                peak[r["setup"]] = DASH if oom else f"{r['peak_allocated_gib']:.2f} GiB"
            columns += [(f"{shape} tokens/s", speed), (f"{shape} peak", peak)]
        for setup in columns[-1][1]:
            if setup not in setups:
                setups.append(setup)
    header = ["setting"] + [title for title, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(columns)]
    for setup in setups:
        cells = [values.get(setup, DASH) for _, values in columns]
        lines.append(f"| {OFFLOAD_SETUPS.get(setup, setup)} | " + " | ".join(cells) + " |")
    return _env_caption(reports, sources) + "\n\n" + "\n".join(lines) + "\n"


RENDERERS = {
    "compact": render_compact,
    "fsdp": render_fsdp,
    "moe_layer": render_moe_layer,
    "kernels": render_kernels,
    "offload": render_offload,
}
