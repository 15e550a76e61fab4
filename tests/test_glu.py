"""sloth::swiglu / sloth::geglu: float64 agreement, transformers' MLPs, op checks, compile, Triton kernels.

The Triton kernels run on CPU under the Triton interpreter. ``TRITON_INTERPRET`` must be set before
triton is imported, so ``test_kernels_under_triton_interpreter`` reruns this file's ``interpreted``
cases in a fresh process with it set (they skip in the normal run).
"""

import pytest
import torch
import torch.nn.functional as F
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.glu import _geglu, _swiglu, geglu, glu_backward_reference, glu_reference, swiglu

# name -> (public function, op, kernel activation name, float64 activation)
GLUS = {
    "swiglu": (swiglu, _swiglu, "silu", F.silu),
    "geglu": (geglu, _geglu, "gelu_tanh", lambda g: F.gelu(g, approximate="tanh")),
}


def _gate_up(shape, layout, dtype=torch.float32):
    """gate and up: separate tensors, the halves of one fused gate-up output, or transposed views."""
    if layout == "fused":
        fused = 3 * torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)
        return fused.chunk(2, dim=-1)
    if layout == "transposed":
        return tuple(
            (3 * torch.randn(shape[1], shape[0], *shape[2:], dtype=dtype)).transpose(0, 1) for _ in range(2)
        )
    return 3 * torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("name", GLUS)
