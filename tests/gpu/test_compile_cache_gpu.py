"""One-time compile work on CUDA: the compile counter sees Triton's compilations, and the kernels
whose launch depends on the batch's rows compile once for any number of rows (their row counts
are not specialized), so no batch after the first brings a compilation."""

from __future__ import annotations

import json
import os
import sys

import _processes
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# In a fresh process with an empty Triton cache: each kernel is launched with row counts that are
# 1, a multiple of 16 or not; the compilations of each launch are printed.
PROBE = r"""
import json, torch
from lightning_sloth.kernels.nf4_gemm import matmul_4bit
from lightning_sloth.kernels.rms_norm import rms_norm_forward
from lightning_sloth.kernels.rope import rope
from lightning_sloth.plugins.compile_cache import CompileCounter

cuda, bf16 = "cuda", torch.bfloat16
out = {}
with CompileCounter() as counter:
    w = torch.ones(2048, device=cuda, dtype=bf16)
    out["rms_norm"] = []
    for rows in (4096, 4097, 333, 16384, 1):
        rms_norm_forward(torch.randn(rows, 2048, device=cuda, dtype=bf16), w, 1e-6, 0.0, True)
        torch.cuda.synchronize()
        out["rms_norm"].append(counter.take())
    out["rope"] = []
    for t in (4096, 4097, 333, 16384):
        q, k = torch.randn(1, 16, t, 64, device=cuda, dtype=bf16), torch.randn(1, 4, t, 64, device=cuda, dtype=bf16)
        cos, sin = torch.randn(1, t, 64, device=cuda), torch.randn(1, t, 64, device=cuda)
        rope(q, k, cos, sin)
        torch.cuda.synchronize()
        out["rope"].append(counter.take())
    packed = torch.randint(0, 255, (4096 * 4096 // 2,), device=cuda, dtype=torch.uint8)
    absmax = torch.rand(4096 * 4096 // 64, device=cuda)
    code = torch.linspace(-1, 1, 16, device=cuda)
    out["nf4"] = []
    for m in (4096, 4097, 8191, 16384):  # the rows of one training step (a single split of K)
        matmul_4bit(torch.randn(m, 4096, device=cuda, dtype=bf16), packed, absmax, code, 64, 4096)
        torch.cuda.synchronize()
        out["nf4"].append(counter.take())
print(json.dumps(out))
"""


def test_kernels_compile_once_whatever_the_rows(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_INTERPRET": "0"}
    result = _processes.run([sys.executable, "-c", PROBE], env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    for kernel, launches in counts.items():
        first, *later = launches
        assert first["triton_compiles"] >= 1 and first["triton_compile_s"] > 0, (kernel, first)
        assert [launch["triton_compiles"] for launch in later] == [0] * len(later), (kernel, launches)
