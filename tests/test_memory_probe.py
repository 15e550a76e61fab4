"""The memory probe's trace replay (the recording itself needs a GPU)."""

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "memory_probe.py"
_spec = importlib.util.spec_from_file_location("memory_probe", _SCRIPT)
memory_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_probe)


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


MLP = [
    _frame("/x/torch/_ops.py", 1, "__call__"),
    _frame("/x/lightning_sloth/ops/glu.py", 80, "backward"),
    _frame("/x/torch/autograd/function.py", 2, "apply"),
    _frame("/x/transformers/models/llama/modeling_llama.py", 150, "forward"),
]
ATTN = [_frame("/x/lightning_sloth/attention.py", 40, "varlen")]


def test_peak_is_found_by_replaying_allocs_and_frees():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": MLP},
        {"action": "alloc", "addr": 2, "size": 50, "frames": ATTN},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 3, "size": 30, "frames": MLP},  # 180: the peak (free not completed)
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 4, "size": 60, "frames": ATTN},  # 140
        {"action": "free_completed", "addr": 99, "size": 7, "frames": []},  # allocated before recording
    ]
    result = memory_probe.peak_breakdown(trace)
    assert result["peak_bytes"] == 180 and result["peak_event"] == 3
    mlp_site = "ops/glu.py:80 backward < llama/modeling_llama.py:150 forward"
    assert result["peak_site"] == mlp_site
    assert result["sites"] == [
        {"site": mlp_site, "bytes": 130, "blocks": 2},
        {"site": "lightning_sloth/attention.py:40 varlen", "bytes": 50, "blocks": 1},
    ]


def test_plumbing_frames_are_skipped_and_empty_stacks_named():
    assert memory_probe.allocation_site(MLP, depth=1) == "ops/glu.py:80 backward"
    assert memory_probe.allocation_site([_frame("/x/torch/_ops.py", 1, "f")]) == "(no python frame)"
