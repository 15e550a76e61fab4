"""Benchmark tables and plots of README.md and docs/*.md, generated from the committed JSON under
``benchmarks/results/``.

    python -m lightning_sloth.bench report            # rewrite the blocks, draw the plots
    python -m lightning_sloth.bench report --check    # exit 1 naming each file that differs

A block is everything between two markers, in README.md or any ``docs/*.md``; its content is
generated, never typed::

    <!-- bench:NAME sources=a.json,b.json baseline=hf_padded -->
    ...
    <!-- /bench:NAME -->

``kind`` picks the renderer: ``suite`` (default: files of the suite and of the argparse harness),
``compact`` (end-to-end MoE, QLoRA), ``fsdp``, ``moe_layer``, ``kernels``, ``offload``,
``headline`` (several scenarios, one row each, chosen systems as columns, with a plot) and
``families`` (the supported-models table from ``lightning_sloth.patching.families`` and the tests
that name each family; no result files).
``sources`` (default ``NAME.json``) are read in order; a system measured in several keeps the last
file's record, in the place it first appeared. ``baseline`` adds a column with each system's
throughput relative to that system. A block of suite files (with a ``scenario``) gets a plot,
``NAME.png`` beside them (tokens/s with the min-max spread of the timed steps, and peak memory),
linked under its table by a path relative to the markdown file; a suite file in no block gets
``<stem>.png``. A block name is one plot: the same name in two files must have the same
parameters. Older result files lack some fields (spread, measured MFU, LoRA A/B norms, status):
their cells read "—".
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
    from lightning_sloth.bench_systems import SUITE_SYSTEMS

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
        kind = params.get("kind", "suite")
        reports = [] if kind in SOURCELESS else _load(results_dir, name, sources)
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
        elif kind in PLOTTERS:
            png = results_dir / f"{name}.png"
            body += f"\n![{PLOTTERS[kind][1]}]({Path(os.path.relpath(png, readme_dir)).as_posix()})\n"
        return f"<!-- bench:{name}{match.group('params')} -->\n{body}<!-- /bench:{name} -->"

    return MARKER.sub(block, text)


def plots(text: str, results_dir: Path) -> list[Path]:
    """Draw the plot of every README block of suite files (``<NAME>.png``), and of every other
    suite file (``<stem>.png``); returns the paths written."""
    written, used = [], set()
    for match in MARKER.finditer(text):
        name, params, sources = _block_sources(match)
        kind = params.get("kind", "suite")
        if kind in SOURCELESS or results_dir / f"{name}.png" in written:  # a block in two files: one plot
            continue
        reports = _load(results_dir, name, sources)
        if all("scenario" in r for r in reports) and kind == "suite":
            plot(merged_report(reports), results_dir / f"{name}.png")
            written.append(results_dir / f"{name}.png")
            used.update(sources)
        elif kind in PLOTTERS:
            PLOTTERS[kind][0](reports, sources, params, results_dir / f"{name}.png")
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
        description="Regenerate the benchmark tables of README.md and docs/*.md, and the plots, from the result JSON.",
    )
    parser.add_argument("--results", default="benchmarks/results", help="folder of result JSON")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--docs", help="folder of further markdown files (default: docs/ beside the README)")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a file is stale")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    results, readme = Path(args.results), Path(args.readme)
    files = markdown_files(readme, Path(args.docs) if args.docs else readme.parent / "docs")
    texts = {path: path.read_text() for path in files}
    check_block_names(texts)
    new = {path: update_readme(text, results, path.resolve().parent) for path, text in texts.items()}
    stale = [path for path in files if new[path] != texts[path]]
    if args.check:
        for path in stale:
            print(
                f"{path}: benchmark tables differ from {results}; run `python -m lightning_sloth.bench report`"
            )
        if stale:
            return 1
        print(f"{', '.join(map(str, files))}: benchmark tables match {results}")
        return 0
    for path in files:
        if path in stale:
            path.write_text(new[path])
        print(f"{path}: {len(MARKER.findall(new[path]))} benchmark tables generated")
    if not args.no_plots:
        for path in plots("\n".join(new.values()), results):
            print(f"plot {path}")
    return 0


def markdown_files(readme: Path, docs: Path) -> list[Path]:
    """The files whose blocks ``report`` rewrites: the README, then every ``*.md`` of ``docs``."""
    return [readme, *sorted(docs.glob("*.md"))]


def check_block_names(texts: dict[Path, str]) -> None:
    """A block name is one plot (``NAME.png``): refuse one name with two parameter sets."""
    seen: dict[str, tuple[str, Path]] = {}
    for path, text in texts.items():
        for match in MARKER.finditer(text):
            name, params = match.group("name"), match.group("params").strip()
            first = seen.setdefault(name, (params, path))
            if first[0] != params:
                raise ValueError(
                    f"block {name!r} is in {first[1]} and {path} with different parameters; rename one"
                )


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
    experts implementation, with the speed-up and the memory ratio against ``grouped_mm``; a column
    for 4-bit experts (``sloth_nf4``) where a file measured them."""
    nf4 = any("sloth_nf4" in result for report in reports for result in report["results"].values())
    impls = ("eager", "grouped_mm", "sloth", "sloth_nf4")[: 4 if nf4 else 3]
    header = ["shape, experts", "transformers `eager`", "transformers `grouped_mm`", "lightning_sloth"]
    header += ["lightning_sloth, NF4 experts"] if nf4 else []
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
            for impl in impls:
                m = result.get(impl)
                cells.append(f"{m['median_ms']:.1f} ms / {m['peak_over_base_gib']:.2f} GiB" if m else DASH)
            cells[2] = f"**{cells[2]}**"
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


