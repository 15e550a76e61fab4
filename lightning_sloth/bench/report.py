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
``compact`` (end-to-end MoE, QLoRA), ``fsdp``, ``ep_probe``, ``moe_layer``, ``kernels``, ``offload``,
``fp8_gemm``, ``fp8_accum``, ``fp8_loss``,
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
import os
import re
from pathlib import Path

from lightning_sloth.bench.fp8_tables import render_fp8_accum, render_fp8_gemm, render_fp8_loss
from lightning_sloth.bench.headline import plot_headline, render_families, render_headline
from lightning_sloth.bench.tables import (
    merged_results,
    render_compact,
    render_ep_probe,
    render_fsdp,
    render_kernels,
    render_long_context,
    render_moe_layer,
    render_offload,
    render_table,
    status,
    system_label,
    tokens_per_s,
)

MARKER = re.compile(
    r"<!-- bench:(?P<name>[\w.-]+)(?P<params>[^>]*?) -->\n(?P<body>.*?)<!-- /bench:(?P=name) -->",
    re.S,
)


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


RENDERERS = {
    "compact": render_compact,
    "fsdp": render_fsdp,
    "moe_layer": render_moe_layer,
    "kernels": render_kernels,
    "offload": render_offload,
    "long_context": render_long_context,
    "fp8_gemm": render_fp8_gemm,
    "fp8_accum": render_fp8_accum,
    "fp8_loss": render_fp8_loss,
    "ep_probe": render_ep_probe,
    "headline": render_headline,
    "families": render_families,
}


PLOTTERS = {"headline": (plot_headline, "real tokens/s per scenario and system")}
"""Kinds that draw their own plot, ``NAME.png``: the drawing function and the image's alt text."""


SOURCELESS = {"families"}
"""Kinds that read no result file."""
