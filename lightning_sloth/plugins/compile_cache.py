"""One-time compile work, paid once per machine and counted per step.

A Triton kernel is compiled the first time a process launches it with a new specialization
(its ``tl.constexpr`` values, and whether each integer argument is 1 or a multiple of 16), and
``torch.compile`` builds its graphs per process. Both write what they build to a cache on disk
and read it back in the next process. :func:`configure_compile_caches` points both caches at one
directory under the user's cache, so every process of the user (each job of a Hydra multirun
sweep, each benchmark process) shares them and a compile happens once per machine, not once per
process. Variables the user set win.

:class:`CompileCounter` counts, while installed, Triton's JIT compilations (each with its kernel
and seconds; a compile read from the disk cache takes milliseconds) and ``torch.compile``'s
graphs, so a benchmark can record them per step and show whether one-time work lands inside
the timed steps.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: The variables each compiler reads its cache directory from, and the subdirectory used.
CACHE_VARIABLES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def default_cache_root() -> Path:
    """``$LIGHTNING_SLOTH_CACHE``, else ``$XDG_CACHE_HOME/lightning_sloth``, else ``~/.cache/lightning_sloth``."""
    if os.environ.get("LIGHTNING_SLOTH_CACHE"):
        return Path(os.environ["LIGHTNING_SLOTH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_sloth"


def configure_compile_caches(root: str | Path | None = None, *, override: bool = False) -> dict[str, str]:
    """Point Triton's and Inductor's compile caches under ``root`` (default :func:`default_cache_root`).

    Sets ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` in this process's environment (so
    also in every process it starts) unless already set, or always with ``override``. Both
    compilers read the variables when they first compile, so call this before the first step.
    Directories made here are readable and writable by the user alone: a compile cache is code
    the next process runs.

    Returns:
        the cache directory of each variable now in effect.
    """
    root = Path(root) if root is not None else default_cache_root()
    for variable, subdir in CACHE_VARIABLES.items():
        if override or not os.environ.get(variable):
            # What a compiler reads back from its cache runs (Inductor's holds pickled graphs):
            # a directory made here is the user's alone.
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = root / subdir
            path.mkdir(mode=0o700, exist_ok=True)
            os.environ[variable] = str(path)
    return {variable: os.environ[variable] for variable in CACHE_VARIABLES}


def _triton_runtime_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs (before 3.4)
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") else None


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileCounter:
    """Counts Triton JIT compilations and ``torch.compile`` graphs while installed.

    Use as a context manager around the work, and :meth:`take` after each step for what that
    step compiled. Hooks already installed in Triton are kept and called.

    Attributes:
        available: whether this Triton exposes its compile hooks (``triton.knobs.runtime``).
    """

    def __init__(self) -> None:
        self.available = _triton_runtime_knobs() is not None
        self._events: list[tuple[str, float]] = []
        self._started: float | None = None
        self._graphs = 0
        self._previous: tuple[Any, Any] = (None, None)

    def _before(self, **kwargs: Any) -> bool | None:
        self._started = time.perf_counter()
        previous = self._previous[0]
        return previous(**kwargs) if previous is not None else None

    def _after(self, **kwargs: Any) -> bool | None:
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        started, self._started = self._started, None
        self._events.append((name, time.perf_counter() - started if started is not None else 0.0))
        previous = self._previous[1]
        return previous(**kwargs) if previous is not None else None

    def __enter__(self) -> CompileCounter:
        runtime = _triton_runtime_knobs()
        if runtime is not None:
            self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
            runtime.jit_cache_hook = self._before
            runtime.jit_post_compile_hook = self._after
        self._graphs = _dynamo_graphs()
        return self

    def __exit__(self, *exc: Any) -> None:
        runtime = _triton_runtime_knobs()
        if runtime is not None:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._previous

    def take(self) -> dict[str, Any]:
        """What was compiled since the last call: ``triton_compiles`` (count), ``triton_compile_s``
        (their seconds), ``triton_kernels`` (names), ``dynamo_graphs`` (new graphs)."""
        events, self._events = self._events, []
        graphs = _dynamo_graphs()
        new_graphs, self._graphs = graphs - self._graphs, graphs
        return {
            "triton_compiles": len(events),
            "triton_compile_s": round(sum(seconds for _, seconds in events), 4),
            "triton_kernels": sorted({name for name, _ in events}),
            "dynamo_graphs": new_graphs,
        }
