"""The benchmark suite end to end on CPU (tiny scenario), its guard, and the generated README tables."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lightning_sloth.bench import measure as bench_measure
from lightning_sloth.bench import report as bench_report
from lightning_sloth.bench import suite as bench_suite
from lightning_sloth.bench import systems as bench_systems
from lightning_sloth.bench import tables as bench_tables
from lightning_sloth.bench import workload as bench_workload

ROOT = Path(__file__).resolve().parents[1]
PACKED = [
    "hf_packed_sdpa",
    "hf_packed_varlen",
    "hf_packed_varlen_per_layer",
    "sloth_trainer",
    "sloth_kernels",
    "sloth_kernels_metadata_per_layer",
    "sloth_kernels_torch_checkpoint",
]


def tiny_config(out_dir: Path, systems: list[str], scenario: str = "tiny", extra: tuple[str, ...] = ()):
    with initialize_config_module(config_module="lightning_sloth.conf.bench", version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                f"scenario={scenario}",
                f"systems.names=[{','.join(systems)}]",
                "isolate=false",
                f"out_dir={out_dir}",
                "probe.size=128",
                "probe.iters=2",
                "git_commit=0123456789abcdef",
                *extra,
            ],
        )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    report = bench_suite.run_suite(tiny_config(out, ["hf_padded", *PACKED]))
    return out, report


def test_tiny_scenario_writes_one_complete_json(tiny_run):
    out, report = tiny_run
    [path] = sorted(out.glob("*.json"))
    assert path.name == "bench_tiny_cpu.json"
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(report))
    env = saved["environment"]
    for key in ("device", "driver", "torch", "triton", "transformers", "peft", "liger_kernel", "unsloth"):
        assert key in env  # None when absent
    assert env["git_commit"] == "0123456789abcdef" and env["matmul_probe_tflops"] > 0
    assert saved["scenario"]["name"] == "tiny" and saved["workload"]["timed_steps"] == 2
    assert [r["system"] for r in saved["results"]] == ["hf_padded", *PACKED]
    for record in saved["results"]:
        assert record["status"] == "ok", record
        assert record["tokens_per_s_min"] <= record["tokens_per_s_median"] <= record["tokens_per_s_max"]
        assert len(record["tokens_per_s_steps"]) == 2 and record["mfu_measured"] > 0
        assert record["lora_A_grad_norm"] > 0 and record["lora_B_grad_norm"] > 0
        assert math.isfinite(record["first_loss"]) and math.isfinite(record["last_loss"])
        assert "peak_allocated_gib" in record and "peak_reserved_gib" in record
        assert "gpu_busy_share" not in record  # one profiled CUDA step; none on the CPU


def test_every_packed_system_trains_the_same_model_on_the_same_rows(tiny_run):
    # Same weights, same packed rows, same LoRA: the first loss agrees (bf16 autocast), whichever
    # path (plain loop, Trainer, kernels, per-layer metadata) trained it.
    _, report = tiny_run
    first = {r["system"]: r["first_loss"] for r in report["results"]}
    for name in PACKED[1:]:
        assert first[name] == pytest.approx(first["hf_packed_sdpa"], rel=2e-3), name


def test_report_writes_readme_table_and_plot_deterministically(tiny_run, tmp_path):
    out, _ = tiny_run
    results = tmp_path / "results"
    shutil.copytree(out, results)
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n<!-- bench:bench_tiny_cpu baseline=hf_padded -->\nstale\n<!-- /bench:bench_tiny_cpu -->\nend\n"
    )
    args = ["--results", str(results), "--readme", str(readme)]
    assert bench_report.main(args) == 0
    first = readme.read_text()
    png = (results / "bench_tiny_cpu.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert bench_report.main(args) == 0
    assert readme.read_text() == first and (results / "bench_tiny_cpu.png").read_bytes() == png
    assert bench_report.main([*args, "--check"]) == 0
    assert "stale" not in first and first.startswith("intro\n") and first.endswith("end\n")
    assert "![tiny Llama" in first and "](results/bench_tiny_cpu.png)" in first
    table = [line for line in first.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + 1 + len(PACKED)
    assert "| 1.00× |" in table[2]  # the baseline row
    readme.write_text(first.replace(table[3], table[3].replace("|", "| 1 |", 1)))
    assert bench_report.main([*args, "--check"]) == 1


def test_guard_fails_a_run_with_zeroed_gradients(monkeypatch):
    def zero_grads(workload):
        model = bench_systems.sloth_setup()(workload)
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(torch.zeros_like)
        return model

    system = bench_systems.SuiteSystem("zeroed", zero_grads, bench_workload.packed_batches)
    monkeypatch.setitem(bench_systems.SUITE_SYSTEMS, "zeroed", system)
    scenario = OmegaConf.to_container(tiny_config(Path("/tmp"), ["sloth"])["scenario"])
    scenario["workload"] |= {"warmup_steps": 0, "timed_steps": 1}
    record = bench_suite.measure("zeroed", scenario)
    assert record["status"] == "failed"
    assert record["reason"] == "trainable gradients are all zero"


def test_guard_reasons():
    assert bench_measure.guard({"losses": [1.0, 0.9], "grad_norm": 0.5}) is None
    assert "loss not finite" in bench_measure.guard({"losses": [1.0, float("nan")], "grad_norm": 0.5})
    assert "not finite" in bench_measure.guard({"losses": [1.0], "grad_norm": float("inf")})
    assert "no trainable" in bench_measure.guard({"losses": [1.0], "grad_norm": None})


def test_committed_readme_tables_match_the_committed_json():
    text = (ROOT / "README.md").read_text()
    assert bench_report.MARKER.search(text), "the README has generated benchmark tables"
    once = bench_report.update_readme(text, ROOT / "benchmarks" / "results", ROOT)
    assert once == text, "README benchmark tables are stale: run `python -m lightning_sloth.bench report`"
    assert bench_report.update_readme(once, ROOT / "benchmarks" / "results", ROOT) == once


def test_failed_and_older_records_render():
    rows = [
        {"system": "hf_padded", "tokens_per_s": 100.0, "peak_allocated_gib": 1.0, "mfu": 0.1},
        {"system": "sloth_kernels", "oom": True, "error": "CUDA out of memory | x"},
        {"system": "sloth", "status": "failed", "reason": "loss not finite (nan)", "tokens_per_s": 9e9},
    ]
    report = {
        "environment": {"device": "X"},
        "workload": dict(tokens_per_step=1, lora_r=1, warmup_steps=0, timed_steps=1),
        "results": rows,
    }
    table = bench_tables.render_table([report], ["x.json"], "hf_padded")
    assert "**oom**: CUDA out of memory \\| x" in table
    assert "**failed**: loss not finite" in table and "9,000,000,000" not in table


def test_caption_names_each_files_steps_when_they_differ():
    def report(warmup, timed):
        work = dict(tokens_per_step=8, lora_r=4, warmup_steps=warmup, timed_steps=timed)
        return {"environment": {"device": "X"}, "workload": work, "results": []}

    same = bench_tables.caption([report(5, 20), report(5, 20)], ["a.json", "b.json"])
    assert same.endswith("5 warm-up + 20 timed steps.")
    mixed = bench_tables.caption([report(5, 20), report(1, 3)], ["a.json", "b.json"])
    assert "`a.json`: 5 warm-up + 20 timed steps, `b.json`: 1 warm-up + 3 timed steps" in mixed


def test_unknown_system_or_scenario_key_is_named(tmp_path):
    with pytest.raises(SystemExit, match="unknown system 'fast'"):
        bench_suite.run_suite(tiny_config(tmp_path, ["fast"]))
    with pytest.raises(ValueError, match="unknown workload keys"):
        bench_workload.register_scenario({"name": "x", "shape": "tiny", "workload": {"token_per_step": 1}})


def test_a_commit_hash_read_as_a_number_is_refused(tmp_path):
    """Hydra reads git_commit=982e255 as the float 9.82e257; the run stops before measuring."""
    with initialize_config_module(config_module="lightning_sloth.conf.bench", version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=["scenario=tiny", f"out_dir={tmp_path}", "git_commit=982e255"]
        )
    with pytest.raises(ValueError, match="git_commit=9.82e.* was read as a float.*quote it"):
        bench_suite.run_suite(cfg)
    assert not list(tmp_path.iterdir())


def test_device_tags():
    assert bench_suite.device_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert bench_suite.device_tag("NVIDIA H200") == "h200"
    assert bench_suite.device_tag("CPU (x86_64, 2 cores)") == "cpu"


def test_moe_scenario_runs_transformers_experts_and_ours(tmp_path):
    # tiny_moe: transformers' grouped_mm experts + PEFT target_parameters LoRA against ours, the
    # same weights and rows; MFU counts only the active experts.
    report = bench_suite.run_suite(tiny_config(tmp_path, ["hf_packed_sdpa", "sloth_kernels"], "tiny_moe"))
    hf, ours = report["results"]
    for record in (hf, ours):
        assert record["status"] == "ok", record
        assert record["lora_A_grad_norm"] > 0 and record["lora_B_grad_norm"] > 0
    assert ours["first_loss"] == pytest.approx(hf["first_loss"], rel=2e-3)
    assert ours["lora_B_grad_norm"] == pytest.approx(hf["lora_B_grad_norm"], rel=2e-2)
    model = bench_workload.build_model(bench_workload.register_scenario(report["scenario"]), "sdpa")
    inactive = bench_measure.inactive_expert_parameters(model)
    assert 0 < inactive < sum(p.numel() for p in model.parameters())


def test_qlora_systems_train_the_same_nf4_weights(tmp_path):
    # bitsandbytes' Linear4bit over our NF4 storage, and ours, on the bitsandbytes CPU backend.
    systems = ["hf_bnb_packed", "sloth_nf4", "sloth_nf4_offload"]
    report = bench_suite.run_suite(tiny_config(tmp_path, systems))
    records = {r["system"]: r for r in report["results"]}
    for record in records.values():
        assert record["status"] == "ok", record
        assert record["lora_A_grad_norm"] > 0 and record["lora_B_grad_norm"] > 0
    hf = records["hf_bnb_packed"]
    for name in systems[1:]:
        assert records[name]["first_loss"] == pytest.approx(hf["first_loss"], rel=2e-3)
        assert records[name]["lora_B_grad_norm"] == pytest.approx(hf["lora_B_grad_norm"], rel=2e-2)
    assert records["sloth_nf4_offload"]["offload"]  # the offloader ran


@pytest.mark.parametrize(
    "name",
    [
        "llama_3_2_1b",
        "qwen3_0_6b",
        "llama_3_1_8b",
        "tiny",
        "tiny_moe",
        "qwen3_30b_a3b_8l",
        "qlora_llama_3_1_8b",
    ],
)
def test_every_scenario_config_composes_to_its_model(name, tmp_path):
    with initialize_config_module(config_module="lightning_sloth.conf.bench", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"scenario={name}"])
    scenario = OmegaConf.to_container(cfg.scenario)
    workload = bench_workload.register_scenario(scenario)
    assert workload.timed_steps >= 2 and workload.tokens_per_step >= 256
    if not name.startswith("tiny"):  # the benchmark method: >= 20 timed steps after the warm-up
        assert workload.timed_steps >= 20 and workload.warmup_steps >= 5
    from transformers import AutoConfig

    family = bench_workload.SHAPE_FAMILIES.get(workload.shape, "llama")
    config = AutoConfig.for_model(family, **bench_workload.SHAPES[workload.shape])
    if name == "qwen3_0_6b":
        assert config.model_type == "qwen3"
        assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (1024, 28, 128)
        assert (config.num_attention_heads, config.num_key_value_heads) == (16, 8)
        assert (config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (
            3072,
            151936,
            True,
        )
    assert list(cfg.systems.names)  # the default system set


def test_unknown_block_kind_is_named(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"environment": {}, "results": []}))
    text = "<!-- bench:x kind=pie -->\n<!-- /bench:x -->\n"
    with pytest.raises(ValueError, match="unknown kind 'pie'"):
        bench_report.update_readme(text, tmp_path, tmp_path)


def test_a_profiled_system_writes_its_step_table_beside_the_json(tmp_path):
    """``profile=[NAME]``: the system's loop runs one more step under the profiler and writes its
    operators (with input shapes) to ``profile_<scenario>_<tag>_<system>.txt``; the record names the
    file. A profiled system the run does not measure is refused before anything runs."""
    torch.manual_seed(0)
    report = bench_suite.run_suite(
        tiny_config(tmp_path, ["sloth_kernels"], extra=("profile=[sloth_kernels]",))
    )
    [record] = report["results"]
    assert record["status"] == "ok", record
    path = Path(record["profile"])
    assert (
        path.parent == tmp_path
        and path.name.startswith("profile_tiny_")
        and path.name.endswith("_sloth_kernels.txt")
    )
    text = path.read_text()
    assert text.startswith("lightning_sloth: transform_model(kernels=True) (API path): step ")
    assert "Operators by input shape" in text and "aten::" in text
    with pytest.raises(ValueError, match="profile="):
        bench_suite.run_suite(tiny_config(tmp_path, ["sloth_kernels"], extra=("profile=[hf_padded]",)))
