"""The generated blocks of README.md and docs/*.md: the headline and families kinds, and the report
over several markdown files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _scripts import benchmark_script

from lightning_sloth.bench import fp8_tables
from lightning_sloth.bench import headline as bench_headline
from lightning_sloth.bench import report as bench_report
from lightning_sloth.bench import tables as bench_tables
from lightning_sloth.patching.families import FAMILIES, LLAMA_NORM, Family

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _family(**changes) -> Family:
    row = dict(
        package="x",
        norms=("XRMSNorm",),
        norm_style=LLAMA_NORM,
        mlps=("XMLP",),
        activation_attr="hidden_act",
        attentions=("XAttention",),
        rope_layout="rotate_half",
        causal_lms=("XForCausalLM",),
    )
    return Family(**(row | changes))


def test_families_block_renders_every_row_of_the_real_table():
    text = bench_report.update_readme(
        "<!-- bench:families kind=families -->\n<!-- /bench:families -->\n", RESULTS, ROOT
    )
    rows = [line for line in text.splitlines() if line.startswith("| `")]  # the header has no backticks
    assert [row.split("`")[1] for row in rows] == list(FAMILIES)
    for row in rows:  # every family is exercised by at least one CPU test file
        assert row.rstrip(" |").split(" | ")[-1].startswith("CPU"), row
    assert "lightning_sloth/patching/families.py" in text


def _suite(name: str, title: str, records: list[dict], commit: str = "abc1234") -> dict:
    work = dict(tokens_per_step=16, lora_r=4, warmup_steps=1, timed_steps=2)
    env = {"device": "GPU X", "git_commit": commit, "torch": "2.x"}
    return {
        "environment": env,
        "scenario": {"name": name, "title": title},
        "workload": work,
        "results": records,
    }


def _rec(system: str, tps: float, gib: float = 1.0, **more) -> dict:
    return {"system": system, "tokens_per_s_median": tps, "peak_allocated_gib": gib, "status": "ok"} | more


HEADLINE = {
    "columns": "hf_packed_varlen|hf_bnb_packed,sloth_kernels|sloth_nf4,sloth_kernels_offload",
    "ratio": "sloth_kernels/hf_packed_varlen",
}


def _headline_reports() -> list[dict]:
    dense_old = _suite(
        "dense", "Dense shape", [_rec("hf_packed_varlen", 100.0, 9.0), _rec("sloth_kernels", 150.0)]
    )
    dense_new = _suite("dense", "Dense shape", [_rec("sloth_kernels", 250.0, 2.0)], commit="def5678")
    failed = _rec("sloth_kernels_offload", 1e9, status="failed", reason="loss not finite")
    qlora = {
        "environment": {"device": "GPU X"},
        "git_commit": "0a1b2c3",
        "shape": "llama_3_1_8b",
        "results": [_rec("hf_bnb_packed", 10.0, 40.0), _rec("sloth_nf4", 30.0, 13.0), failed],
    }
    return [dense_old, dense_new, qlora]


def test_headline_rows_group_by_scenario_and_mark_other_systems():
    reports = _headline_reports()
    sources = ["a.json", "b.json", "c.json"]
    text = bench_headline.render_headline(reports, sources, HEADLINE)
    assert "`a.json` (commit abc1234), `b.json` (commit def5678), `c.json` (commit 0a1b2c3)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].endswith("| lightning_sloth ÷ transformers + PEFT |")
    # the dense row takes the later file's sloth_kernels; no offload row was measured
    assert rows[1] == "| Dense shape | 100 · 9.0 GiB | 250 · 2.0 GiB | — | 2.50× |"
    # the QLoRA file is scenario qlora_<shape>, titled by its config; a failed record is no cell
    assert rows[2] == (
        "| Llama-3.1-8B shape, NF4 base weights (QLoRA), LoRA r=16 | 10 · 40.0 GiB (a) | 30 · 13.0 GiB (b) | — | 3.00× |"
    )
    assert (
        "(a) transformers + PEFT + bitsandbytes NF4" in text and '(b) lightning_sloth, quantize="nf4"' in text
    )


def test_headline_block_links_its_plot_and_draws_it(tmp_path):
    sources = ["a.json", "b.json", "c.json"]
    for source, report in zip(sources, _headline_reports()):
        (tmp_path / source).write_text(json.dumps(report))
    params = " ".join(f"{k}={v}" for k, v in HEADLINE.items())
    text = f"<!-- bench:top kind=headline sources={','.join(sources)} {params} -->\n<!-- /bench:top -->\n"
    docs = tmp_path / "docs"
    docs.mkdir()
    out = bench_report.update_readme(text, tmp_path, docs)
    assert "](../top.png)" in out
    assert bench_report.plots(out, tmp_path) == [tmp_path / "top.png"]
    assert (tmp_path / "top.png").read_bytes().startswith(b"\x89PNG")


def test_moe_layer_gets_an_nf4_column_where_measured():
    report = json.loads((RESULTS / "moe_layer_nf4_h100.json").read_text())
    table = bench_tables.render_moe_layer([report], ["x.json"], {})
    assert "| lightning_sloth, NF4 experts |" in table.splitlines()[2]
    assert "**10.4 ms / 1.88 GiB** | 11.4 ms / 1.88 GiB | 2.47× |" in table
    plain = json.loads((RESULTS / "moe_layer_h100.json").read_text())
    assert "NF4" not in bench_tables.render_moe_layer([plain], ["y.json"], {})


def _project(tmp_path: Path) -> tuple[Path, list[str]]:
    results = tmp_path / "results"
    results.mkdir()
    (results / "k.json").write_text((RESULTS / "kernels_h100.json").read_text())
    block = "<!-- bench:k kind=kernels sources=k.json -->\nstale\n<!-- /bench:k -->\n"
    (tmp_path / "README.md").write_text("readme\n" + block)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("doc a\n" + block)
    (tmp_path / "docs" / "b.md").write_text("doc b, no blocks\n")
    return results, ["--results", str(results), "--readme", str(tmp_path / "README.md"), "--no-plots"]


def test_ep_probe_rows_name_the_cheaper_side_at_each_fan_out():
    report = json.loads((RESULTS / "ep_probe_h200x4.json").read_text())
    table = bench_tables.render_ep_probe([report], ["ep_probe_h200x4.json"], {})
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == [f"| {c}" for c in report["expert_parallel"]]
    for row, verdict in zip(rows, report["expert_parallel"].values()):
        cells = row.strip("| ").split(" | ")
        assert float(cells[2]) == pytest.approx(verdict["ep_ms_per_layer_step"], abs=1e-3)
        assert cells[5] == ("expert parallelism" if verdict["ep_wins_on_communication"] else "FSDP2")


def test_moe_layer_table_shows_the_fused_permutation_where_measured():
    report = json.loads((RESULTS / "moe_fused_h100.json").read_text())
    table = bench_tables.render_moe_layer([report], ["moe_fused_h100.json"], {})
    assert "lightning_sloth, fused permutation" in table
    rows = [line for line in table.splitlines() if "LoRA on experts" in line]
    assert len(rows) == len(report["results"])
    for row, result in zip(rows, report["results"].values()):
        cells = row.strip("| ").split(" | ")
        assert cells[4].startswith(f"{result['sloth_fused']['median_ms']:.1f} ms")
        assert (
            cells[6]
            == f"{result['fused_speedup_vs_grouped_mm']:.2f}× / {result['fused_speedup_vs_sloth']:.2f}×"
        )
    plain = json.loads((RESULTS / "moe_layer_h100.json").read_text())
    assert "fused" not in bench_tables.render_moe_layer([plain], ["moe_layer_h100.json"], {})


def test_moe_layer_table_gives_the_graphed_replays_where_measured():
    report = json.loads((RESULTS / "moe_fused_graphs_h200.json").read_text())
    table = bench_tables.render_moe_layer([report], ["moe_fused_graphs_h200.json"], {})
    assert "as one CUDA graph" in table
    rows = [line for line in table.splitlines() if "LoRA on experts" in line]
    assert len(rows) == len(report["results"])
    for row, result in zip(rows, report["results"].values()):
        cell = row.strip("| ").split(" | ")[7]
        mm, fused = (
            result["grouped_mm"]["graphed"]["median_ms"],
            result["sloth_fused"]["graphed"]["median_ms"],
        )
        ratio = result["fused_graphed_speedup_vs_grouped_mm"]
        assert cell == f"{mm:.1f} / {fused:.1f} ms, {ratio:.2f}×"
        assert ratio == pytest.approx(mm / fused)
    plain = json.loads((RESULTS / "moe_fused_h100.json").read_text())
    assert "CUDA graph" not in bench_tables.render_moe_layer([plain], ["moe_fused_h100.json"], {})


def test_fp8_accum_table_has_each_product_with_both_modes():
    report = json.loads((RESULTS / "fp8_accum_h200.json").read_text())
    table = fp8_tables.render_fp8_accum([report], ["fp8_accum_h200.json"], {})
    assert "NVIDIA H200" in table.splitlines()[0]
    rows = [line for line in table.splitlines() if " → " in line and not line.startswith("| in")]
    assert len(rows) == sum(len(shape["products"]) for shape in report["shapes"])
    first = report["shapes"][0]["products"]["forward"]
    cells = rows[0].strip("| ").split(" | ")
    assert cells[1] == "forward" and cells[2] == f"{first['bf16_tflops']:,.0f}"
    assert cells[3] == f"{first['exact_tflops']:,.0f} ({first['exact_error']:.1e})"
    assert cells[5] == f"{first['exact_ms'] / first['fast_ms']:.2f}×"
    partial = {"shapes": [{"in": 8, "out": 16, "tokens": 32, "products": {"forward": {"bf16_tflops": 1.0}}}]}
    assert "| 8 → 16, 32 | forward | 1 | — | — | — |" in fp8_tables.render_fp8_accum(
        [partial], ["x.json"], {}
    )


def test_fp8_loss_table_says_which_target_is_met():
    report = json.loads((RESULTS / "fp8_loss_curves_default_h100.json").read_text())
    table = fp8_tables.render_fp8_loss([report], ["fp8_loss_curves_default_h100.json"], {})
    rows = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| default")}
    assert set(rows) == set(report["results"])
    verdict = report["against_baseline"]["fp8_all"]
    expected = {True: "yes", False: "**no**"}
    assert (
        rows["fp8_all"]
        .rstrip(" |")
        .endswith(f"{expected[verdict['loss_within_1pct']]} / {expected[verdict['exact_match_within_0_02']]}")
    )
    assert f"({verdict['final_loss_relative']:+.1%})" in rows["fp8_all"]
    assert rows["bf16"].rstrip(" |").endswith("—")


def test_fp8_loss_over_seeds_compares_the_means_and_keeps_each_seed():
    script = benchmark_script("fp8_loss_curves")
    assert "seed=2" in script.overrides("default", "fp8", 200, Path("/tmp/x"), seed=2)
    assert not any(a.startswith("seed=") for a in script.overrides("default", "fp8", 200, Path("/tmp/x")))

    def run(loss, match):
        return {
            "train_loss": [[0, 1.0]],
            "final_train_loss": loss,
            "val_loss": loss,
            "val_exact_match": match,
        }

    bf16 = script.combine_seeds({0: run(0.10, 0.70), 1: run(0.12, 0.72), 2: run(0.08, 0.74)})
    fp8 = script.combine_seeds({0: run(0.11, 0.69), 1: run(0.12, 0.71), 2: run(0.082, 0.73)})
    assert bf16["train_loss"] == [[0, 1.0]] and [r["seed"] for r in bf16["seeds"]] == [0, 1, 2]
    verdict = script.compare({"bf16": bf16, "fp8": fp8})["fp8"]
    assert verdict["final_loss_relative"] == pytest.approx(0.312 / 0.30 - 1)  # means: 0.104 vs 0.100
    assert verdict["exact_match_change"] == pytest.approx(-0.01)
    assert not verdict["loss_within_1pct"] and verdict["exact_match_within_0_02"]
    assert verdict["per_seed_final_loss_relative"] == pytest.approx({"0": 0.1, "1": 0.0, "2": 0.025})
    assert verdict["baseline_seed_spread"] == pytest.approx(0.2)  # 0.12 and 0.08 around 0.10
    report = {"task": "default", "steps": 200, "compute": "32-true", "results": {"bf16": bf16, "fp8": fp8}}
    report["against_baseline"] = {"fp8": verdict}
    table = fp8_tables.render_fp8_loss([report], ["x.json"], {})
    rows = {
        line.split(" | ")[1]: line
        for line in table.splitlines()
        if line.startswith("| default, 200, 32-true")
    }
    assert "| 0.1040 (+4.0%) |" in rows["fp8"] and "| 0.1000 |" in rows["bf16"]
    assert "3 seeds: +10.0%, +0.0%, +2.5%; ±20.0%" in rows["fp8"] and "| 3 seeds |" in rows["bf16"]


def test_long_context_table_has_a_column_per_step_and_every_category():
    names = ["long_context_llama_3_1_8b_16k_nf4_h100.json", "long_context_llama_3_1_8b_352256_nf4_h100.json"]
    reports = [json.loads((RESULTS / name).read_text()) for name in names]
    table = bench_tables.render_long_context(reports, names, {})
    rows = {
        line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ")[1:]
        for line in table.splitlines()[2:]
    }
    assert rows["fits"] == ["yes", "yes"]
    assert rows["peak allocated (reserved)"][0].startswith(f"{reports[0]['peak_allocated_gib']:.2f} GiB")
    for row in reports[0]["accounting"]["rows"]:
        cells = rows[f"{row['part']}: {row['category']}"]
        assert cells == [f"{row['gib']:.2f} GiB", "—"]  # the 352k step ran without the accounting
    assert rows["peak at"][0] == f"`{reports[0]['accounting']['peak_site'].split(' < ')[0]}`"


def test_report_rewrites_the_readme_and_every_doc_and_check_names_the_stale_one(tmp_path, capsys):
    results, args = _project(tmp_path)
    assert bench_report.main([*args, "--check"]) == 1
    assert bench_report.main(args) == 0
    readme, doc = (tmp_path / "README.md").read_text(), (tmp_path / "docs" / "a.md").read_text()
    assert "stale" not in readme and "stale" not in doc and "| RMSNorm (" in doc
    assert readme.split("\n", 1)[1] == doc.split("\n", 1)[1]
    assert bench_report.main([*args, "--check"]) == 0
    (tmp_path / "docs" / "a.md").write_text(doc.replace("| RMSNorm (", "| RMS (", 1))
    capsys.readouterr()
    assert bench_report.main([*args, "--check"]) == 1
    out = capsys.readouterr().out
    assert "a.md: benchmark tables differ" in out and "README.md: benchmark" not in out


def test_one_block_name_with_two_parameter_sets_is_refused(tmp_path):
    _, args = _project(tmp_path)
    (tmp_path / "docs" / "b.md").write_text(
        "<!-- bench:k kind=kernels sources=other.json -->\n<!-- /bench:k -->\n"
    )
    with pytest.raises(ValueError, match="block 'k' is in .*README.md and .*b.md with different parameters"):
        bench_report.main(args)


def test_committed_readme_and_docs_match_the_committed_json():
    files = bench_report.markdown_files(ROOT / "README.md", ROOT / "docs")
    assert {"benchmarks.md", "moe.md", "multi-gpu.md", "performance.md", "qlora.md"} <= {
        p.name for p in files
    }
    texts = {path: path.read_text() for path in files}
    bench_report.check_block_names(texts)
    for path, text in texts.items():
        once = bench_report.update_readme(text, RESULTS, path.parent)
        assert once == text, f"{path}: stale benchmark tables; run `python -m lightning_sloth.bench report`"
