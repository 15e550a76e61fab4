"""sloth::linear_cross_entropy and sloth::lora_linear on CUDA: dtypes vs float64, peak memory, no host
syncs, opcheck on the triton_op path, compile with zero graph breaks.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_ops_b_gpu.py``.
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_sloth.ops.linear_cross_entropy import _cross_entropy_rows_reference_, linear_cross_entropy
from lightning_sloth.ops.lora import lora_linear
from lightning_sloth.ops.registry import TRITON_OPS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative Frobenius error allowed against float64, per dtype (fp32 runs with TF32 off).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
LORA_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# Incoming loss gradient; float16 gets a loss scale, as 16-mixed training does, so that the weight
# gradient (~1e-6 per entry for a ~900-token mean) is not in float16's subnormal range.
GRAD_OUT = {torch.float32: 1.7, torch.bfloat16: 1.7, torch.float16: 1.7 * 1024}


@pytest.fixture(autouse=True)
def _strict_fp32_and_fresh_compile():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    torch.manual_seed(2024)
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _rel_err(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _lce_inputs(dtype, n=1031, h=256, v=32003, ignore_every=7):
    hidden = torch.randn(n, h, device="cuda", dtype=dtype)
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), device="cuda")
    targets[::ignore_every] = -100
    return hidden, weight, targets


def _lce_leaves(hidden, weight, bias, targets, softcap, dtype, grad_out):
    """Loss and leaves (with grads) of the unfused computation in ``dtype`` (float64: the reference).

    In the inputs' own dtype this is the plain transformers path: lm-head logits in that dtype, then
    ``F.cross_entropy(logits.float())``; its rounding is the baseline the fused op is held to.
    """
    h, w, b = (t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias))
    logits = F.linear(h, w, b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits.to(torch.promote_types(dtype, torch.float32)), targets)
    (loss * grad_out).backward()
    return loss.detach(), (h, w, b)


def test_triton_op_path_is_active():
    assert TRITON_OPS, "CUDA is present, so the ops must register as triton_op and run the Triton kernels"


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_matches_float64(dtype, softcap):
    hidden, weight, targets = _lce_inputs(dtype)
    bias = torch.randn(weight.shape[0], device="cuda", dtype=dtype)
    if softcap is not None:
        hidden = hidden * 8  # logits large enough for the cap to bend them
    for t in (hidden, weight, bias):
        t.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, bias=bias, softcap=softcap, chunk_size=256)
    (loss * GRAD_OUT[dtype]).backward()

    ref, ref_leaves = _lce_leaves(hidden, weight, bias, targets, softcap, torch.float64, GRAD_OUT[dtype])
    plain, plain_leaves = _lce_leaves(hidden, weight, bias, targets, softcap, dtype, GRAD_OUT[dtype])
    # Held to the plain path's own rounding error (x2 for the chunked fp32 accumulation), plus a floor.
    floor = REL_TOL[dtype] / 5
    assert abs(loss.item() - ref.item()) <= 2 * abs(plain.item() - ref.item()) + floor * abs(ref.item())
    for got, ref_leaf, plain_leaf in zip((hidden.grad, weight.grad, bias.grad), ref_leaves, plain_leaves):
        assert got.dtype == dtype
        assert _rel_err(got, ref_leaf.grad) <= 2 * _rel_err(plain_leaf.grad, ref_leaf.grad) + floor
        assert _rel_err(got, ref_leaf.grad) <= REL_TOL[dtype]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_kernel_matches_torch_rows(dtype, softcap):
    """The Triton rows kernel against the plain-torch rows function on the same (e.g. bf16) logits."""
    from lightning_sloth.kernels.cross_entropy import cross_entropy_rows_

    logits = (4 * torch.randn(67, 50001, device="cuda")).to(dtype)
    targets = torch.randint(0, 50001, (67,), device="cuda")
    targets[3] = -100
    got_grad, ref_grad = logits.clone(), logits.clone()
    got = cross_entropy_rows_(got_grad, targets, -100, softcap, True)
    ref = _cross_entropy_rows_reference_(ref_grad, targets, -100, softcap, True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-2, atol=1e-6)
    assert not got_grad[3].any()


def test_no_host_sync():
    hidden, weight, targets = _lce_inputs(torch.bfloat16)
    hidden.requires_grad_()
    num_items = (targets != -100).sum() * 2  # a device tensor, as transformers passes it
    linear_cross_entropy(hidden, weight, targets).backward()  # compiles the kernels first
    x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(384, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_cross_entropy(hidden, weight, targets, num_items_in_batch=num_items).backward()
        lora_linear(x, w, a, b, 2.0).backward(torch.randn(4, 33, 384, device="cuda", dtype=torch.bfloat16))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _peak_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, result


def test_peak_memory_llama3_vocab():
    n, h, v = 16384, 2048, 128256
    hidden, weight, targets = _lce_inputs(torch.bfloat16, n=n, h=h, v=v, ignore_every=5)
    hidden.requires_grad_()  # lm_head frozen, as in LoRA fine-tuning

    def plain():
        loss = F.cross_entropy((hidden @ weight.t()).float(), targets)
        loss.backward()
        hidden.grad = None
        return loss.detach()

    def fused():
        loss = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        hidden.grad = None
        return loss.detach()

    fused()  # Triton compilation outside the measurement
    plain_peak, plain_loss = _peak_bytes(plain)
    fused_peak, fused_loss = _peak_bytes(fused)
    logits_bytes = n * v * 2
    print(f"peak: plain {plain_peak / 2**30:.2f} GiB, fused {fused_peak / 2**30:.2f} GiB")
    assert fused_peak < 0.4 * plain_peak
    assert fused_peak < 0.25 * logits_bytes
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_matches_float64(dtype):
    x = torch.randn(3, 257, 1024, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(768, 1024, device="cuda") / 32).to(dtype)
    lora_a = (torch.randn(16, 1024, device="cuda") / 32).to(dtype).requires_grad_()
    lora_b = torch.randn(768, 16, device="cuda", dtype=dtype, requires_grad=True)
    grad_y = torch.randn(3, 257, 768, device="cuda", dtype=dtype)
    y = lora_linear(x, weight, lora_a, lora_b, 2.0)
    y.backward(grad_y)

    xd, a, b = (t.detach().double().requires_grad_() for t in (x, lora_a, lora_b))
    ref = xd @ weight.double().t() + 2.0 * (xd @ a.t()) @ b.t()
    ref.backward(grad_y.double())
    assert y.dtype == dtype
    for got, expected in [(y, ref.detach()), (x.grad, xd.grad), (lora_a.grad, a.grad), (lora_b.grad, b.grad)]:
        assert _rel_err(got, expected) <= LORA_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_triton_op_path(dtype):
    hidden, weight, targets = _lce_inputs(dtype, n=45, h=64, v=3001)
    bias = torch.randn(3001, device="cuda", dtype=dtype, requires_grad=True)
    for flags in [(True, True, True), (False, False, False)]:
        args = (
            hidden.detach().requires_grad_(flags[0]),
            weight.detach().requires_grad_(flags[1]),
            bias.detach().requires_grad_(flags[2]),
            targets,
            torch.tensor(30, device="cuda"),
            -100,
            10.0,
            "mean",
            16,
            *flags,
        )
        torch.library.opcheck(torch.ops.sloth.linear_cross_entropy.default, args)

    x = torch.randn(2, 9, 64, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(48, 64, device="cuda", dtype=dtype)
    a = torch.randn(4, 64, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(48, 4, device="cuda", dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.sloth.lora_linear.default, (x, w, a, b, 1.5))
    xa = x.detach().reshape(-1, 64) @ a.detach().t()
    torch.library.opcheck(
        torch.ops.sloth.lora_linear_backward.default,
        (torch.randn(2, 9, 48, device="cuda", dtype=dtype), x.detach(), xa, w, a.detach(), b.detach(), 1.5)
        + (True, True, True),
    )


def test_compile_fullgraph_no_graph_breaks():
    hidden, weight, targets = _lce_inputs(torch.bfloat16, n=515, h=128, v=8191)
    x = torch.randn(2, 31, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(96, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(h, x):
        y = lora_linear(x, w, a, b, 2.0)
        return (
            linear_cross_entropy(h, weight, targets, softcap=20.0, chunk_size=128) + y.float().square().mean()
        )

    explanation = torch._dynamo.explain(step)(hidden, x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()

    h_eager, h_comp = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    expected = step(h_eager, x)
    expected.backward()
    expected_grads = [t.grad.clone() for t in (h_eager, a, b)]
    a.grad = b.grad = None
    got = torch.compile(step, fullgraph=True)(h_comp, x)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    for g, e in zip((h_comp.grad, a.grad, b.grad), expected_grads):
        assert _rel_err(g, e.double()) <= 2e-2
