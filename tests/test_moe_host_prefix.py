"""The host-prefix probe's arithmetic (benchmarks/probes/moe_host_prefix.py) on synthetic kernels."""

import importlib.util
import math
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "moe_host_prefix.py"
_spec = importlib.util.spec_from_file_location("moe_host_prefix", _SCRIPT)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_idle_before_counts_the_uncovered_time_up_to_the_first_marked_kernel():
    kernels = [
        (100.0, 110.0, "router"),
        (105.0, 120.0, "topk"),  # overlaps the router: covered once
        (150.0, 160.0, "sort"),
        (400.0, 900.0, "_indexed_grouped_mm_kernel"),
        (950.0, 990.0, "_indexed_grouped_mm_kernel"),
    ]
    idle, span = probe.idle_before(kernels[::-1], "grouped_mm_kernel")
    assert span == 300.0 and idle == 300.0 - 20.0 - 10.0


def test_idle_before_without_the_marker_or_kernels():
    idle, span = probe.idle_before([(0.0, 1.0, "a")], "grouped_mm_kernel")
    assert math.isnan(idle) and math.isnan(span)
    assert probe.idle_before([], "x") == (0.0, 0.0)


def test_host_us_is_a_positive_median_on_cpu():
    assert probe.host_us(lambda: sum(range(100)), reps=9, sync_every=3) > 0
