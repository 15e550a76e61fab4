"""The kernel micro-benchmark's code paths, at toy shapes on the CPU (its timings need a GPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_bench.py"
_spec = importlib.util.spec_from_file_location("kernels_bench", _SCRIPT)
kernels_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kernels_bench  # dataclasses look their module up there
_spec.loader.exec_module(kernels_bench)

MEMORY_BOUND = {"rms_norm", "rope", "swiglu", "geglu"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels_bench") / "kernels.json"
    try:
        payload = kernels_bench.main(
            ["--out", str(out), "--device", "cpu", "--tiny", "--compile-backend", "eager", "--seed", "3"]
        )
    finally:
        torch.compiler.reset()
    return payload, out


def test_tiny_cpu_run_measures_every_op_and_implementation(tiny_run):
    payload, out = tiny_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))
    assert payload["config"]["tiny"] and payload["environment"]["liger_kernel"] == "skipped: needs CUDA"
    assert payload["copy_bandwidth_gbps"] > 0
    records = payload["records"]
    n_shapes = 5 + len(kernels_bench.TINY.vocab_sizes)  # linear_cross_entropy runs at each vocabulary
    assert len(records) == 3 * n_shapes
    assert {(r["op"], r["impl"]) for r in records} == {
        (op, impl) for op in kernels_bench.OPS for impl in ("ours", "eager", "compile")
    }
    for r in records:
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["peak_mib"] is None
        if r["op"] in MEMORY_BOUND:
            assert r["gbps"] > 0 and r["copy_fraction"] == pytest.approx(
                r["gbps"] / payload["copy_bandwidth_gbps"]
            )
            assert r["tflops"] is None
        else:
            assert r["tflops"] > 0 and r["gbps"] is None and r["copy_fraction"] is None
        if r["impl"] == "eager":
            assert r["speedup_vs_eager"] == 1.0
    assert not kernels_bench.failed_ours(payload)


def test_every_implementation_computes_the_same_outputs(tiny_run):
    # Same seed, same inputs: ours, eager and compiled agree on mean |output| (the loss for the CE).
    checks = {}
    for r in tiny_run[0]["records"]:
        checks.setdefault((r["op"], r["shape"]), []).append(r["output_check"])
    for key, values in checks.items():
        assert max(values) == pytest.approx(min(values), rel=1e-2), key


def test_minimal_bytes_count_each_tensor_once_per_direction():
    d = kernels_bench.TINY
    n, e = d.tokens, 2
    (glu,) = kernels_bench.build_cases("swiglu", d, lce_weight_grad=False)
    assert glu.min_bytes == 8 * n * d.intermediate * e
    (norm,) = kernels_bench.build_cases("rms_norm", d, lce_weight_grad=False)
    assert norm.min_bytes == (5 * n * d.hidden + 3 * d.hidden) * e
    lce = kernels_bench.build_cases("linear_cross_entropy", d, lce_weight_grad=True)
    assert [c.flops for c in lce] == [6 * n * d.hidden * v for v in d.vocab_sizes]


def test_table_shows_failures_and_missing_values():
    records = [
        {"op": "rope", "impl": "ours", "shape": "s", "status": "ok", "median_ms": 1.5, "gbps": 900.0,
         "copy_fraction": 0.3, "tflops": None, "peak_mib": None, "speedup_vs_eager": 2.0},
        {"op": "linear_cross_entropy", "impl": "eager", "shape": "s", "status": "oom",
         "error": "OutOfMemoryError: CUDA out of memory"},
    ]  # fmt: skip
    lines = kernels_bench.format_table(records).splitlines()
    assert "1.500" in lines[2] and "30.0" in lines[2] and "2.00" in lines[2]
    assert "OOM: OutOfMemoryError" in lines[3]
    assert kernels_bench.failed_ours({"records": [dict(records[1], impl="ours")]})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "rms_norm,layer_norm"], "unknown op 'layer_norm'"),
        (["--impls", "ours,triton"], "unknown implementation 'triton'"),
        (["--device", "cpu"], "--device cpu needs --tiny"),
    ],
)
def test_bad_arguments_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        kernels_bench.main(["--out", str(tmp_path / "x.json"), *argv])
    assert message in capsys.readouterr().err
