"""The row-wise FP8 quantisation kernel under the Triton interpreter: its scales equal the plain-torch
reference bit for bit; the byte transpose equals torch's (the interpreter's float8 conversion does not round like the hardware, so the
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
    for width in (3000, 5000):  # read once; walked twice in chunks (over ONE_PASS_MAX_COLS)
        x = (torch.randn(6, 2 * width, generator=gen) * torch.exp(torch.randn(6, 1, generator=gen)))[:, ::2]
        x[4] = 0.0
        scales = torch.rand(width, generator=gen) + 0.5 if col_scale else None
        dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
        codes, scale = fp8.quantize_rows(x, dtype, scales)
        ref_codes, ref_scale = quantize_rows(x * scales if col_scale else x, fmt)
        assert codes.dtype == ref_codes.dtype and codes.shape == (6, width)
        assert torch.equal(scale, ref_scale)
        assert scale[4].item() == 1.0 and (codes[4].float() == 0).all()


@interpreted_only
def test_interpreted_row_groups_pick_each_rows_column_scales():
    """An FP8 expert weight's input gradient: row i multiplied by its expert's scales
    ``col_scale[row_groups[i]]`` before its amax, bit for bit the plain-torch gather."""
    from lightning_sloth.kernels import fp8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=gen)
    table = torch.rand(4, 300, generator=gen) + 0.5
    groups = torch.tensor([0, 0, 1, 3, 3, 3, 2, 1, 0])
    codes, scale = fp8.quantize_rows(x, torch.float8_e4m3fn, table, groups)
    ref_codes, ref_scale = quantize_rows(x * table[groups], "e4m3")
    assert torch.equal(scale, ref_scale)
    with pytest.raises(ValueError, match="row_groups"):
        fp8.quantize_rows(x, torch.float8_e4m3fn, table)


@interpreted_only
@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (1, 17), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_interpreted_byte_transpose_equals_torchs(shape, dtype):
    """The FP8 weight's transposed codes for the input gradient: bit for bit ``x.t().contiguous()``,
    whole tiles, ragged edges, one row and none."""
    from lightning_sloth.kernels import fp8

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype)
    out = fp8.transpose_bytes(x)
    assert out.dtype == dtype and out.shape == shape[::-1] and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), x.t().contiguous().view(torch.uint8))


@interpreted_only
def test_interpreted_the_quantisation_benchmark_runs():
    """benchmarks/fp8_quantize_bench.py walks its code at toy widths on the CPU: rows read once and
    rows walked twice give the same codes and scales, and the module's bound is restored."""
    from _scripts import benchmark_script
    from lightning_sloth.kernels import fp8 as fp8_kernels

    bench = benchmark_script("fp8_quantize_bench")
    before = fp8_kernels.ONE_PASS_MAX_COLS
    rows = bench.run(8, widths=(40, 300), one_pass=(64, 512), device="cpu")
    assert len(rows) == 2 * 2 * 2 and before == fp8_kernels.ONE_PASS_MAX_COLS
    assert all(row["same_bits"] and row["ms"] > 0 for row in rows)
    assert {(row["width"], row["one_pass"]) for row in rows} == {(40, True), (300, False), (300, True)}
    for row in rows:  # the pick: least time over the widths with column scales; ties keep the default
        row["ms"] = {64: 2.0, 512: 1.0}[row["one_pass_max_cols"]]
    assert bench.best_one_pass(rows) == 512
    for row in rows:
        row["ms"] = 1.0
    assert bench.best_one_pass(rows) == 64


def test_the_one_pass_bound_from_the_environment(monkeypatch):
    from lightning_sloth.kernels import fp8 as fp8_kernels

    monkeypatch.setenv("LIGHTNING_SLOTH_FP8_ONE_PASS_COLS", "16384")
    assert fp8_kernels._one_pass_from_environment() == 16384
    monkeypatch.setenv("LIGHTNING_SLOTH_FP8_ONE_PASS_COLS", "wide")
    with pytest.raises(ValueError, match="LIGHTNING_SLOTH_FP8_ONE_PASS_COLS"):
        fp8_kernels._one_pass_from_environment()


def test_byte_transpose_refuses_wider_elements():
    from lightning_sloth.kernels import fp8

    with pytest.raises(ValueError, match="one-byte elements"):
        fp8.transpose_bytes(torch.zeros(4, 4, dtype=torch.bfloat16))


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and "14 passed" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
