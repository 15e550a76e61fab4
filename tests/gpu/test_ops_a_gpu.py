"""GPU checks of the Triton-backed ops rms_norm, rope, swiglu and geglu.

Every op in bfloat16/float16/float32 against a float64 reference (forward and backward), ``opcheck``
through the ``triton_op`` path, and ``torch.compile(fullgraph=True)`` with zero graph breaks and the
Triton kernels visible in Inductor's generated code.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_ops_a_gpu.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.glu import _geglu, _swiglu, geglu, swiglu
from lightning_sloth.ops.registry import TRITON_OPS, use_triton
from lightning_sloth.ops.rms_norm import _rms_norm, _rms_norm_backward, rms_norm
from lightning_sloth.ops.rope import _rope, _rope_backward, apply_rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Against float64 computed from the same (rounded) inputs: one or two roundings of the output dtype.
TOLERANCE = {
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 3e-3, "atol": 3e-3},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
}
EPS = 1e-6


def _close(actual, expected, dtype):
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), e, **TOLERANCE[dtype])


def _assert_compiles_without_breaks(fn, args, kernel_names):
    """fullgraph compile, zero graph breaks, output equal to eager, and our Triton kernels in Inductor's code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    out, code = run_and_get_code(compiled, *args)
    code = "\n".join(code)
    for name in kernel_names:
        assert name in code, f"{name} is not in the compiled code"
    torch.testing.assert_close(out, fn(*args))
    return out


def test_triton_path_is_active():
    assert TRITON_OPS
    assert use_triton(torch.empty(1, device="cuda", dtype=torch.bfloat16))


# ---------------------------------------------------------------- rms_norm