# ---------------------------------------------------------------------------------------------
# The headline block: several scenarios, one row each, the chosen systems as columns, and a plot.
#
#     <!-- bench:headline kind=headline sources=a.json,b.json,c.json
#          columns=hf_packed_varlen|hf_bnb_packed,sloth_kernels|sloth_nf4 ratio=sloth_kernels/hf_packed_varlen -->
#
# Files are grouped into rows by scenario (a suite file's ``scenario.name``; a file of
# ``benchmarks/qlora_bench.py``, which has a top-level ``shape``, is scenario ``qlora_<shape>``;
# else ``workload.shape``), in the order the rows first appear; within a row a later file's record
# of a system replaces an earlier one. A column is a list of systems separated by ``|``: the first
# one a row has (and that ran) fills the cell, and a cell filled by another than the first is marked
# with a letter explained under the table. ``ratio=A/B`` adds the column (first system A) over the
# column (first system B) per row.

HEADLINE_COLUMNS = {
    "hf_packed_varlen": "transformers + PEFT (packed, varlen attention)",
    "hf_packed_sdpa": "transformers + PEFT (packed, SDPA)",
    "liger_packed_varlen": "Liger-Kernel",
    "unsloth_packed": "Unsloth",
    "sloth_kernels": "lightning_sloth",
    "sloth_kernels_offload": "lightning_sloth + offload",
}
"""Column titles by the column's first system (else the system's label)."""


def scenario_key(report: dict) -> str:
    """Which scenario a result file measured (see the headline block above)."""
    if "scenario" in report:
        return report["scenario"]["name"]
    if "shape" in report:
        return f"qlora_{report['shape']}"
    return report.get("workload", {}).get("shape", "?")


def scenario_title(key: str, report: dict) -> str:
    """A scenario's title: the file's own, else its config's (``conf/bench/scenario/<key>.yaml``)."""
    if report.get("scenario", {}).get("title"):
        return report["scenario"]["title"]
    from importlib import resources

    import yaml

    path = resources.files("lightning_sloth.conf.bench").joinpath("scenario", f"{key}.yaml")
    if path.is_file():
        return yaml.safe_load(path.read_text()).get("title", key)
    return key


def _commit(report: dict) -> str | None:
    commit = report.get("environment", {}).get("git_commit") or report.get("git_commit")
    return str(commit)[:10] if commit else None


def headline_rows(reports: list[dict], params: dict) -> tuple[list[str], list[tuple[str, list]]]:
    """Column titles and, per scenario, ``(title, cells)``: a cell is ``(system, record)`` or None."""
    columns = [column.split("|") for column in params["columns"].split(",")]
    titles = [HEADLINE_COLUMNS.get(c[0]) or system_label({"system": c[0]}) for c in columns]
    groups: dict[str, list[dict]] = {}
    for report in reports:
        groups.setdefault(scenario_key(report), []).append(report)
    rows = []
    for key, group in groups.items():
        records = {r["system"]: r for r in merged_results(group)}
        ok = {s: r for s, r in records.items() if status(r) == "ok" and tokens_per_s(r) is not None}
        cells = [next(((s, ok[s]) for s in column if s in ok), None) for column in columns]
        rows.append((scenario_title(key, group[-1]), cells))
    return titles, rows


