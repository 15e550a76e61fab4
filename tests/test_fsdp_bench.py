"""The multi-GPU benchmark: system names, sizes and scaling, the large shapes, and one run of the
meta-device path on two CPU processes (the timed runs need GPUs)."""

import json
import sys
from pathlib import Path

import pytest

# An importable module (not a file spec): the benchmark's spawned workers import it by name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fsdp_bench  # noqa: E402

_SHARDED = {"shard_frozen": True}  # a suffixed name shards the base unless it says _whole_base


@pytest.mark.parametrize(
    "system,options",
    [
        ("sloth_fsdp", {}),  # the strategy's defaults
        # a suffixed name spells the whole configuration: torch's checkpoint and resharding unless named
        ("sloth_fsdp_no_reshard", {"checkpoint_impl": "torch", "reshard_after_forward": False, **_SHARDED}),
        ("sloth_fsdp_node", {"checkpoint_impl": "node", "reshard_after_forward": True, **_SHARDED}),
        (
            "sloth_fsdp_node_no_reshard",
            {"checkpoint_impl": "node", "reshard_after_forward": False, **_SHARDED},
        ),
        (
            "sloth_fsdp_unit4",
            {"checkpoint_impl": "torch", "reshard_after_forward": True, "layers_per_unit": 4, **_SHARDED},
        ),
        (
            "sloth_fsdp_node_unit2_no_reshard",
            {"checkpoint_impl": "node", "layers_per_unit": 2, "reshard_after_forward": False, **_SHARDED},
        ),
        (
            "sloth_fsdp_node_no_reshard_whole_base",
            {"checkpoint_impl": "node", "reshard_after_forward": False, "shard_frozen": False},
        ),
        (
            "sloth_fsdp_shard_frozen",
            {"checkpoint_impl": "torch", "reshard_after_forward": True, "shard_frozen": True},
        ),
        (
            "sloth_fsdp_node_shard_frozen",
            {"checkpoint_impl": "node", "reshard_after_forward": True, "shard_frozen": True},
        ),
        ("sloth_ddp", None),
    ],
)
def test_sloth_fsdp_system_names_carry_the_strategy_options(system, options):
    assert fsdp_bench.fsdp_options(system) == options
    assert fsdp_bench.processes(system, 4) == 4
    assert fsdp_bench.processes("sloth_1gpu", 4) == 1


@pytest.mark.parametrize(
    "system",
    [
        "sloth_fsdp_unit",
        "sloth_fsdp_unitx",
        "sloth_fsdp_fast",
        "sloth_fsdp_unit2_node",
        "sloth_fsdp_whole_base_node",
    ],
)
def test_an_unknown_sloth_fsdp_system_is_refused(system):
    with pytest.raises(ValueError, match="unknown system"):
        fsdp_bench.fsdp_options(system)


def test_an_unknown_system_is_refused_before_any_runs():
    with pytest.raises(ValueError, match="unknown system 'ddp'"):
        fsdp_bench.main(["--systems", "sloth_fsdp,ddp"])


def test_the_fsdp_table_shows_scaling_and_busy_shares_where_profiled():
    from lightning_sloth.bench.tables import render_fsdp

    def run(system, world, tps, **extra):
        return {
            "system": system,
            "world": world,
            "gpus": world,
            "shape": "llama_3_2_1b",
            "lora": True,
            "tokens_per_s_per_gpu": tps,
            "median_step_s": 0.3,
            "peak_allocated_gib": 4.0,
            "peak_reserved_gib": 5.0,
            "mfu": 0.4,
            "first_loss": 12.0,
            "last_loss": 11.9,
            "grad_norm_last_step": 0.25,
            "warmup_steps": 3,
            "timed_steps": 10,
        } | extra

    shares = dict(gpu_busy_share=0.9, compute_busy_share=0.85, nccl_busy_share=0.11)
    runs = [run("sloth_1gpu", 1, 60000.0, **shares), run("sloth_fsdp", 2, 54000.0, **shares)]
    runs.append(
        {"system": "sloth_fsdp_unit9", "world": 2, "gpus": 2, "shape": "llama_3_2_1b", "error": "boom"}
    )
    report = {"environment": {"device": "NVIDIA H200", "torch": "2.11"}, "runs": runs}
    table = render_fsdp([report], ["x.json"], {})
    rows = [line for line in table.splitlines() if line.startswith("| llama")]
    assert "GPU busy (compute / NCCL)" in table
    assert "54,000 (90.0% scaling)" in rows[1] and rows[1].endswith("| 90.0% (85.0% / 11.0%) |")
    header = next(line for line in table.splitlines() if line.startswith("| shape"))
    assert rows[2].count("|") == header.count("|")  # an error row keeps the columns

    # Two calls in one table: each run's scaling is against its own file's one-GPU run; a file
    # without one borrows another's.
    second = {
        "environment": report["environment"],
        "runs": [run("sloth_1gpu", 1, 50000.0), run("sloth_fsdp", 2, 48000.0)],
    }
    third = {"environment": report["environment"], "runs": [run("sloth_fsdp", 2, 45000.0)]}
    table = render_fsdp([report, second, third], ["x.json", "y.json", "z.json"], {})
    rows = [line for line in table.splitlines() if line.startswith("| llama") and "`sloth_fsdp`" in line]
    assert "54,000 (90.0% scaling)" in rows[0] and "48,000 (96.0% scaling)" in rows[1]
    assert "45,000 (90.0% scaling)" in rows[2]


def test_gpu_sizes_are_ascending_distinct_counts():
    assert fsdp_bench.gpu_sizes("4") == [4] and fsdp_bench.gpu_sizes("1,2,4,8") == [1, 2, 4, 8]
    for bad in ("4,2", "2,2", "0,2"):
        with pytest.raises(ValueError, match="ascending distinct positive"):
            fsdp_bench.gpu_sizes(bad)


