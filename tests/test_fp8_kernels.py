"""The row-wise FP8 quantisation kernel under the Triton interpreter: its scales equal the plain-torch
reference bit for bit (the interpreter's float8 conversion does not round like the hardware, so the
codes are compared on the GPU, ``tests/gpu/test_fp8_gpu.py``)."""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases

from lightning_sloth.ops.fp8_formats import quantize_rows


@interpreted_only
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("col_scale", [False, True])
def test_interpreted_row_scales_equal_the_reference(fmt, col_scale):
    from lightning_sloth.kernels import fp8

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 2 * 5000, generator=gen) * torch.exp(torch.randn(6, 1, generator=gen)))[:, ::2]
    x[4] = 0.0
    scales = torch.rand(5000, generator=gen) + 0.5 if col_scale else None
    codes, scale = fp8.quantize_rows(x, {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt], scales)
    ref_codes, ref_scale = quantize_rows(x * scales if col_scale else x, fmt)
    assert codes.dtype == ref_codes.dtype and codes.shape == (6, 5000)
    assert torch.equal(scale, ref_scale)
    assert scale[4].item() == 1.0 and (codes[4].float() == 0).all()


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and "4 passed" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
