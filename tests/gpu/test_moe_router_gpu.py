"""GPU checks of the one-kernel top-k router (``sloth::moe_router_topk``, ``kernels.moe_router``).

At the Qwen3-30B-A3B router shape (2,048 wide, 128 experts, top-8, renormalised) and GPT-OSS-20B's
(2,880 wide, 32 experts with a bias, top-4, softmax over the four), bf16, 16k tokens: the logits
against the float32 reference GEMM, the same experts chosen (a row may differ only where two logits
tie to float32 rounding), the weights, the gradients to x, W and the bias against autograd through
the reference; the same bits twice; opcheck on the ``triton_op`` path; ``torch.compile`` in one
graph; no host sync in a forward and backward; Qwen3-MoE and GPT-OSS blocks whose router
``install_router`` patched, LoRA on the experts, through the kernel against the same router's plain-torch
rule (output, input gradient, LoRA gradients).

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_moe_router_gpu.py``.
"""

import pytest
import torch
from _moe_blocks import block_step, lora_block

from lightning_sloth.moe.router import route_topk
from lightning_sloth.moe.routing import route_softmax_topk, route_topk_softmax, router_logits
from lightning_sloth.patching import install_router, uninstall_router

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, experts=128, top_k=8, softmax_first=True, normalize=True, bias=False),
    "qwen2_unnormalised": dict(
        hidden=2048, experts=60, top_k=4, softmax_first=True, normalize=False, bias=False
    ),
    "gpt_oss_20b": dict(hidden=2880, experts=32, top_k=4, softmax_first=False, normalize=False, bias=True),
}


def _inputs(spec, tokens=16384, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, experts = spec["hidden"], spec["experts"]
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(experts, hidden, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    bias = (
        (torch.randn(experts, device="cuda", generator=gen) * 0.1).bfloat16().requires_grad_()
        if spec["bias"]
        else None
    )
    return x, weight, bias


def _reference(x, weight, bias, spec):
    logits = router_logits(x, weight, bias)
    if spec["softmax_first"]:
        weights, index = route_softmax_topk(logits, spec["top_k"], spec["normalize"], keep_float32=True)
    else:
        weights, index = route_topk_softmax(logits, spec["top_k"])
    return logits, weights, index


def _run(fn, x, weight, bias, spec, seed=1):
    logits, weights, index = fn(x, weight, bias, spec)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    loss = (weights * torch.randn(weights.shape, device="cuda", generator=gen)).sum()
    loss = loss + 0.01 * (logits * torch.randn(logits.shape, device="cuda", generator=gen)).sum()
    leaves = [t for t in (x, weight, bias) if t is not None]
    return (logits, weights, index), torch.autograd.grad(loss, leaves)


def _ours(x, weight, bias, spec):
    return route_topk(x, weight, bias, spec["top_k"], spec["softmax_first"], spec["normalize"])


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(SHAPES))
def test_router_kernel_matches_the_float32_reference(name):
    spec = SHAPES[name]
    x, weight, bias = _inputs(spec)
    (logits, weights, index), grads = _run(_ours, x, weight, bias, spec)
    (ref_logits, ref_weights, ref_index), ref_grads = _run(_reference, x, weight, bias, spec)
    assert logits.dtype == weights.dtype == torch.float32 and index.dtype == torch.int64
    assert _rel(logits, ref_logits) < 1e-5  # float32 sums in another order
    same = (index == ref_index).all(dim=1)
    assert same.float().mean() > 0.999
    if not bool(same.all()):  # a differing row: the swapped experts tie in float32
        rows = (~same).nonzero().squeeze(1)
        ours_at = ref_logits[rows].gather(1, index[rows]).sort(dim=1).values
        ref_at = ref_logits[rows].gather(1, ref_index[rows]).sort(dim=1).values
        torch.testing.assert_close(ours_at, ref_at, rtol=0, atol=1e-5)
    torch.testing.assert_close(weights[same], ref_weights[same], rtol=1e-5, atol=1e-6)
    for ours_grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert ours_grad.dtype == ref_grad.dtype
        assert _rel(ours_grad, ref_grad) < 2e-2 if not bool(same.all()) else _rel(ours_grad, ref_grad) < 5e-3
    # the same bits twice
    (logits2, weights2, index2), grads2 = _run(_ours, x, weight, bias, spec)
    assert torch.equal(logits, logits2) and torch.equal(weights, weights2) and torch.equal(index, index2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_router_op_passes_opcheck_and_compiles_in_one_graph():
    spec = SHAPES["gpt_oss_20b"]
    x, weight, bias = _inputs(spec, tokens=512)
    torch.library.opcheck(torch.ops.sloth.moe_router_topk.default, (x, weight, bias, 4, False, False))
    torch.library.opcheck(torch.ops.sloth.moe_router_topk.default, (x, weight, None, 4, True, True))
    compiled = torch.compile(_ours, fullgraph=True)
    eager = _ours(x, weight, bias, spec)
    traced = compiled(x, weight, bias, spec)
    assert torch.equal(eager[2], traced[2])
    torch.testing.assert_close(eager[1], traced[1], rtol=0, atol=0)


def test_router_forward_and_backward_make_no_host_sync():
    spec = SHAPES["qwen3_30b_a3b"]
    x, weight, bias = _inputs(spec, tokens=4096)
    for _ in range(2):
        _run(_ours, x, weight, bias, spec)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(_ours, x, weight, bias, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_block_with_the_installed_router_matches_its_plain_torch_rule(family, monkeypatch):
    from lightning_sloth.moe import router as router_module

    block = lora_block(family)
    router = getattr(block, "router", None) or block.gate
    config = block.experts.get_base_layer().config
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 512, 256, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(1, 512, 256, device="cuda", generator=gen).bfloat16()
    install_router(router, config.model_type, config)
    launches = []
    kernel = router_module._kernels.router_topk
    monkeypatch.setattr(router_module._kernels, "router_topk", lambda *a: launches.append(1) or kernel(*a))
    ours, names = block_step(block, x, grad)
    assert launches == [1]
    with monkeypatch.context() as patch:  # the same router through router_logits + ROUTERS
        patch.setattr(router_module, "_kernel_usable", lambda *a: False)
        plain, names_plain = block_step(block, x, grad)
    assert launches == [1] and names == names_plain
    assert uninstall_router(router) and not uninstall_router(router)
    for a, b, name in zip(ours, plain, ["out", "dx", *names], strict=True):
        assert _rel(a, b) < 5e-3, name
