"""Child processes of the tests, bounded in time with everything they start.

A test that runs the app, a second interpreter or a two-rank job starts processes that start their
own (DDP ranks, compile workers, a Manager). ``subprocess.run(..., timeout=...)`` kills only the
child it started and then waits for its pipes to close, which a surviving grandchild holds open: a
stuck job would hang the suite instead of failing its test. Here every child leads a process group
of its own, and a timeout kills the whole group.

Imported as ``import _processes``: ``tests/`` is on ``sys.path`` (see ``_models``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

TAIL = 4000


def _kill_group(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def run(args, *, timeout: float, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)`` whose
    timeout kills the child's whole process group and fails the test with the output so far
    (as does a non-zero exit with ``check``)."""
    kwargs.setdefault("text", True)
    if kwargs.pop("capture_output", True):
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    with subprocess.Popen(args, start_new_session=True, **kwargs) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            try:
                stdout, stderr = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process outside the group holds the pipes
                stdout = stderr = ""
            pytest.fail(
                f"{args!r} ran past {timeout} s and was killed with its process group\n"
                f"stdout:\n{(stdout or '')[-TAIL:]}\nstderr:\n{(stderr or '')[-TAIL:]}"
            )
        finally:
            _kill_group(child)  # whatever it left running, also when the test is interrupted
    if check and child.returncode != 0:
        pytest.fail(
            f"{args!r} exited with {child.returncode}\n"
            f"stdout:\n{(stdout or '')[-TAIL:]}\nstderr:\n{(stderr or '')[-TAIL:]}"
        )
    return subprocess.CompletedProcess(args, child.returncode, stdout, stderr)


def start(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` leading a process group of its own; :func:`stop` ends the group."""
    return subprocess.Popen(args, start_new_session=True, **kwargs)


def stop(child: subprocess.Popen) -> None:
    """Kill what is left of ``child``'s process group (a test's finaliser), and reap ``child``."""
    _kill_group(child)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=30)
