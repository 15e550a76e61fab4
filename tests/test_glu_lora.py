"""sloth::swiglu_lora / sloth::geglu_lora: gate and up's LoRA parts added inside the activation.

Float64 agreement of the op (forward, gate's and up's gradients), the in-place backward, op checks,
FLOPs, bad input, and the Triton kernels under the interpreter (rerun in a fresh process by
``test_kernels_under_triton_interpreter``).
"""

import pytest
import torch
import torch.nn.functional as F
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.glu_lora import (
    _geglu_lora,
    _swiglu_lora,
    geglu_lora,
    glu_lora_backward_reference,
    glu_lora_reference,
    swiglu_lora,
)

# name -> (public function, op, kernel activation name, float64 activation)
OPS = {
    "swiglu": (swiglu_lora, _swiglu_lora, "silu", F.silu),
    "geglu": (geglu_lora, _geglu_lora, "gelu_tanh", lambda g: F.gelu(g, approximate="tanh")),
}


def _inputs(shape, r_gate=4, r_up=6, dtype=torch.float32):
    rows, width = 1, shape[-1]
    for n in shape[:-1]:
        rows *= n
    gate, up = 2 * torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    xa = torch.randn(rows, r_gate + r_up, dtype=dtype)
    b_gate, b_up = 0.3 * torch.randn(width, r_gate, dtype=dtype), 0.3 * torch.randn(width, r_up, dtype=dtype)
    return gate, up, xa, b_gate, b_up


def _composed64(gate, up, xa, b_gate, b_up, s_g, s_u, activation64):
    """The unfused expression in float64: each projection's output with its LoRA part, then the GLU."""
    r = b_gate.shape[1]
    shape = gate.shape
    g = gate + s_g * (xa[:, :r] @ b_gate.t()).view(shape)
    u = up + s_u * (xa[:, r:] @ b_up.t()).view(shape)
    return activation64(g) * u


@pytest.mark.parametrize("name", OPS)
def test_forward_and_gate_up_gradients_match_float64(name):
    fn, _, _, activation64 = OPS[name]
    gate, up, xa, b_gate, b_up = _inputs((3, 17, 40))
    gate.requires_grad_(), up.requires_grad_()
    out = fn(gate, up, xa, b_gate, b_up, 0.5, 2.0)
    assert out.shape == gate.shape and out.is_contiguous()
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (gate, up), grad_out)

    gate64, up64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    out64 = _composed64(gate64, up64, xa.double(), b_gate.double(), b_up.double(), 0.5, 2.0, activation64)
    grads64 = torch.autograd.grad(out64, (gate64, up64), grad_out.double())
    torch.testing.assert_close(out.double(), out64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tuple(g.double() for g in grads), grads64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_with_the_producing_products_every_gradient_is_the_unfused_ones(name):
    """gate = x W_g^T and xa = x A^T made by differentiable products here (standing in for the node
    that makes them): the op's gradients of gate and up, pushed through the full projections by
    hand as that node does, give x, A and B the unfused expression's gradients."""
    fn, _, _, activation64 = OPS[name]
    torch.manual_seed(0)
    x = torch.randn(9, 24, dtype=torch.float64, requires_grad=True)
    w_g, w_u = torch.randn(40, 24, dtype=torch.float64), torch.randn(40, 24, dtype=torch.float64)
    a = torch.randn(10, 24, dtype=torch.float64, requires_grad=True)
    b_g = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    b_u = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(9, 40, dtype=torch.float64)

    xa = x @ a.t()
    expected_out = _composed64(x @ w_g.t(), x @ w_u.t(), xa, b_g, b_u, 0.5, 2.0, activation64)
    expected = torch.autograd.grad(expected_out, (x, a, b_g, b_u), grad_out)

    gate, up = (x @ w_g.t()).detach().requires_grad_(), (x @ w_u.t()).detach().requires_grad_()
    out = fn(gate, up, xa, b_g, b_u, 0.5, 2.0)
    torch.testing.assert_close(out, expected_out)
    d_gate, d_up = torch.autograd.grad(out, (gate, up), grad_out)
    # The producing node's backward from d gate, d up (the full outputs' gradients):
    g = torch.cat([0.5 * d_gate @ b_g, 2.0 * d_up @ b_u], dim=1)  # d xa
    dx = d_gate @ w_g + d_up @ w_u + g @ a
    da = g.t() @ x
    db_g, db_u = d_gate.t() @ (0.5 * xa[:, :4]), d_up.t() @ (2.0 * xa[:, 4:])
    torch.testing.assert_close((dx, da, db_g, db_u), expected)


@pytest.mark.parametrize("name", OPS)
def test_inplace_backward_gives_the_same_gradients_in_gate_and_ups_memory(name):
    fn = OPS[name][0]
    gate, up, xa, b_gate, b_up = _inputs((2, 5, 33))
    leaf_gate, leaf_up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    grad_out = torch.randn(2, 5, 33)
    expected = torch.autograd.grad(
        fn(leaf_gate * 1, leaf_up * 1, xa, b_gate, b_up, 1.5, 0.25), (leaf_gate, leaf_up), grad_out
    )

    seen = {}
    g_in, u_in = leaf_gate * 1, leaf_up * 1
    ptrs = (g_in.data_ptr(), u_in.data_ptr())
    g_in.register_hook(lambda grad: seen.update(gate=grad.data_ptr()))
    u_in.register_hook(lambda grad: seen.update(up=grad.data_ptr()))
    out = fn(g_in, u_in, xa, b_gate, b_up, 1.5, 0.25, inplace_backward=True)
    got = torch.autograd.grad(out, (leaf_gate, leaf_up), grad_out)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert (seen["gate"], seen["up"]) == ptrs


def test_adapters_passed_with_gradients_are_read_as_constants():
    gate, up, xa, b_gate, b_up = _inputs((4, 16))
    b_gate.requires_grad_()
    gate.requires_grad_()
    out = swiglu_lora(gate, up, xa, b_gate, b_up, 1.0, 1.0)
    out.sum().backward()
    assert b_gate.grad is None and gate.grad is not None


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    _, op, _, _ = OPS[name]
    gate, up, xa, b_gate, b_up = _inputs((5, 33))
    torch.library.opcheck(op, (gate.requires_grad_(), up.requires_grad_(), xa, b_gate, b_up, 0.5, 2.0, False))
    backward_op = getattr(torch.ops.sloth, f"{name}_lora_backward")
    inplace_op = getattr(torch.ops.sloth, f"{name}_lora_backward_")
    args = (torch.randn(5, 33), gate.detach(), up.detach(), xa, b_gate, b_up, 0.5, 2.0)
    torch.library.opcheck(backward_op.default, args)
    torch.library.opcheck(
        inplace_op.default, (args[0], gate.detach().clone(), up.detach().clone(), *args[3:])
    )


def test_compiles_fullgraph():
    def mlp(gate, up, xa, b_gate, b_up):
        return swiglu_lora(gate, up, xa, b_gate, b_up, 0.5, 2.0).sum()

    gate, up, xa, b_gate, b_up = _inputs((6, 32))
    gate.requires_grad_()
    eager = torch.autograd.grad(mlp(gate, up, xa, b_gate, b_up), gate)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(gate, up, xa, b_gate, b_up), gate), eager)


