"""The multi-GPU benchmark's system names (the runs themselves need GPUs)."""

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fsdp_bench.py"
_spec = importlib.util.spec_from_file_location("fsdp_bench", _SCRIPT)
fsdp_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fsdp_bench)


@pytest.mark.parametrize(
    "system,options",
    [
        ("sloth_fsdp", {}),
        ("sloth_fsdp_no_reshard", {"reshard_after_forward": False}),
        ("sloth_fsdp_node", {"checkpoint_impl": "node"}),
        ("sloth_fsdp_unit4", {"layers_per_unit": 4}),
        (
            "sloth_fsdp_node_unit2_no_reshard",
            {"checkpoint_impl": "node", "layers_per_unit": 2, "reshard_after_forward": False},
        ),
        ("sloth_ddp", None),
    ],
)
def test_sloth_fsdp_system_names_carry_the_strategy_options(system, options):
    assert fsdp_bench.fsdp_options(system) == options
    assert fsdp_bench.processes(system, 4) == 4
    assert fsdp_bench.processes("sloth_1gpu", 4) == 1


@pytest.mark.parametrize(
    "system", ["sloth_fsdp_unit", "sloth_fsdp_unitx", "sloth_fsdp_fast", "sloth_fsdp_unit2_node"]
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
