"""The host-time micro-benchmark's code paths on the CPU (its figures are the benchmark's, not a test's)."""

import importlib.util
import json
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "host_calls.py"
_spec = importlib.util.spec_from_file_location("host_calls", _SCRIPT)
host_calls = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = host_calls
_spec.loader.exec_module(host_calls)


def test_host_calls_writes_every_case(tmp_path):
    out = tmp_path / "host.json"
    report = host_calls.main(["--device", "cpu", "--calls", "8", "--blocks", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert len(report["per_call_us"]) == 4 and all(v > 0 for v in report["per_call_us"].values())
    assert report["tiny_step_ms"] > 0 and report["tiny_step_node_checkpoint_ms"] > 0 and report["torch"]
