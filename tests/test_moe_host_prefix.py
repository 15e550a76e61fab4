"""The host-prefix probe (benchmarks/probes/moe_host_prefix.py): its timing helper on CPU."""

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "moe_host_prefix.py"
_spec = importlib.util.spec_from_file_location("moe_host_prefix", _SCRIPT)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_host_us_is_a_positive_median_on_cpu():
    assert probe.host_us(lambda: sum(range(100)), reps=9, sync_every=3) > 0
