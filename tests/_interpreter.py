"""Running a test file's Triton-kernel cases under the Triton interpreter.

``TRITON_INTERPRET`` must be set before triton is imported, so each kernel test file marks its
interpreter cases ``interpreted_only`` (skipped in the normal run) and has one launcher test that
reruns them in a fresh process with the variable set.
"""

import os
import subprocess
import sys
from pathlib import Path

import _processes
import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_under_triton_interpreter")
launcher_only = pytest.mark.skipif(INTERPRETED, reason="this is the launcher of the interpreted cases")


def run_interpreted_cases(test_file: str) -> subprocess.CompletedProcess:
    """Run ``test_file``'s ``interpreted`` cases with ``TRITON_INTERPRET=1`` in a new process."""
    pytest.importorskip("triton")
    return _processes.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "interpreted"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(test_file).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