def headline_marks(rows: list[tuple[str, list]], params: dict) -> dict[str, str]:
    """A letter for each system that fills a cell of a column it is not the first system of."""
    firsts = [column.split("|")[0] for column in params["columns"].split(",")]
    marks: dict[str, str] = {}
    for _, cells in rows:
        for first, cell in zip(firsts, cells):
            if cell is not None and cell[0] != first:
                marks.setdefault(cell[0], "abcdefghijklmnopqrstuvwxyz"[len(marks)])
    return marks


def render_headline(reports: list[dict], sources: list[str], params: dict) -> str:
    """One row per scenario: real tokens/s (median) and peak allocated GiB of each column's system."""
    titles, rows = headline_rows(reports, params)
    firsts = [column.split("|")[0] for column in params["columns"].split(",")]
    marks = headline_marks(rows, params)
    header = ["scenario", *titles]
    ratio = params["ratio"].split("/") if params.get("ratio") else None
    if ratio:
        short = [titles[firsts.index(first)].split(" (")[0] for first in ratio]
        header.append(f"{short[0]} ÷ {short[1]}")
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for title, cells in rows:
        out = []
        for cell in cells:
            if cell is None:
                out.append(DASH)
                continue
            system, record = cell
            text = f"{tokens_per_s(record):,.0f} · {_num(record.get('peak_allocated_gib'), '.1f')} GiB"
            out.append(text + (f" ({marks[system]})" if system in marks else ""))
        if ratio:
            by_first = dict(zip(firsts, cells))
            top, bottom = by_first.get(ratio[0]), by_first.get(ratio[1])
            out.append(f"{tokens_per_s(top[1]) / tokens_per_s(bottom[1]):.2f}×" if top and bottom else DASH)
        lines.append(f"| {_cell(title)} | " + " | ".join(out) + " |")
    files = ", ".join(
        f"`{source}`" + (f" (commit {_commit(r)})" if _commit(r) else "")
        for source, r in zip(sources, reports)
    )
    devices = sorted({r.get("environment", {}).get("device", "?") for r in reports})
    parts = [" and ".join(devices)]
    for key in ("torch", "triton", "transformers", "peft", "liger_kernel", "unsloth"):
        value = next((r["environment"][key] for r in reports if r.get("environment", {}).get(key)), None)
        if value:
            parts.append(f"{key.replace('_', '-')} {value}")
    caption = (
        f"Generated from {files}: {', '.join(parts)}. Each cell: median real (non-padding) tokens/s · "
        "peak allocated GiB, the same model, rows and LoRA for every system of a row."
    )
    text = caption + "\n\n" + "\n".join(lines) + "\n"
    if marks:
        text += (
            "\n" + "; ".join(f"({m}) {_cell(system_label({'system': s}))}" for s, m in marks.items()) + ".\n"
        )
    return text


