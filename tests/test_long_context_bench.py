"""benchmarks/long_context_bench.py and benchmarks/memory_accounting.py at tiny size on the CPU: one
optimizer step built straight in 4 bits, the accounting's held part, the bisection driver."""

import importlib.util
import json
import sys
from pathlib import Path

import _processes
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("long_context_bench")
accounting = _load("memory_accounting")


def test_one_step_in_four_bits_with_the_accounting(tmp_path, monkeypatch):
    """A tiny shape built in NF4 trains one step of one 128-token sequence on the CPU, chunked MLPs
    and offload on; the held bytes add up from the model's own tensors."""
    from lightning_sloth.quant import Linear4bit

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # main() sets it only where unset
    record = bench.main(
        ["step", "--shape", "tiny", "--tokens", "128", "--device", "cpu", "--lora-r", "4",
         "--mlp-chunk-tokens", "48", "--account"]
    )  # fmt: skip
    assert record["fits"] and record["loss"] > 0 and "step_seconds" in record and "build_seconds" in record
    assert any("token-chunked" in step for step in record["applied"])
    saved = json.loads((tmp_path / "step_tiny_nf4_128.json").read_text())
    rows = {r["category"]: r["gib"] for r in saved["accounting"]["rows"]}
    assert rows["4-bit weights"] > 0 and rows["LoRA parameters"] > 0 and rows["optimizer state"] > 0
    # AdamW: two float32 moments per trainable float32 parameter.
    assert rows["optimizer state"] == pytest.approx(2 * rows["LoRA parameters"])
    assert saved["accounting"]["peak_allocated_gib"] is None  # the step's part needs CUDA

    config = bench.config_of("tiny")
    from lightning_sloth.quant import random_quantized

    model = random_quantized(config, "nf4", device="cpu", dtype=torch.float32).requires_grad_(False)
    four_bit = sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, Linear4bit)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    )
    held = accounting.model_bytes(model)
    assert held["4-bit weights"] == four_bit
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert held["4-bit weights"] + held["compute-dtype weights"] == total


def test_step_accounting_from_an_allocator_trace():
    frames = lambda path: [{"filename": f"/x/lightning_sloth/{path}", "line": 1, "name": "f"}]  # noqa: E731
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames("ops/linear_cross_entropy.py")},
        {"action": "alloc", "addr": 2, "size": 40, "frames": frames("patching/mlp_chunks.py")},
        {"action": "alloc", "addr": 3, "size": 7, "frames": frames("attention/varlen.py")},
        {"action": "free_completed", "addr": 2, "size": 40, "frames": []},
    ]
    step = accounting.step_bytes(trace)
    assert step["peak_bytes"] == 147
    assert step["rows"] == {"loss": 100, "MLP intermediates": 40, "attention": 7}
    result = accounting.table({"4-bit weights": 1000}, step, 1147, 1300)
    assert result["unexplained_gib"] == 0 and result["rows"][-1]["category"] == "fragmentation"
    assert accounting.category_of("torch/optim/adamw.py:1 step") == "optimizer state"
    assert accounting.category_of("somewhere/else.py:3 g") == "other"


def test_bisection_closes_on_the_grid():
    limit = 300_000
    calls = []

    def fits(tokens):
        calls.append(tokens)
        return tokens <= limit, 1.0

    result = bench.bisect(fits, 131072, 524288, 16384, lambda last: True)
    assert result["closed"] and result["low"] <= limit < result["high"]
    assert result["high"] - result["low"] <= 16384 and all(t % 16384 == 0 for t in calls)
    # Out of time after two probes: the bracket is reported open, for the next call.
    budget = iter([True, True, False])
    result = bench.bisect(fits, 131072, 524288, 16384, lambda last: next(budget))
    assert not result["closed"] and len(result["probes"]) == 2


def test_bisect_driver_runs_one_process_per_probe(tmp_path):
    """A probe in its own process writing its JSON; the bracket file names the result (a bf16
    base here: float32 on the CPU)."""
    env = {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    command = [
        sys.executable, str(ROOT / "benchmarks" / "long_context_bench.py"), "bisect", "--shape", "tiny",
        "--device", "cpu", "--base", "bf16", "--lora-r", "4", "--offload", "off", "--low", "32", "--high", "96",
        "--step", "32",
    ]  # fmt: skip
    done = _processes.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "bisect_tiny_bf16.json").read_text())
    # Every length fits on the CPU: 64, and the bracket closes at 64..96.
    assert [p["tokens"] for p in result["probes"]] == [64] and result["closed"] and result["low"] == 64
    assert [p.name for p in (tmp_path / "probes").iterdir()] == ["step_tiny_bf16_64.json"]