def test_flops_are_counted():
    gate, up, xa, b_gate, b_up = _inputs((8, 32), r_gate=4, r_up=6)
    gate.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        swiglu_lora(gate, up, xa, b_gate, b_up, 1.0, 1.0).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.sloth.swiglu_lora] == (5 + 2 * 10) * 8 * 32
    assert counts[torch.ops.sloth.swiglu_lora_backward] == (9 + 2 * 10) * 8 * 32


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: (t[0], t[1][:, :-1], *t[2:]), "share one floating dtype and shape"),
        (lambda t: (*t[:3], t[3][:-1], t[4]), "B_gate must be"),
        (lambda t: (t[0], t[1], t[2][:, :-1], *t[3:]), "xa"),
        (lambda t: (t[0], t[1], t[2].double(), *t[3:]), "must share a dtype"),
    ],
)
def test_bad_input_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        swiglu_lora(*change(_inputs((4, 16))), 1.0, 1.0)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize(
    ("shape", "ranks"), [((3, 5, 123), (4, 6)), ((70, 150), (16, 16)), ((130, 64), (33, 1))]
)
def test_kernels_interpreted(dtype, name, shape, ranks):
    from lightning_sloth.kernels.glu import glu_lora_backward, glu_lora_forward

    activation = OPS[name][2]
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    gate, up, xa, b_gate, b_up = _inputs(shape, *ranks, dtype=dtype)
    args = (xa, b_gate, b_up, 0.5, 2.0, activation)
    out = glu_lora_forward(gate, up, *args)
    expected = glu_lora_reference(
        gate.float(), up.float(), xa.float(), b_gate.float(), b_up.float(), *args[3:]
    )
    torch.testing.assert_close(out, expected, **tolerance, check_dtype=False)

    grad_out = torch.randn(shape, dtype=dtype)
    expected = glu_lora_backward_reference(grad_out, gate, up, *args)
    torch.testing.assert_close(glu_lora_backward(grad_out, gate, up, *args), expected, **tolerance)
    gate_ptr = gate.data_ptr()
    grad_gate, grad_up = glu_lora_backward(grad_out, gate, up, *args, in_place=True)
    torch.testing.assert_close((grad_gate, grad_up), expected, **tolerance)
    assert grad_gate is gate and gate.data_ptr() == gate_ptr


