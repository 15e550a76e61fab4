"""The host profile's account of where a profiled step's GPU waited (the profiling needs a GPU)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "host_profile.py"
_spec = importlib.util.spec_from_file_location("host_profile", _SCRIPT)
host_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_profile)


def _kernel(start, end, name, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), name=name, device_type=device)


def test_gaps_are_binned_ranked_and_kernels_summed_by_name():
    events = [  # microseconds
        _kernel(100, 110, "gemm"),
        _kernel(115, 130, "norm"),  # 5 us gap
        _kernel(120, 125, "copy"),  # overlaps: no gap
        _kernel(430, 450, "gemm"),  # 300 us gap
        _kernel(2450, 2460, "norm"),  # 2000 us gap
        _kernel(0, 5000, "host op", device=torch.autograd.DeviceType.CPU),  # not a GPU event
    ]
    gaps = host_profile.gpu_gaps(events, wall_us=3000.0, top=2)
    assert gaps["kernels"] == 5 and gaps["gaps"] == 3
    assert gaps["busy_ms"] == pytest.approx((10 + 15 + 20 + 10) / 1e3)
    assert gaps["outside_ms"] == pytest.approx((3000 - 2360) / 1e3)  # the wall beyond the kernels' span
    assert gaps["idle_ms_by_gap"]["<10us"] == pytest.approx(0.005)
    assert gaps["idle_ms_by_gap"]["200-1000us"] == pytest.approx(0.3)
    assert gaps["idle_ms_by_gap"][">1000us"] == pytest.approx(2.0)
    assert [(g["before"], g["after"]) for g in gaps["longest"]] == [("gemm", "norm"), ("norm", "gemm")]
    assert gaps["longest"][0]["at_ms"] == pytest.approx(0.35)  # from the first kernel's start
    assert gaps["kernels_by_time"][0] == {"name": "gemm", "ms": pytest.approx(0.03), "count": 2}
    assert host_profile.gpu_gaps([], 1.0, 3)["kernels_by_time"] == []
