"""tests/_autotune.py: the autotuners take the first configuration that runs, not the fastest, and
write nothing to Triton's autotune cache (the kernel runs under the Triton interpreter on the CPU;
the timings are stand-ins, as the interpreter cannot time kernels)."""

import math

import pytest
import torch
from _autotune import _finite, first_working_config
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases


@interpreted_only
def test_interpreted_the_first_configuration_that_runs_is_taken(monkeypatch):
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    timed = []

    def fake_bench(self, *args, config, **meta):  # 16 "fails" to compile, 64 would be the fastest
        timed.append(config.kwargs["BLOCK"])
        return {16: [math.inf] * 3, 32: [2.0] * 3, 64: [1.0] * 3}[config.kwargs["BLOCK"]]

    monkeypatch.setattr(Autotuner, "_bench", fake_bench)
    undo = first_working_config()
    try:

        @triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"])
        @triton.jit
        def add_one(X, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(X + i, tl.load(X + i, mask=i < n) + 1, mask=i < n)

        add_one.cache_results = True  # as fla's autotuners: put back after the call, unused during it
        x = torch.zeros(100)
        add_one[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, 100)
        assert timed == [16, 32]  # 64 is never compiled or timed
        assert add_one.best_config.kwargs["BLOCK"] == 32
        assert add_one.cache_results
        assert torch.equal(x, torch.ones(100))
        add_one[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, 100)
        assert timed == [16, 32] and torch.equal(x, torch.full((100,), 2.0))  # the choice is kept
    finally:
        undo()
    assert Autotuner._bench is fake_bench


@pytest.mark.parametrize("timings, found", [([1.0, 1.0, 1.0], True), ([math.inf] * 3, False), (0.5, True)])
def test_a_finite_timing_ends_the_search(timings, found):
    assert _finite(timings) is found


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
