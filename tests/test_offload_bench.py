"""The offload benchmark's longest-step search, with a stand-in for the GPU step (its timings need CUDA)."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_bench.py"
_spec = importlib.util.spec_from_file_location("offload_bench", _SCRIPT)
offload_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = offload_bench
_spec.loader.exec_module(offload_bench)


def _probe(monkeypatch, limit: int, *, tokens=16384, cap=262144, step=8192):
    tried = []

    def fits(model, setup, n, *, args, vocab):
        assert n % step == 0 and 0 < n <= cap
        tried.append(n)
        return n <= limit

    monkeypatch.setattr(offload_bench, "_fits", fits)
    args = SimpleNamespace(tokens=tokens, probe_max_tokens=cap, probe_step=step)
    return offload_bench.probe_max_tokens(None, "checkpoint", args, 128), tried


@pytest.mark.parametrize("limit", [0, 5000, 8192, 12000, 16384, 40000, 65536, 131072, 200000, 262144, 10**6])
def test_probe_finds_the_largest_fitting_multiple_of_the_step(monkeypatch, limit):
    found, tried = _probe(monkeypatch, limit)
    assert found == min(limit, 262144) // 8192 * 8192
    assert len(tried) == len(set(tried))  # no length is stepped twice
    assert len(tried) <= 10  # doubling then bisection, not a linear scan


def test_probe_starts_at_the_benchmarked_length(monkeypatch):
    _, tried = _probe(monkeypatch, 100000)
    assert tried[:4] == [16384, 32768, 65536, 131072]
    _, tried = _probe(monkeypatch, 10000)
    assert tried == [16384, 8192]
