"""Triton autotuning cut to the first configuration that runs, for the GPU tests.

With ``LIGHTNING_SLOTH_TEST_AUTOTUNE=first`` in the environment, ``tests/conftest.py`` installs this
for the test process: every Triton autotuner (fla's and lightning_sloth's) times its configurations
in their order and stops at the first that compiles and runs, instead of compiling and timing all of
them. The tests check values, not speed; on a fresh machine the full tuning of fla's delta-rule
kernels alone takes minutes. The choice is kept for the process only (never written to Triton's
autotune cache), so a benchmark run later on the same machine still tunes for itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

ENV = "LIGHTNING_SLOTH_TEST_AUTOTUNE"


def _finite(timings) -> bool:
    first = timings[0] if isinstance(timings, (list, tuple)) else timings
    return math.isfinite(float(first))


def first_working_config() -> Callable[[], None]:
    """Install the cut on ``triton.runtime.autotuner.Autotuner``; returns the function that undoes it."""
    from triton.runtime.autotuner import Autotuner

    run, bench = Autotuner.run, Autotuner._bench

    def first_run(self, *args, **kwargs):
        saved = self.cache_results
        self.cache_results, self._first_found = False, False
        try:
            return run(self, *args, **kwargs)
        finally:
            self.cache_results = saved

    def first_bench(self, *args, config, **meta):
        if getattr(self, "_first_found", False):
            return [math.inf, math.inf, math.inf]
        timings = bench(self, *args, config=config, **meta)
        self._first_found = _finite(timings)
        return timings

    Autotuner.run, Autotuner._bench = first_run, first_bench

    def undo() -> None:
        Autotuner.run, Autotuner._bench = run, bench

    return undo