@pytest.mark.parametrize("layout", ["separate", "fused", "transposed"])
def test_forward_and_backward_match_float64(name, layout):
    glu, _, _, activation64 = GLUS[name]
    gate, up = _gate_up((3, 37, 123), layout)
    gate.requires_grad_(), up.requires_grad_()
    out = glu(gate, up)
    assert out.shape == gate.shape and out.is_contiguous()
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (gate, up), grad_out)

    gate64, up64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    out64 = activation64(gate64) * up64
    grads64 = torch.autograd.grad(out64, (gate64, up64), grad_out.double())
    torch.testing.assert_close(out.double(), out64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tuple(g.double() for g in grads), grads64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", GLUS)
@pytest.mark.parametrize("layout", ["separate", "fused", "transposed"])
def test_inplace_backward_gives_the_same_gradients_in_the_inputs_memory(name, layout):
    glu = GLUS[name][0]
    leaf_gate, leaf_up = (t.requires_grad_() for t in _gate_up((3, 37, 123), layout))
    grad_out = torch.randn(3, 37, 123)
    expected = torch.autograd.grad(glu(leaf_gate * 1, leaf_up * 1), (leaf_gate, leaf_up), grad_out)

    seen = {}

    def keep(name):
        def hook(grad):
            seen[name] = grad.data_ptr()

        return hook

    gate, up = leaf_gate * 1, leaf_up * 1  # fresh intermediates, as a projection's outputs are
    gate.register_hook(keep("gate")), up.register_hook(keep("up"))
    gate_ptr, up_ptr = gate.data_ptr(), up.data_ptr()
    got = torch.autograd.grad(glu(gate, up, inplace_backward=True), (leaf_gate, leaf_up), grad_out)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The gradients of gate and up were written where gate and up were: no new buffers.
    assert seen == {"gate": gate_ptr, "up": up_ptr}


@pytest.mark.parametrize("name", GLUS)
def test_inplace_backward_op_checks(name):
    inplace_op = getattr(torch.ops.sloth, f"{name}_backward_")
    gate, up = _gate_up((5, 33), "separate")
    torch.library.opcheck(inplace_op.default, (torch.randn(5, 33), gate, up))
    gate, up = _gate_up((5, 33), "separate")
    expected = glu_backward_reference(torch.ones(5, 33), gate, up, GLUS[name][2])
    inplace_op(torch.ones(5, 33), gate, up)
    torch.testing.assert_close((gate, up), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_mlp_matches_exactly(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(
        LlamaConfig(hidden_size=48, intermediate_size=123, num_attention_heads=4, hidden_act="silu")
    ).to(dtype)
    x = torch.randn(2, 7, 48, dtype=dtype)
    ours = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    torch.testing.assert_close(ours, mlp(x), rtol=0, atol=0)


def test_gemma_activation_matches_exactly_and_in_gradient():
    from transformers.activations import ACT2FN

    gate, up = _gate_up((4, 9, 65), "separate")
    gate.requires_grad_(), up.requires_grad_()
    ours, theirs = geglu(gate, up), ACT2FN["gelu_pytorch_tanh"](gate) * up
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    grad_out = torch.randn_like(ours)
    torch.testing.assert_close(
        torch.autograd.grad(ours, (gate, up), grad_out),
        torch.autograd.grad(theirs, (gate, up), grad_out),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("name", GLUS)
def test_opcheck(name):
    _, op, _, _ = GLUS[name]
    gate, up = _gate_up((5, 33), "fused")
    torch.library.opcheck(op, (gate.requires_grad_(), up.requires_grad_()))
    backward_op = getattr(torch.ops.sloth, f"{name}_backward")
    grad_gate, grad_up = _gate_up((5, 33), "transposed")
    torch.library.opcheck(backward_op.default, (torch.randn(5, 33), grad_gate, grad_up))


def test_compiles_fullgraph():
    def both(gate, up):
        return swiglu(gate, up) * geglu(up, gate)

    gate, up = _gate_up((6, 40), "fused")
    gate.requires_grad_(), up.requires_grad_()
    grad_out = torch.randn(6, 40)
    compiled = torch.compile(both, fullgraph=True)(gate, up)
    eager = both(gate, up)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(
        torch.autograd.grad(compiled, (gate, up), grad_out), torch.autograd.grad(eager, (gate, up), grad_out)
    )


@pytest.mark.parametrize(("name", "forward", "backward"), [("swiglu", 5, 9), ("geglu", 10, 16)])
def test_flops_are_counted(name, forward, backward):
    glu = GLUS[name][0]
    gate, up = _gate_up((3, 20), "separate")
    with FlopCounterMode(display=False) as counter:
        glu(gate.requires_grad_(), up.requires_grad_()).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    op = getattr(torch.ops.sloth, name)
    assert (
        counts[op] == forward * 60 and counts[getattr(torch.ops.sloth, f"{name}_backward")] == backward * 60
    )


@pytest.mark.parametrize(
    ("up", "match"),
    [
        (torch.randn(4, 7), "must have one shape"),
        (torch.randn(4, 8, dtype=torch.float64), "share a floating dtype"),
    ],
)
def test_bad_input_is_named(up, match):
    with pytest.raises(ValueError, match=match):
        swiglu(torch.randn(4, 8), up)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", GLUS)
@pytest.mark.parametrize(("shape", "layout"), [((3, 5, 123), "fused"), ((2, 1500), "transposed")])
def test_kernels_interpreted(dtype, name, shape, layout):
    from lightning_sloth.kernels.glu import glu_backward, glu_forward

    activation = GLUS[name][2]
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    gate, up = _gate_up(shape, layout, dtype)
    out = glu_forward(gate, up, activation)
    torch.testing.assert_close(
        out, glu_reference(gate.float(), up.float(), activation), **tolerance, check_dtype=False
    )

    grad_out = torch.randn(shape, dtype=dtype)
    expected = glu_backward_reference(grad_out, gate, up, activation)
    torch.testing.assert_close(glu_backward(grad_out, gate, up, activation), expected, **tolerance)
    # In place: written into gate and up where they can be viewed as rows, new tensors otherwise.
    gate_ptr = gate.data_ptr()
    grad_gate, grad_up = glu_backward(grad_out, gate, up, activation, in_place=True)
    torch.testing.assert_close((grad_gate, grad_up), expected, **tolerance)
    assert (grad_gate is gate and gate.data_ptr() == gate_ptr) == (layout == "fused")


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