@interpreted_only
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize(
    ("tile", "shape", "ranks"),
    [
        ((16, 32, 4), (70, 150), (16, 16)),
        ((64, 64, 4), (70, 150), (16, 16)),
        ((16, 64, 2), (3, 5, 123), (4, 6)),
        ((32, 128, 4), (70, 150), (16, 16)),
    ],
)
def test_every_tile_computes_the_same_interpreted(name, tile, shape, ranks):
    """Other tilings of the LoRA kernels (taller, wider, fewer warps) give the reference's
    values: the tile is the benchmark's to choose, not a change in what is computed."""
    from lightning_sloth.kernels.glu import LoraTile, glu_lora_backward, glu_lora_forward

    tile = LoraTile(*tile)
    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    gate, up, xa, b_gate, b_up = _inputs(shape, *ranks, dtype=torch.float32)
    args = (xa, b_gate, b_up, 0.5, 2.0, OPS[name][2])
    out = glu_lora_forward(gate, up, *args, tile=tile)
    torch.testing.assert_close(out, glu_lora_reference(gate, up, *args), **tolerance)
    grad_out = torch.randn(shape)
    expected = glu_lora_backward_reference(grad_out, gate, up, *args)
    torch.testing.assert_close(glu_lora_backward(grad_out, gate, up, *args, tile=tile), expected, **tolerance)
    grads = glu_lora_backward(grad_out, gate, up, *args, in_place=True, tile=tile)
    torch.testing.assert_close(grads, expected, **tolerance)
    assert grads[0] is gate


@interpreted_only
def test_the_tiles_benchmark_runs_interpreted():
    """benchmarks/glu_lora_tiles_bench.py walks its code at a toy shape on the CPU: every tile's
    values checked against the reference, a time and a bandwidth for each."""
    from _scripts import benchmark_script

    bench = benchmark_script("glu_lora_tiles_bench")
    tiles = [bench.LORA_TILE, bench.LoraTile(16, 64, 2)]
    row = bench.run_shape("toy", 40, 96, 16, tiles=tiles, device="cpu")
    assert [entry["tile"]["block_n"] for entry in row["tiles"]] == [256, 64]
    for entry in row["tiles"]:
        assert "error" not in entry, entry
        assert max(entry["rel_err"].values()) < 1e-5 and entry["fwd_ms"] > 0 and entry["bwd_tb_per_s"] > 0
    # The pick weighs a step's two forwards and one backward, and passes over a tile off the reference.
    row["tiles"][0].update(fwd_ms=1.0, bwd_ms=1.0)
    row["tiles"][1].update(fwd_ms=0.9, bwd_ms=1.3)
    assert bench.best_tile({"rows": [row]}, "toy") == "16x256x8"
    row["tiles"][1].update(bwd_ms=1.1)
    assert bench.best_tile({"rows": [row]}, "toy") == "16x64x2"
    row["tiles"][1]["rel_err"]["out"] = 0.5
    assert bench.best_tile({"rows": [row]}, "toy") == "16x256x8"
    # A results file from before the FMA tiles were removed: those are passed over.
    row["tiles"][1]["rel_err"]["out"] = 0.0
    row["tiles"][1]["tile"]["fma"] = True
    assert bench.best_tile({"rows": [row]}, "toy") == "16x256x8"


def test_a_tile_from_text():
    from lightning_sloth.kernels.glu import LoraTile, tile_from_text

    assert tile_from_text("16x256x8") == LoraTile()
    assert tile_from_text(" 64X64x4 ") == LoraTile(64, 64, 4)
    for bad, match in (
        ("16x256", "BMxBNxWARPS"),
        ("16x256x8xdot", "BMxBNxWARPS"),
        ("2x1024x4xfma", "BMxBNxWARPS"),
        ("24x256x8", "powers of two"),
        ("8x256x8", "at least 16 rows"),
    ):
        with pytest.raises(ValueError, match=match):
            tile_from_text(bad)


def test_tensor_core_tiles_need_16_rows():
    from lightning_sloth.kernels.glu import LoraTile, glu_lora_forward

    gate, up, xa, b_gate, b_up = _inputs((8, 32), 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_m >= 16"):
        glu_lora_forward(gate, up, xa, b_gate, b_up, 1.0, 1.0, "silu", tile=LoraTile(8, 64, 4))


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
