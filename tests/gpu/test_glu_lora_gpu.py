"""``sloth::swiglu_lora`` / ``geglu_lora`` on CUDA: the Triton kernels in bf16 at an 8B MLP's width
(and an odd shape and ranks) against the float32 reference, forward and in-place backward."""

import pytest
import torch
from lightning_sloth.kernels.glu import LORA_TILE, LoraTile, glu_lora_backward, glu_lora_forward

from lightning_sloth.ops.glu_lora import glu_lora_backward_reference, glu_lora_reference

pytestmark = pytest.mark.gpu


# The default tile, then others benchmarks/glu_lora_tiles_bench.py compares (the old default, wide rows).
TILES = [LORA_TILE, LoraTile(64, 64, 4), LoraTile(16, 512, 8)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("rows", "width", "ranks"), [(4096, 14336, (16, 16)), (333, 1000, (8, 24))])
def test_the_kernels_match_the_float32_reference_in_bf16(activation, rows, width, ranks, tile):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16)

    gate, up = randn(rows, width, scale=2.0), randn(rows, width)
    xa = randn(rows, sum(ranks))
    b_gate, b_up = randn(width, ranks[0], scale=0.1), randn(width, ranks[1], scale=0.1)
    args = (xa, b_gate, b_up, 2.0, 0.5, activation)
    expected = glu_lora_reference(
        gate.float(), up.float(), xa.float(), b_gate.float(), b_up.float(), *args[3:]
    )
    out = glu_lora_forward(gate, up, *args, tile=tile)
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1e-2)

    grad = randn(rows, width)
    want = glu_lora_backward_reference(
        grad.float(), gate.float(), up.float(), xa.float(), b_gate.float(), b_up.float(), *args[3:]
    )
    ptr = gate.data_ptr()
    got = glu_lora_backward(grad, gate, up, *args, in_place=True, tile=tile)
    assert got[0].data_ptr() == ptr
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, rtol=1.6e-2, atol=1e-2)
