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