def test_one_gpu_runs_a_sharded_system_on_one_device():
    assert fsdp_bench.ran_as("sloth_fsdp_unit4", 1) == "sloth_1gpu"
    assert fsdp_bench.ran_as("sloth_fsdp", 2) == "sloth_fsdp"
    assert (
        fsdp_bench.ran_as("sloth_ddp", 1) == "sloth_ddp"
        and fsdp_bench.ran_as("stock_fsdp", 1) == "stock_fsdp"
    )


def test_scaling_efficiency_is_against_the_smallest_size_measured_of_the_same_run():
    def run(system, gpus, tps=None, lora=True, **extra):
        return {
            "system": system,
            "gpus": gpus,
            "shape": "s",
            "lora": lora,
            "tokens_per_s_per_gpu": tps,
        } | extra

    records = [
        run("sloth_fsdp", 1, error="out of memory"),
        run("sloth_fsdp", 2, 100.0),
        run("sloth_fsdp", 4, 92.0),
        run("sloth_fsdp", 1, 50.0, lora=False),
        run("sloth_fsdp", 4, 45.0, lora=False),
        run("sloth_ddp", 4, 80.0),
    ]
    del records[0]["tokens_per_s_per_gpu"]
    fsdp_bench.add_scaling(records)
    assert "scaling_efficiency" not in records[0]  # the failed run: nothing to scale
    assert [r["scaling_efficiency"] for r in records[1:]] == pytest.approx([1.0, 0.92, 1.0, 0.9, 1.0])
    assert [r["scaling_base_gpus"] for r in records[1:]] == [2, 2, 1, 1, 4]
    # a variant measured only at four GPUs scales against the one-GPU run of sloth_1gpu
    records = [run("sloth_1gpu", 1, 100.0), run("sloth_fsdp_no_reshard", 4, 93.0), run("sloth_ddp", 2, 96.0)]
    fsdp_bench.add_scaling(records)
    assert [r["scaling_efficiency"] for r in records] == pytest.approx([1.0, 0.93, 0.96])
    assert [r["scaling_base_gpus"] for r in records] == [1, 1, 1]


def test_impossible_runs_are_refused_before_any_starts():
    with pytest.raises(ValueError, match="stock_fsdp has no 4-bit base weights"):
        fsdp_bench.main(["--lora", "--quantize", "nf4", "--systems", "sloth_fsdp,stock_fsdp"])
    with pytest.raises(ValueError, match="sloth_ddp holds the whole model"):
        fsdp_bench.main(["--init", "meta", "--systems", "sloth_fsdp,sloth_ddp"])
    with pytest.raises(ValueError, match="trains LoRA only"):
        fsdp_bench.main(["--finetune", "lora,full", "--quantize", "nf4", "--systems", "sloth_fsdp"])


@pytest.mark.parametrize("shape,layers,billions", [("qwen3_30b_a3b", 48, 30.5), ("llama_3_1_70b", 80, 70.6)])
def test_the_large_shapes_are_the_real_models_and_built_per_shard(shape, layers, billions):
    from lightning_sloth.bench.workload import shape_config

    assert shape_config(shape).num_hidden_layers == layers
    gib = fsdp_bench.shape_bf16_gib(shape)
    assert gib * 2**30 / 2 / 1e9 == pytest.approx(billions, rel=0.01)
    assert gib > 40.0  # --init auto builds them on the meta device, shard by shard


def test_moe_mfu_counts_the_experts_a_token_runs_through():
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_sloth.bench.workload import shape_config
    from lightning_sloth.module import flop_parameters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config("qwen3_30b_a3b"))
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    active = fsdp_bench.active_flop_parameters(model)
    assert active == flop_parameters(model) - experts + experts * 8 // 128
    assert 3.0e9 < active < 3.5e9  # "A3B": about three billion active parameters (lm_head included)


def test_a_meta_moe_in_nf4_runs_in_the_benchmark_on_two_cpu_processes(tmp_path):
    """The 30B/70B path end to end on a tiny Qwen3-MoE: built on the meta device, NF4 experts and
    projections made per rank, LoRA on attention and experts, one timed step."""
    out = tmp_path / "r.json"
    argv = ["--shape", "tiny_moe", "--lora", "--quantize", "nf4", "--gpus", "2", "--systems", "sloth_fsdp"]
    argv += ["--init", "meta", "--tokens", "256", "--warmup", "1", "--steps", "1", "--out", str(out)]
    fsdp_bench.main(argv)
    (record,) = json.loads(out.read_text())["runs"]
    assert "error" not in record, record.get("traceback", record.get("error"))
    assert record["applied"][-1] == "shards made per rank (RandomWeights)" and record["init"] == "meta"
    assert record["tokens_per_s_total"] == pytest.approx(2 * record["tokens_per_s_per_gpu"], rel=0.5)
    assert record["scaling_efficiency"] == 1.0 and record["gpus"] == 2 and record["quantize"] == "nf4"
    stats = record["shard_stats_per_rank"]
    assert sum(s["local_4bit_bytes"] for s in stats) == stats[0]["total_4bit_bytes"] > 0


def test_the_local_shards_host_bench_runs_both_paths(tmp_path):
    """``benchmarks/local_shards_bench.py`` (timings only, nothing asserted about them): both paths and
    both AdamW implementations over two processes, written to its JSON."""
    import local_shards_bench

    out = tmp_path / "local_shards.json"
    report = local_shards_bench.main(["--layers", "1", "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert report["tensors"] == 14 and json.loads(out.read_text()) == report
    assert set(report["milliseconds"]) == {
        f"{p}/{i}" for p in ("dtensor", "local_shards") for i in ("foreach", "fused")
    }