def plot_headline(reports: list[dict], sources: list[str], params: dict, path: Path) -> None:
    """A PNG of the headline block: per scenario, real tokens/s of each column's system (bars) with
    its peak allocated GiB written beside the bar; a marked cell is labelled by its own system,
    with its letter from the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    titles, rows = headline_rows(reports, params)
    marks = headline_marks(rows, params)
    panels = [[(t, c) for t, c in zip(titles, cells) if c is not None] for _, cells in rows]
    fig, axes = plt.subplots(
        len(rows),
        1,
        figsize=(10, 1.2 + 0.36 * sum(len(p) + 1.5 for p in panels)),
        squeeze=False,
        gridspec_kw={"height_ratios": [len(p) + 1.5 for p in panels]},
    )
    for axis, (title, _), shown in zip(axes[:, 0], rows, panels):
        y = list(range(len(shown)))[::-1]
        values = [tokens_per_s(record) for _, (_, record) in shown]
        colors = ["#2a7ab9" if system.startswith("sloth") else "#8a8a8a" for _, (system, _) in shown]
        axis.barh(y, values, color=colors)
        labels = [  # a cell of another system than the column's first: that system's own label
            f"{system_label({'system': system})} ({marks[system]})" if system in marks else t
            for t, (system, _) in shown
        ]
        axis.set_yticks(y, labels, fontsize=8)
        for yy, value, (_, (_, record)) in zip(y, values, shown):
            gib = record.get("peak_allocated_gib")
            axis.text(
                value, yy, f" {value:,.0f}" + (f" · {gib:.1f} GiB" if gib else ""), va="center", fontsize=7
            )
        axis.set_xlim(0, max(values) * 1.3)
        axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
        axis.set_title(title, fontsize=9, loc="left")
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(
        "real (non-padding) tokens/s, median · peak allocated GiB; letters as in the table"
    )
    devices = " and ".join(sorted({r.get("environment", {}).get("device", "?") for r in reports}))
    fig.suptitle(f"lightning_sloth beside the other stacks: {devices}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The supported-models block (``kind=families``): one row per entry of the family table, and the
# test files that name the family's model_type as a string.


def norm_style_text(style) -> str:
    """How a family's RMSNorm rounds, in a few words."""
    weight = "(1 + w)" if style.offset else "w"
    return f"{weight} · x̂, product in fp32" if style.fp32_product else f"{weight} · x̂, x̂ rounded first"


def tests_naming(model_type: str, tests: dict[str, str]) -> list[str]:
    """The names of the test files (name -> source) holding ``model_type`` as a quoted string."""
    pattern = re.compile(rf"([\"']){re.escape(model_type)}\1")
    return [name for name, source in tests.items() if pattern.search(source)]


def families_table(families: dict, cpu_tests: dict[str, str], gpu_tests: dict[str, str]) -> str:
    """The markdown table of a family table (``model_type`` -> ``Family``) and the tests naming each."""
    header = ["`model_type`", "RMSNorm", "RoPE", "gated MLP", "residual add + norm fused", "loss"]
    header += ["MoE experts and router", "tested on CPU", "tested on GPU"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " --- |" * (len(header) - 1)]
    for model_type, family in families.items():
        glu = f"SwiGLU / GeGLU by `config.{family.activation_attr}`" if family.mlps else DASH
        loss = "fused linear cross-entropy" + (" + load-balancing loss" if family.moe else "")
        experts = "grouped experts, router in fp32" if family.experts else DASH
        cells = [
            f"`{model_type}`",
            norm_style_text(family.norm_style),
            f"`{family.rope_layout}`",
            glu,
            "yes" if family.decoder_layers else DASH,
            loss,
            experts,
        ]
        for tests in (cpu_tests, gpu_tests):
            names = tests_naming(model_type, tests)
            cells.append(", ".join(f"`{n}`" for n in names) if names else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _test_sources(folder: Path) -> dict[str, str]:
    return {path.name.removesuffix(".py"): path.read_text() for path in sorted(folder.glob("test_*.py"))}


def render_families(reports: list[dict], sources: list[str], params: dict) -> str:
    """The supported-models table: ``lightning_sloth.patching.families.FAMILIES`` and the repository's
    ``tests/test_*.py`` (CPU) and ``tests/gpu/test_*.py`` (GPU) that name each family."""
    import lightning_sloth
    from lightning_sloth.patching.families import FAMILIES

    tests = Path(lightning_sloth.__file__).resolve().parents[1] / "tests"
    caption = (
        "Generated from `lightning_sloth/patching/families.py` and the test files under `tests/` "
        "(CPU) and `tests/gpu/` (GPU) that name the family's `model_type`."
    )
    return caption + "\n\n" + families_table(FAMILIES, _test_sources(tests), _test_sources(tests / "gpu"))


RENDERERS = {
    "compact": render_compact,
    "fsdp": render_fsdp,
    "moe_layer": render_moe_layer,
    "kernels": render_kernels,
    "offload": render_offload,
    "headline": render_headline,
    "families": render_families,
}
PLOTTERS = {"headline": (plot_headline, "real tokens/s per scenario and system")}
"""Kinds that draw their own plot, ``NAME.png``: the drawing function and the image's alt text."""
SOURCELESS = {"families"}
"""Kinds that read no result file."""
