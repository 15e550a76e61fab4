"""Test configuration: GPU tests skip cleanly where CUDA is absent, and the longest files run first.

The CPU suite runs in two worker processes (``-n 2 --dist loadfile``: pytest-xdist hands out whole
files). The files that run the app and several processes take minutes each; started last, one
worker would run them alone at the end, so they are collected first and handed out in that order
(xdist would otherwise order the files by their number of tests).
"""

import pytest
import torch

LONGEST_FIRST = ("test_readme.py", "test_fsdp.py", "test_offload.py", "test_resume.py", "test_fsdp_meta.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present
        config.option.loadscopereorder = False


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
