"""The tests' own child-process helpers end what they start: a stuck child, its grandchildren and a
stuck multi-process job fail their test within the deadline instead of holding the suite."""

import os
import sys
import time

import _ddp
import _processes
import pytest

GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie (killed, not yet reaped by init) is gone
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_a_timeout_kills_the_child_with_its_grandchildren(tmp_path):
    started = time.monotonic()
    with pytest.raises(
        pytest.fail.Exception, match="ran past 3 s and was killed with its process group"
    ) as failed:
        _processes.run([sys.executable, "-c", GRANDCHILD], timeout=3)
    assert time.monotonic() - started < 60
    grandchild = int(str(failed.value).split("stdout:\n")[1].split()[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_check_fails_with_the_output():
    with pytest.raises(pytest.fail.Exception, match="exited with 3(.|\n)*boom"):
        _processes.run(
            [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], timeout=60, check=True
        )
    done = _processes.run([sys.executable, "-c", "print('fine')"], timeout=60)
    assert done.returncode == 0 and done.stdout == "fine\n"


def _sleeping_rank(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def test_ranks_past_the_deadline_are_killed_and_the_test_fails():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="2 ranks of _sleeping_rank ran past 3 s"):
        _ddp.start_and_join(_sleeping_rank, (600.0,), 2, timeout=3)
    assert time.monotonic() - started < 60


def test_rendezvous_ports_lie_in_the_workers_slice():
    ports = _ddp.port_slice()
    assert ports.stop <= 32768 and len(ports) == 500  # below Linux's default ephemeral range
    assert all(_ddp.free_port() in ports for _ in range(5))
