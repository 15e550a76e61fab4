"""benchmarks/probes/moe_step_kernels.py on a synthetic Chrome trace: order, idle time, groups, TFLOP/s."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "moe_step_kernels.py"
_spec = importlib.util.spec_from_file_location("moe_step_kernels", _SCRIPT)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def _kernel(name, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def test_the_step_is_grouped_and_each_expert_gemm_gets_its_rate(tmp_path):
    gemm = "_indexed_grouped_mm_kernel"
    events = [
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 10_000},  # not a kernel
        _kernel("nvjet_router", 100, 20),
        _kernel("_tile_table_kernel", 400, 5),  # 280 us idle before it
        _kernel(gemm, 405, 50),  # a rank-r side pass: under the GEMM threshold
        _kernel(gemm, 455, 2000),
        _kernel("_clamped_swiglu_forward_kernel", 2455, 100),
        _kernel(gemm, 2555, 1000),
        _kernel("_slot_sum_kernel", 3555, 60),
        _kernel(gemm, 3615, 1000),
        _kernel("cutlass_grouped", 4615, 40),
        _kernel("_indexed_weight_grad_kernel", 4655, 30),
        _kernel(gemm, 4685, 2000),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 6685, "dur": 10},
    ]
    path = tmp_path / "gpt_oss_20b_sloth_fused.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)

    report = probe.summarise(str(path), "gpt_oss_20b", tokens=16384)
    kernels = report["kernels"]
    assert [k["name"] for k in kernels][:3] == ["nvjet_router", "_tile_table_kernel", gemm]
    assert kernels[1]["idle_before_us"] == pytest.approx(280.0)
    assert report["busy_us"] == pytest.approx(sum(e["dur"] for e in events[1:]))
    assert report["wall_us"] == pytest.approx(6695 - 100)
    groups = report["groups_us"]
    assert groups["expert GEMMs"] == 6000
    assert groups["rank-r side passes (indexed)"] == 50
    assert groups["activation"] == 100 and groups["slot sums"] == 60
    assert groups["LoRA weight gradients (indexed)"] == 30
    assert groups["rank-r products through torch._grouped_mm"] == 40
    assert groups["other (router, casts, sort, copies)"] == pytest.approx(20 + 10)
    first, second = probe.expert_gemm_flops("gpt_oss_20b", 16384)
    assert first == 2.0 * 16384 * 4 * 2880 * 5760 and second == first / 2
    roles = [(k["role"], k["tflops"]) for k in kernels if "role" in k]
    assert [r for r, _ in roles] == ["first fwd", "second fwd", "second dgrad", "first dgrad"]
    assert roles[0][1] == pytest.approx(first / 2000 / 1e6)
    assert report["expert_gemm_tflops"] == pytest.approx(2 * (first + second) / 6000 / 1e6)

    out = tmp_path / "kernels.json"
    assert len(probe.main([str(path), "--out", str(out)])["results"]) == 1
    assert json.loads(out.read_text())["results"][0]["trace"] == path.name