def _rms_norm64(x, weight, offset):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (weight.double() + offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        ((3, 37, 123), "transposed"),
        ((2, 333, 4096), "contiguous"),
        ((2, 257, 8, 128), "contiguous"),  # Qwen3 per-head q/k norm
        ((2, 64, 8192), "strided"),
    ],
)
def test_rms_norm_matches_float64(dtype, offset, shape, layout):
    if layout == "transposed":
        x = torch.randn(shape[1], shape[0], *shape[2:], device="cuda", dtype=dtype).transpose(0, 1)
    elif layout == "strided":
        x = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=dtype)[..., ::2]
    else:
        x = torch.randn(shape, device="cuda", dtype=dtype)
    weight = (1.0 + 0.5 * torch.randn(shape[-1], device="cuda")).to(dtype)
    x.requires_grad_(), weight.requires_grad_()
    y = rms_norm(x, weight, EPS, offset)
    grad_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight), grad_y)

    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    y64 = _rms_norm64(x64, w64, offset)
    grads64 = torch.autograd.grad(y64, (x64, w64), grad_y.double())
    _close((y,), (y64,), dtype)
    _close(grads[:1], grads64[:1], dtype)
    # dW sums over every row: compare relative to its scale.
    scale = grads64[1].abs().max()
    torch.testing.assert_close(grads[1].double() / scale, grads64[1] / scale, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_hf_modules(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama, gemma = LlamaRMSNorm(2048, eps=1e-5), Gemma3RMSNorm(2048, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_(1.0, 0.5)
        gemma.weight.normal_(0.0, 0.3)
    llama.to("cuda", dtype), gemma.to("cuda", dtype)
    x = torch.randn(4, 129, 2048, device="cuda", dtype=dtype)
    # Same cast order; a rounding boundary may still land one bf16 step apart (the rsqrt differs).
    tolerance = {"rtol": 2e-2, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(rms_norm(x, llama.weight, llama.variance_epsilon), llama(x), **tolerance)
    torch.testing.assert_close(rms_norm(x, gemma.weight, gemma.eps, offset=1.0), gemma(x), **tolerance)


def test_rms_norm_opcheck_and_compile():
    x = torch.randn(3, 37, 123, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(123, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for offset in (0.0, 1.0):
        torch.library.opcheck(_rms_norm, (x, weight, EPS, offset))
    rstd = torch.rand(3, 37, device="cuda") + 0.5
    torch.library.opcheck(_rms_norm_backward, (torch.randn_like(x), x.detach(), weight.detach(), rstd, 1.0))

    def norm(x, weight):
        return rms_norm(x, weight, EPS) * 2

    out = _assert_compiles_without_breaks(norm, (x, weight), ["_rms_norm_forward_kernel"])
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None


# ---------------------------------------------------------------- rope


def _rope64(x, cos, sin):
    x, cos, sin = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    half = cos.shape[-1] // 2
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat(
        (x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:], rest), -1
    )


def _qk(batch, n_q, n_kv, seq_len, head_dim, dtype):
    q = torch.randn(batch, seq_len, n_q, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq_len, n_kv, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_()


def _cos_sin(batch, seq_len, rotary_dim, dtype):
    angles = torch.arange(seq_len, device="cuda")[None, :, None] * (
        1e4 ** (-torch.arange(0, rotary_dim, 2, device="cuda") / rotary_dim)
    )
    emb = torch.cat((angles, angles), dim=-1).expand(batch, -1, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "n_q", "n_kv"),
    [
        (64, 64, 32, 8),
        (80, 32, 20, 4),
        (128, 128, 40, 8),
        (128, 64, 16, 16),
        (256, 256, 48, 8),
    ],  # 48 heads of 256: two head blocks
)
def test_rope_matches_float64(dtype, head_dim, rotary_dim, n_q, n_kv):
    q, k = _qk(2, n_q, n_kv, 257, head_dim, dtype)
    cos, sin = _cos_sin(2, 257, rotary_dim, dtype)
    q_out, k_out = apply_rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
    grads = torch.autograd.grad((q_out, k_out), (q, k), (grad_q, grad_k))

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    q_ref, k_ref = _rope64(q64, cos, sin), _rope64(k64, cos, sin)
    grads64 = torch.autograd.grad((q_ref, k_ref), (q64, k64), (grad_q.double(), grad_k.double()))
    _close((q_out, k_out), (q_ref, k_ref), dtype)
    _close(grads, grads64, dtype)


def test_rope_matches_apply_rotary_pos_emb_in_bfloat16():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _qk(2, 32, 8, 300, 128, torch.bfloat16)
    cos, sin = _cos_sin(2, 300, 128, torch.bfloat16)
    # transformers rounds each product and the sum to bf16, we round once: compare on the scale of q.
    torch.testing.assert_close(
        apply_rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), rtol=2e-2, atol=3e-2
    )


def test_rope_opcheck_and_compile():
    q, k = _qk(2, 6, 2, 33, 64, torch.bfloat16)
    cos, sin = _cos_sin(2, 33, 64, torch.bfloat16)
    torch.library.opcheck(_rope, (q, k, cos, sin))
    torch.library.opcheck(_rope_backward, (torch.randn_like(q), torch.randn_like(k), cos, sin))

    def rotate(q, k, cos, sin):
        q, k = apply_rope(q, k, cos, sin)
        return q + 1, k * 2

    q_out, k_out = _assert_compiles_without_breaks(rotate, (q, k, cos, sin), ["_rope_kernel"])
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad is not None and k.grad is not None


# ---------------------------------------------------------------- swiglu / geglu

GLUS = {
    "swiglu": (swiglu, _swiglu, F.silu),
    "geglu": (geglu, _geglu, lambda g: F.gelu(g, approximate="tanh")),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", GLUS)
@pytest.mark.parametrize("fused", [False, True])
def test_glu_matches_float64(dtype, name, fused):
    glu, _, activation64 = GLUS[name]
    shape = (2, 257, 1500)
    if fused:
        gate, up = (3 * torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=dtype)).chunk(2, dim=-1)
    else:
        gate, up = (
            3 * torch.randn(shape, device="cuda", dtype=dtype),
            torch.randn(shape, device="cuda", dtype=dtype),
        )
    gate.requires_grad_(), up.requires_grad_()
    out = glu(gate, up)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (gate, up), grad_out)

    gate64, up64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    out64 = activation64(gate64) * up64
    grads64 = torch.autograd.grad(out64, (gate64, up64), grad_out.double())
    _close((out,), (out64,), dtype)
    _close(grads, grads64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", GLUS)
def test_glu_inplace_backward_is_exact_and_reuses_the_inputs(dtype, name):
    glu = GLUS[name][0]
    fused = torch.randn(2, 257, 2 * 1500, device="cuda", dtype=dtype).mul_(3).requires_grad_()
    grad_out = torch.randn(2, 257, 1500, device="cuda", dtype=dtype)
    expected = torch.autograd.grad(glu(*(fused * 1).chunk(2, dim=-1)), fused, grad_out)[0]

    gate, up = (fused * 1).chunk(2, dim=-1)  # a fused gate-up projection output, halves viewed
    base = gate.data_ptr()
    seen = []
    gate.register_hook(lambda grad: seen.append(grad.data_ptr()))
    got = torch.autograd.grad(glu(gate, up, inplace_backward=True), fused, grad_out)[0]
    assert torch.equal(got, expected)
    assert seen == [base]  # the gradient was written where gate was
    inplace_op = getattr(torch.ops.sloth, f"{name}_backward_").default
    gate, up = torch.randn(2, 5, 2 * 333, device="cuda", dtype=dtype).chunk(2, dim=-1)
    torch.library.opcheck(inplace_op, (torch.randn(2, 5, 333, device="cuda", dtype=dtype), gate, up))


@pytest.mark.parametrize("name", GLUS)
def test_glu_opcheck_and_compile(name):
    glu, op, _ = GLUS[name]
    gate, up = (torch.randn(5, 2 * 333, device="cuda", dtype=torch.bfloat16)).chunk(2, dim=-1)
    gate.requires_grad_(), up.requires_grad_()
    torch.library.opcheck(op, (gate, up))
    backward_op = getattr(torch.ops.sloth, f"{name}_backward").default
    torch.library.opcheck(
        backward_op, (torch.randn(5, 333, device="cuda", dtype=torch.bfloat16), gate.detach(), up.detach())
    )

    def mlp(gate, up):
        return glu(gate, up) * 3

    out = _assert_compiles_without_breaks(mlp, (gate, up), ["_glu_forward_kernel"])
    out.sum().backward()
    assert gate.grad is not None and up.grad is not None


def test_flops_are_counted_on_cuda():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        swiglu(rms_norm(x, weight, EPS), x).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.sloth.rms_norm] == 4 * 256
    assert counts[torch.ops.sloth.swiglu_backward] == 9 * 256
