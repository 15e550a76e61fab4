"""The NF4 / FP4 kernels under the Triton interpreter (float32 / float16; the interpreter's bfloat16
is broken, bf16 is tested on the GPU): the dequantisation kernel against the plain-torch reference
bit for bit, the decode-in-GEMM products ``x @ W^T`` and ``dy @ W`` against float64 products of
the same decoded weight (odd row and column counts, split and unsplit reductions).

``TRITON_INTERPRET`` must be set before triton is imported, so ``test_kernels_under_triton_interpreter``
reruns this file's ``interpreted`` cases in a fresh process with it set (they skip in the normal run).
"""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases

from lightning_sloth.quant import dequantize_4bit_reference, quantize_4bit


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq", "fp4"])
@pytest.mark.parametrize("shape", [(7, 3), (33, 130), (40, 1030)])
def test_kernels_interpreted(shape, quant_type, dtype):
    from lightning_sloth.kernels.nf4 import dequantize_4bit

    torch.manual_seed(0)
    q = quantize_4bit(torch.randn(shape), quant_type)
    out = torch.empty(shape, dtype=dtype)
    dequantize_4bit(q.packed, q.block_absmax(), q.code, q.blocksize, out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), dequantize_4bit_reference(q, dtype).view(bits))


# rows, out, in: 1-2 row tiles, partial column tiles, in not a multiple of the K tile; the last two
# shapes give one program per tile with the interpreter's split rule (no partial sums).
GEMM_SHAPES = [(5, 70, 130), (37, 33, 258), (17, 45, 66), (100, 600, 130), (3, 16, 1030)]


def _gemm_case(shape, quant_type, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m, n, k = shape
    q = quantize_4bit(torch.randn(n, k, generator=gen), quant_type)
    weight = dequantize_4bit_reference(q, dtype).double()  # the weight as the kernel rounds it
    a = torch.randn(m, k, generator=gen).to(dtype)
    return q, weight, a


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("quant_type", ["nf4", "nf4-dq", "fp4"])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_gemm_kernels_interpreted(shape, quant_type, dtype):
    from lightning_sloth.kernels.nf4_gemm import matmul_4bit, matmul_4bit_t

    m, n, k = shape
    q, weight, x = _gemm_case(shape, quant_type, dtype)
    absmax = q.block_absmax()
    y = matmul_4bit(x, q.packed, absmax, q.code, q.blocksize, n)
    y_ref = x.double() @ weight.t()
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    dx = matmul_4bit_t(dy, q.packed, absmax, q.code, q.blocksize, k)
    dx_ref = dy.double() @ weight
    assert y.dtype == dx.dtype == dtype and y.shape == (m, n) and dx.shape == (m, k)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: one rounding of the output
    for got, ref in ((y, y_ref), (dx, dx_ref)):
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@interpreted_only
def test_gemm_kernel_takes_strided_rows_interpreted():
    from lightning_sloth.kernels.nf4_gemm import matmul_4bit

    q, weight, x = _gemm_case((9, 40, 66), "nf4", torch.float32)
    wide = torch.randn(9, 80)
    wide[:, :66] = x
    y = matmul_4bit(wide[:, :66], q.packed, q.absmax, q.code, 64, 40)  # row stride 80
    torch.testing.assert_close(y.double(), x.double() @ weight.t(), rtol=1e-5, atol=1e-5)


@interpreted_only
def test_gemm_kernels_take_zero_rows_interpreted():
    from lightning_sloth.kernels.nf4_gemm import matmul_4bit, matmul_4bit_t

    q = quantize_4bit(torch.randn(40, 66), "nf4")
    assert matmul_4bit(torch.randn(0, 66), q.packed, q.absmax, q.code, 64, 40).shape == (0, 40)
    assert matmul_4bit_t(torch.randn(0, 40), q.packed, q.absmax, q.code, 64, 66).shape == (0, 66)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
