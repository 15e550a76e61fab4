"""The report's cross-cutting blocks: the headline (several scenarios, one row each, the chosen
systems as columns, with its plot) and the supported-models table (the support matrix of the family
table and the tests that exercise each family; it reads no result file)."""

from __future__ import annotations

from pathlib import Path

from lightning_sloth.bench.tables import (
    DASH,
    md_cell,
    merged_results,
    num,
    status,
    system_label,
    tokens_per_s,
)
from lightning_sloth.patching import read_test_sources, support_markdown, support_matrix

HEADLINE_COLUMNS = {
    "hf_packed_varlen": "transformers + PEFT (packed, varlen attention)",
    "hf_packed_sdpa": "transformers + PEFT (packed, SDPA)",
    "liger_packed_varlen": "Liger-Kernel",
    "unsloth_packed": "Unsloth",
    "sloth_kernels": "lightning_sloth",
    "sloth_kernels_offload": "lightning_sloth + offload",
    "sloth_kernels_planned": "lightning_sloth (memory plan for the whole card)",
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


def commit_of(report: dict) -> str | None:
    commit = report.get("git_commit") or report.get("environment", {}).get("git_commit")
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
            text = f"{tokens_per_s(record):,.0f} · {num(record.get('peak_allocated_gib'), '.1f')} GiB"
            out.append(text + (f" ({marks[system]})" if system in marks else ""))
        if ratio:
            by_first = dict(zip(firsts, cells))
            top, bottom = by_first.get(ratio[0]), by_first.get(ratio[1])
            out.append(f"{tokens_per_s(top[1]) / tokens_per_s(bottom[1]):.2f}×" if top and bottom else DASH)
        lines.append(f"| {md_cell(title)} | " + " | ".join(out) + " |")
    files = ", ".join(
        f"`{source}`" + (f" (commit {commit_of(r)})" if commit_of(r) else "")
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
            "\n"
            + "; ".join(f"({m}) {md_cell(system_label({'system': s}))}" for s, m in marks.items())
            + ".\n"
        )
    return text


def plot_headline(reports: list[dict], sources: list[str], params: dict, path: Path) -> None:
    """A PNG of the headline block: per scenario, real tokens/s of each column's system (bars) with
    its peak allocated GiB written beside the bar; a marked cell is labelled by its own system (the
    label up to its first parenthesis) with its letter from the table."""
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
        # a cell of another system than the column's first: that system's label up to its first
        # parenthesis, with its letter (the table's note under it gives the whole label)
        labels = [
            f"{system_label({'system': system}).split(' (')[0]} ({marks[system]})" if system in marks else t
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


def render_families(reports: list[dict], sources: list[str], params: dict) -> str:
    """The support matrix (:func:`lightning_sloth.patching.support_matrix`): one row per family of
    the table, with the repository's tests that exercise it (``tests/``, ``tests/gpu/``)."""
    tests = Path(__file__).resolve().parents[2] / "tests"  # the repository's, beside the package
    caption = (
        "Generated from `lightning_sloth/patching/families.py` and the test files under `tests/` "
        "(CPU) and `tests/gpu/` (GPU) that exercise each family (`lightning_sloth.patching.support_matrix`; "
        "its docstring gives the rules)."
    )
    return caption + "\n\n" + support_markdown(support_matrix(read_test_sources(tests)))
