"""The suite's GPU-busy share on CUDA: one profiled step, its share of wall time in GPU work."""

import pytest
import torch

from lightning_sloth.bench.measure import gpu_busy_share

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_busy_share_of_a_gpu_bound_and_a_host_bound_step():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(8, device="cuda")

    def gpu_bound():
        for _ in range(20):
            a @ a

    def host_bound():  # tiny kernels: the GPU mostly waits for the next launch
        for _ in range(2000):
            small.add_(1.0)

    heavy, light = gpu_busy_share(gpu_bound), gpu_busy_share(host_bound)
    for record in (heavy, light):
        assert 0 < record["gpu_busy_ms"] <= record["profiled_step_ms"]
        assert 0 < record["gpu_busy_share"] <= 1
    assert heavy["gpu_busy_share"] > light["gpu_busy_share"]
