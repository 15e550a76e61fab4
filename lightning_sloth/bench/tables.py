"""Result tables of the benchmark report: one renderer per kind of result file, and the cells they share.

Each renderer takes the reports of a block (the JSON files of its ``sources``, in order), their
file names and the block's parameters, and returns the block's Markdown (a caption naming the
files, commits, device and versions, then the table). :mod:`lightning_sloth.bench.report` finds the
blocks and writes the text; :mod:`lightning_sloth.bench.headline` holds the two kinds that read
across scenarios (the headline) or no result file at all (the supported models).
"""

from __future__ import annotations

import math
import re

# Names of systems measured by earlier versions of the harness (bench.SYSTEMS) or by a benchmark
# script's own systems (benchmarks/qlora_bench.py).
EXTRA_LABELS = {
    "sloth_kernels_compile": "lightning_sloth + regional compile",
    "sloth_kernels_planned": 'lightning_sloth + memory plan for the whole card (offload="auto", memory_budget="auto")',
    "sloth_kernels_no_checkpointing": "lightning_sloth kernels, no checkpointing at all",
    "sloth_bf16": "lightning_sloth, bf16 base weights (kernels=True)",
    "sloth_nf4_offload_mlp8k": 'lightning_sloth, quantize="nf4" + offload="on", MLP in 8,192-token chunks',
    "hf_packed_flex": "transformers + PEFT, packed rows, its FlexAttention",
    "sloth_kernels_planned_gated_norm": "lightning_sloth + memory plan for the whole card + the gated RMSNorm op "
    '(kernels={"rms_norm_gated": True}, on by default since commit f421e16)',
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


def num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return DASH
    return format(value, fmt)


def pct(value) -> str:
    return DASH if value is None else f"{value:.1%}"


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def suite_row(record: dict, baseline: float | None, cold: bool = False) -> list[str]:
    state = status(record)
    label = md_cell(system_label(record))
    if state != "ok":
        reason = record.get("reason") or record.get("error") or ""
        return [label, f"**{state}**: {md_cell(reason[:120])}"] + [DASH] * (5 + bool(baseline) + cold)
    tps = tokens_per_s(record)
    spread = DASH
    if "tokens_per_s_min" in record:
        spread = f"{record['tokens_per_s_min']:,.0f} – {record['tokens_per_s_max']:,.0f}"
    cells = [label, f"{tps:,.0f}", spread]
    if baseline:
        cells.append(f"{tps / baseline:.2f}×")
    if cold:  # the same system first in a fresh process with empty compile caches
        cold_tps, ratio = record.get("cold_tokens_per_s_median"), record.get("cold_vs_warm")
        cells.append(f"{cold_tps:,.0f} ({ratio:.1%})" if cold_tps and ratio else DASH)
    cells.append(
        f"{num(record.get('peak_allocated_gib'), '.2f')} / {num(record.get('peak_reserved_gib'), '.2f')}"
    )
    measured = record.get("mfu_measured")
    datasheet = record.get("mfu_datasheet", record.get("mfu"))
    cells.append(f"{pct(measured)} / {pct(datasheet)}")
    cells.append(f"{num(record.get('first_loss'), '.4f')} → {num(record.get('last_loss'), '.4f')}")
    a, b = record.get("lora_A_grad_norm"), record.get("lora_B_grad_norm")
    if a is None and b is None:
        grads = f"{num(record.get('trainable_grad_norm'), '.3g')} (all)"
    else:
        grads = f"{num(a, '.3g')} / {num(b, '.3g')}"
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
        # The top-level commit is the one recorded beside the results (the tree the run came from);
        # the environment's is what ``git rev-parse`` said on the machine that ran it.
        commit = report.get("git_commit") or run_env.get("git_commit")
        if commit:
            run.append(f"commit {str(commit)[:10]}")
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
    cold = any("cold_tokens_per_s_median" in r for r in rows)
    header = ["system", "real tokens/s", "min – max over steps"]
    if baseline:
        header.append(f"vs `{baseline_system}`")
    if cold:
        header.append("cold process: tokens/s (of warm)")
    header += [
        "peak allocated / reserved GiB",
        "MFU measured / datasheet",
        "loss first → last",
        "grad norm LoRA A / B",
    ]
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = [caption(reports, sources), "", "| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(suite_row(r, baseline, cold)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def env_caption(reports: list[dict], sources: list[str], steps: str = "") -> str:
    env = reports[-1].get("environment", {})
    parts = [env.get("device", "?")]
    for key in ("torch", "triton", "transformers", "peft", "liger_kernel", "bitsandbytes"):
        if env.get(key):
            parts.append(f"{key.replace('_', '-')} {env[key]}")
    files = ", ".join(f"`{s}`" for s in sources)
    return f"Generated from {files}: {', '.join(parts)}{'; ' + steps if steps else ''}."


def steps_of(record: dict, report: dict) -> tuple | None:
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
            pair = steps_of(record, report)
            if any(record is row for row in rows) and pair and pair not in steps:
                steps.append(pair)
    header = ["system", "real tokens/s", "step", "peak allocated", "MFU", "loss first → last", "grad norm"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for r in rows:
        label = md_cell(system_label(r))
        if status(r) != "ok" or tokens_per_s(r) is None:
            reason = r.get("reason") or r.get("error") or ""
            lines.append(f"| {label} | **{status(r)}**: {md_cell(reason[:120])} |" + f" {DASH} |" * 5)
            continue
        mfu = r.get("mfu_recounted", r.get("mfu_datasheet", r.get("mfu")))
        norm = r.get("trainable_grad_norm", r.get("grad_norm"))
        lines.append(
            f"| {label} | {tokens_per_s(r):,.0f} | {num(r.get('median_step_s'), '.2f')} s | "
            f"{num(r.get('peak_allocated_gib'), '.2f')} GiB | {pct(mfu)} | "
            f"{num(r.get('first_loss'), '.3f')} → {num(r.get('last_loss'), '.3f')} | {num(norm, '#.3g')} |"
        )
    text = ", ".join(f"{w} warm-up + {t} timed" for w, t in steps)
    caption = env_caption(reports, sources, f"{text} steps, median" if text else "")
    return caption + "\n\n" + "\n".join(lines) + "\n"


def render_fsdp(reports: list[dict], sources: list[str], params: dict) -> str:
    """Multi-GPU runs (``benchmarks/fsdp_bench.py``): per run tokens/s per GPU, with the scaling
    against the one-GPU run of the same shape and LoRA setting where there is one (that of the run's
    own file first: several calls in one table each keep their own baseline)."""

    def one_gpu(runs: list[dict]) -> dict:
        return {
            (r["shape"], r["lora"]): r["tokens_per_s_per_gpu"]
            for r in runs
            if r.get("world") == 1 and "tokens_per_s_per_gpu" in r
        }

    runs = [run for report in reports for run in report["runs"]]
    # Each run against the one-GPU run of its own file (the same machine and call), else of any file.
    anywhere = one_gpu(runs)
    single_of = {id(r): {**anywhere, **one_gpu(report["runs"])} for report in reports for r in report["runs"]}
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
            lines.append(head + f" **error**: {md_cell(first[:200])} |" + f" {DASH} |" * (len(header) - 5))
            continue
        tps = f"{r['tokens_per_s_per_gpu']:,.0f}"
        base = single_of[id(r)].get((r["shape"], r.get("lora")))
        if base and r.get("world", 1) > 1:
            tps += f" ({r['tokens_per_s_per_gpu'] / base:.1%} scaling)"
        lines.append(
            head + f" {tps} | {r['median_step_s']:.3f} s | {r['peak_allocated_gib']:.2f} GiB "
            f"({r['peak_reserved_gib']:.1f}) | {pct(r.get('mfu'))} | {r['first_loss']:.3f} → "
            f"{r['last_loss']:.3f} | {r['grad_norm_last_step']:.4g} | {r.get('warmup_steps')} + {r['timed_steps']} |"
            + (
                f" {pct(r['gpu_busy_share'])} ({pct(r['compute_busy_share'])} / {pct(r['nccl_busy_share'])}) |"
                if "gpu_busy_share" in r
                else f" {DASH} |"
                if busy
                else ""
            )
        )
    return env_caption(reports, sources) + "\n\n" + "\n".join(lines) + "\n"


MOE_SHAPE_NAMES = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "gpt_oss_20b": "GPT-OSS-20B"}


def render_moe_layer(reports: list[dict], sources: list[str], params: dict) -> str:
    """One MoE layer (``benchmarks/moe_bench.py``): median ms and peak over the layer's inputs per
    experts implementation, with the speed-up and the memory ratio against ``grouped_mm``; a column
    for 4-bit experts (``sloth_nf4``), one for the fused permutation (``sloth_fused``, with its
    own speed-up) and one for FP8 experts (``sloth_fp8``, with its speed-up) where a file measured them;
    with ``--graphs``, a column for the step captured as one CUDA graph (``grouped_mm`` / fused, the
    fused speed-up)."""
    results = [result for report in reports for result in report["results"].values()]
    nf4 = any("sloth_nf4" in result for result in results)
    fused = any("sloth_fused" in result for result in results)
    fp8 = any("sloth_fp8" in result for result in results)
    graphed = any("fused_graphed_speedup_vs_grouped_mm" in result for result in results)
    impls = (
        ["eager", "grouped_mm", "sloth"] + (["sloth_nf4"] if nf4 else []) + (["sloth_fused"] if fused else [])
    )
    impls += ["sloth_fp8"] if fp8 else []
    header = ["shape, experts", "transformers `eager`", "transformers `grouped_mm`", "lightning_sloth"]
    header += ["lightning_sloth, NF4 experts"] if nf4 else []
    header += ["lightning_sloth, fused permutation"] if fused else []
    header += ["lightning_sloth, FP8 experts"] if fp8 else []
    header += ["speed-up vs `grouped_mm`"]
    header += ["fused: speed-up vs `grouped_mm` / vs lightning_sloth"] if fused else []
    header += ["FP8: speed-up vs `grouped_mm`"] if fp8 else []
    header += ["as one CUDA graph: `grouped_mm` / fused, speed-up"] if graphed else []
    header += ["peak vs `grouped_mm`"]
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
                peak = m.get("peak_over_base_gib") if m else None
                cells.append(f"{m['median_ms']:.1f} ms / {num(peak, '.2f')} GiB" if m else DASH)
            cells[2] = f"**{cells[2]}**"
            speed, memory = result.get("speedup_vs_grouped_mm"), result.get("memory_ratio_vs_grouped_mm")
            cells.append(f"{num(speed, '.2f')}×")
            if fused:
                vs_mm, vs_sloth = (
                    result.get("fused_speedup_vs_grouped_mm"),
                    result.get("fused_speedup_vs_sloth"),
                )
                cells.append(f"{num(vs_mm, '.2f')}× / {num(vs_sloth, '.2f')}×")
            if fp8:
                cells.append(f"{num(result.get('fp8_speedup_vs_grouped_mm'), '.2f')}×")
            if graphed:
                theirs = result.get("grouped_mm", {}).get("graphed", {}).get("median_ms")
                mine = result.get("sloth_fused", {}).get("graphed", {}).get("median_ms")
                ratio = result.get("fused_graphed_speedup_vs_grouped_mm")
                cells.append(
                    f"{num(theirs, '.1f')} / {num(mine, '.1f')} ms, {num(ratio, '.2f')}×" if ratio else DASH
                )
            cells.append(num(memory, ".2f"))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    tokens = reports[-1].get("tokens")
    return (
        env_caption(reports, sources, f"{tokens:,} tokens" if tokens else "")
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


def g3(value: float) -> str:
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
            wall = f"{r['median_ms']:.2f}" if r["median_ms"] < 10 else g3(r["median_ms"])
            cell = f"{wall} / {g3(r['device_ms'])}" if r.get("device_ms") else wall
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
    return env_caption(reports, sources, steps) + "\n\n" + "\n".join(lines) + "\n"


def render_ep_probe(reports: list[dict], sources: list[str], params: dict) -> str:
    """Expert parallelism against FSDP2 of the experts (``benchmarks/ep_probe.py``): per MoE layer and
    step, FSDP2's two all-gathers of the layer's experts beside the six all-to-alls of expert
    parallelism at each routing fan-out, and the layer's compute the gathers hide under."""
    report = reports[-1]
    timed = report["median_ms"]
    fsdp, hidden = report["fsdp2_ms_per_layer_step"], report["moe_block_fwd_bwd_ms"]
    lines = [
        "| tokens sent per token | all-to-all ms | expert parallelism ms per layer step | "
        "FSDP2 all-gathers ms per layer step | layer forward + backward ms | cheaper in communication | "
        "adds less to a step |",
        "| ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for copies, verdict in report["expert_parallel"].items():
        lines.append(
            f"| {copies} | {timed[f'all_to_all_ms_copies_{copies}']:.3f} | {verdict['ep_ms_per_layer_step']:.3f} | "
            f"{fsdp:.3f} | {hidden:.3f} | {'expert parallelism' if verdict['ep_wins_on_communication'] else 'FSDP2'} | "
            f"{'expert parallelism' if verdict['ep_adds_less_to_a_step'] else 'FSDP2'} |"
        )
    env, settings = report.get("environment", {}), report.get("settings", {})
    caption = (
        f"Generated from {', '.join(f'`{s}`' for s in sources)}: {env.get('gpus', '?')} × "
        f"{env.get('device', '?')}, torch {env.get('torch', '?')}; {settings.get('tokens', 0):,} tokens per "
        f"rank, {settings.get('experts', '?')} experts of {settings.get('hidden', '?')} → "
        f"{settings.get('moe_intermediate', '?')}, bf16. FSDP2's gathers of a layer are prefetched under "
        f"the previous layer's compute; the all-to-alls of expert parallelism are not."
    )
    return caption + "\n\n" + "\n".join(lines) + "\n"


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
    return env_caption(reports, sources) + "\n\n" + "\n".join(lines) + "\n"


def _peak_site(record: dict) -> str:
    site = (record.get("accounting") or {}).get("peak_site")
    return f"`{site.split(' < ')[0]}`" if site else DASH


def render_long_context(reports: list[dict], sources: list[str], params: dict) -> str:
    """One-step records of ``benchmarks/long_context_bench.py step`` (``--account``): a column per
    file with its shape, base, sequence length, settings, whether the step fit, its peak and time,
    then every GiB of the step by category where the file has the accounting."""

    def seconds(value) -> str:
        return "—" if value is None else f"{num(value, '.1f')} s"

    columns = [f"{r['shape']} {r['base']} {r['tokens']:,}" for r in reports]
    categories: list[tuple[str, str]] = []
    for r in reports:
        for row in (r.get("accounting") or {}).get("rows", []):
            if (row["part"], row["category"]) not in categories:
                categories.append((row["part"], row["category"]))

    def setting(r: dict) -> str:
        parts = [f"offload {r.get('offload')}", f"MLP chunks {r.get('mlp_chunk_tokens')}"]
        if r.get("memory_budget"):
            parts.append(f"budget {r['memory_budget']}")
        return ", ".join(parts)

    rows = [
        ("settings", [setting(r) for r in reports]),
        ("fits", ["yes" if r.get("fits") else "**no**" for r in reports]),
        (
            "peak allocated (reserved)",
            [
                f"{num(r.get('peak_allocated_gib'), '.2f')} GiB ({num(r.get('peak_reserved_gib'), '.2f')})"
                for r in reports
            ],
        ),
        ("one step (cold)", [seconds(r.get("step_seconds")) for r in reports]),
        ("loss", [num(r.get("loss"), ".3f") for r in reports]),
        ("peak at", [_peak_site(r) for r in reports]),
    ]
    for part, category in categories:
        cells = []
        for r in reports:
            found = [
                x["gib"]
                for x in (r.get("accounting") or {}).get("rows", [])
                if (x["part"], x["category"]) == (part, category)
            ]
            cells.append(f"{found[0]:.2f} GiB" if found else DASH)
        rows.append((f"{part}: {category}", cells))
    header = ["", *columns]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(columns)]
    lines += [
        f"| {md_cell(title)} | " + " | ".join(md_cell(c) for c in cells) + " |" for title, cells in rows
    ]
    return env_caption(reports, sources, "one full AdamW step per file") + "\n\n" + "\n".join(lines) + "\n"
