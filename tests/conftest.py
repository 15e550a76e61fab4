"""Test configuration: GPU tests skip cleanly where CUDA is absent, the longest files run first, and
every test leaves the process-wide kernel switches as it found them.

The CPU suite runs in two worker processes (``-n 2 --dist loadfile``: pytest-xdist hands out whole
files). The files that run the app and several processes take minutes each; started last, one
worker would run them alone at the end, so they are collected first and handed out in that order
(xdist would otherwise order the files by their number of tests).

``LIGHTNING_SLOTH_TEST_AUTOTUNE=first`` cuts Triton's autotuning to the first configuration that runs
(``tests/_autotune.py``): for the GPU tests on a fresh machine.
"""

import os

import pytest
import torch
from _autotune import ENV, first_working_config

from lightning_sloth.attention import (
    get_packed_attention_backend,
    get_varlen_kv_repeat,
    set_packed_attention_backend,
    set_varlen_kv_repeat,
)
from lightning_sloth.linear_attention import get_linear_attention_backend, set_linear_attention_backend

LONGEST_FIRST = (
    "test_readme.py",
    "test_docs_commands.py",
    "test_fsdp.py",
    "test_offload.py",
    "test_resume.py",
    "test_fsdp_meta.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present
        config.option.loadscopereorder = False
    if os.environ.get(ENV) == "first":  # the GPU tests on a fresh machine: see tests/_autotune.py
        first_working_config()


@pytest.fixture(autouse=True)
def _process_wide_switches():
    """Restore the attention backends and the K/V repeat switch after each test: a test that picks
    ``"sdpa"`` (``enable_packed_attention(model, backend=...)`` sets it for the process) must not
    change which kernel a later test in the same worker runs."""
    saved = get_packed_attention_backend(), get_varlen_kv_repeat(), get_linear_attention_backend()
    yield
    set_packed_attention_backend(saved[0])
    set_varlen_kv_repeat(saved[1])
    set_linear_attention_backend(saved[2])


def _first(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_first)  # stable: every file keeps its own order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
