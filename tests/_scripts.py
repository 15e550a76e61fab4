"""A benchmark script under ``benchmarks/`` loaded as a module, for tests of its pure parts.

Imported as ``from _scripts import benchmark_script`` (``tests/`` is on ``sys.path``, see ``_models``).
"""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
