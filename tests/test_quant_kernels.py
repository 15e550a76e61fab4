"""The NF4 / FP4 dequantisation kernel under the Triton interpreter (float32 / float16; the
interpreter's bfloat16 is broken, bf16 is tested on the GPU), against the plain-torch reference.

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


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
