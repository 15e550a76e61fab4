"""The top-k router op (``lightning_sloth.moe.router``, ``sloth::moe_router_topk``).

Plain-torch path (CPU): the op equals :func:`router_logits` + the family's rule of ``ROUTERS`` in its
three outputs, and its analytic backward equals autograd through that reference (the weights' and the
logits' gradients together, as with an auxiliary loss) for every rule: softmax then top-k with and
without renormalisation, top-k then softmax with a bias; opcheck; errors; the patched routers of
tiny Qwen3-MoE and GPT-OSS models go through it with the same loss and gradients as transformers'.

Triton kernel (``interpreted`` cases, rerun under ``TRITON_INTERPRET=1`` by the launcher test): the
same in float32 and float16 at odd sizes (E not a power of two, H not a multiple of the K tile, T
not a multiple of the row tile), ties broken by the lower expert id, the same bits twice.
"""

from __future__ import annotations

import pytest
import torch
from _interpreter import INTERPRETED, interpreted_only, launcher_only, run_interpreted_cases

from lightning_sloth.moe.router import FUSED_ROUTER_RULES, fused_router_rule, route_topk
from lightning_sloth.moe.routing import route_softmax_topk, route_topk_softmax, router_logits

torch.set_num_threads(2)

RULES = [(True, True), (True, False), (False, False)]
RULE_IDS = ["softmax-topk-normalised", "softmax-topk", "topk-softmax"]


def _reference(x, weight, bias, top_k, softmax_first, normalize):
    logits = router_logits(x, weight, bias)
    if softmax_first:
        weights, index = route_softmax_topk(logits, top_k, normalize, keep_float32=True)
    else:
        weights, index = route_topk_softmax(logits, top_k)
    return logits, weights, index


def _inputs(tokens, hidden, experts, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_()
    b = (torch.randn(experts, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    return x, weight, b


def _grads(outputs, leaves, seed=1):
    """Gradients of a loss that reads the weights and the logits (an auxiliary-loss term)."""
    gen = torch.Generator().manual_seed(seed)
    logits, weights, _ = outputs
    loss = (weights * torch.randn(weights.shape, generator=gen)).sum()
    loss = loss + (logits * torch.randn(logits.shape, generator=gen)).sum() * 0.01
    leaves = [t for t in leaves if t is not None]
    return torch.autograd.grad(loss, leaves)


@pytest.mark.skipif(INTERPRETED, reason="the reference path")
@pytest.mark.parametrize("softmax_first, normalize", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_reference_rule_with_its_gradients(softmax_first, normalize, dtype):
    top_k = 3
    x, weight, bias = _inputs(11, 24, 7, dtype, bias=not softmax_first)
    ours = route_topk(x, weight, bias, top_k, softmax_first, normalize)
    ref = _reference(x, weight, bias, top_k, softmax_first, normalize)
    assert ours[0].dtype == ours[1].dtype == torch.float32 and ours[2].dtype == torch.int64
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[2], ref[2])
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=0)
    for a, b in zip(_grads(ours, (x, weight, bias)), _grads(ref, (x, weight, bias)), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(INTERPRETED, reason="the reference path")
def test_op_passes_opcheck():
    x, weight, bias = _inputs(6, 16, 5, torch.float32, bias=True)
    for softmax_first, normalize in RULES:
        torch.library.opcheck(
            torch.ops.sloth.moe_router_topk.default, (x, weight, bias, 2, softmax_first, normalize)
        )
    torch.library.opcheck(torch.ops.sloth.moe_router_topk.default, (x, weight, None, 2, True, True))


@pytest.mark.skipif(INTERPRETED, reason="the reference path")
def test_bad_input_is_refused_with_a_clear_error():
    x, weight, bias = _inputs(4, 8, 5, torch.float32, bias=True)
    with pytest.raises(ValueError, match=r"top_k=6 must be in 1..5"):
        route_topk(x, weight, bias, 6, True, True)
    with pytest.raises(ValueError, match=r"does not fit the router weight"):
        route_topk(x[:, :7], weight, bias, 2, True, True)
    with pytest.raises(ValueError, match=r"bias \(4,\) must be \[E\]"):
        route_topk(x, weight, bias[:4], 2, True, True)


def test_rules_cover_the_softmax_and_top_k_families():
    class Config:
        norm_topk_prob = False

    assert fused_router_rule("qwen3_moe", Config()) == (True, False)
    assert fused_router_rule("mixtral", Config()) == (True, True)
    assert fused_router_rule("gpt_oss", Config()) == (False, False)
    assert fused_router_rule("deepseek_v3", Config()) is None  # group-limited: ROUTERS
    assert set(FUSED_ROUTER_RULES) == {
        "qwen3_moe",
        "qwen2_moe",
        "qwen3_next",
        "qwen3_5_moe_text",
        "mixtral",
        "gpt_oss",
    }


def _tiny_model(family):
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(num_experts=6, moe_intermediate_size=16, norm_topk_prob=True, **common)
        return Qwen3MoeForCausalLM(config)
    config = GptOssConfig(
        num_local_experts=6, intermediate_size=16, layer_types=["full_attention"] * 2, **common
    )
    return GptOssForCausalLM(config)


@pytest.mark.skipif(INTERPRETED, reason="the interpreted run has its own kernel cases")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_patched_routers_run_the_op_with_transformers_loss_and_gradients(family, monkeypatch):
    import copy

    from lightning_sloth.moe import router as router_module
    from lightning_sloth.patching import apply_experts

    model = _tiny_model(family).float()
    reference = copy.deepcopy(model)
    report = apply_experts(model)
    assert report.routers
    calls = []
    original = router_module._reference
    monkeypatch.setattr(router_module, "_reference", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for m in (model, reference):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert len(calls) == 2  # both layers' routers went through the op
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(param.grad, grads[name], rtol=2e-4, atol=2e-6, msg=name)


# ------------------------------------------------------------------------------ Triton kernel
@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout.split("\n")[-2]


@interpreted_only
@pytest.mark.parametrize("softmax_first, normalize", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("dtype, tokens, hidden, experts, top_k", [
    (torch.float32, 37, 40, 20, 3),
    (torch.float16, 19, 64, 8, 1),
    (torch.float32, 5, 24, 33, 8),
])  # fmt: skip
def test_kernels_interpreted_kernel_matches_the_reference(
    softmax_first, normalize, dtype, tokens, hidden, experts, top_k
):
    from lightning_sloth.kernels import moe_router as kernels

    x, weight, bias = _inputs(tokens, hidden, experts, dtype, bias=not softmax_first)
    calls = []
    launch = kernels.router_topk

    def counted(*args):
        calls.append(1)
        return launch(*args)

    kernels.router_topk = counted
    try:
        ours = route_topk(x, weight, bias, top_k, softmax_first, normalize)
        again = route_topk(x, weight, bias, top_k, softmax_first, normalize)
    finally:
        kernels.router_topk = launch
    assert calls == [1, 1]
    ref = _reference(
        x.float(), weight.float(), None if bias is None else bias.float(), top_k, softmax_first, normalize
    )
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[2], ref[2])
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True))  # the same bits twice
    for a, b in zip(_grads(ours, (x, weight, bias)), _grads(ref, (x, weight, bias)), strict=True):
        torch.testing.assert_close(
            a.float(),
            b.float(),
            rtol=1e-3 if dtype == torch.float16 else 1e-5,
            atol=1e-3 if dtype == torch.float16 else 1e-6,
        )


@interpreted_only
def test_kernels_interpreted_ties_go_to_the_lower_expert_in_descending_order():
    from lightning_sloth.kernels import moe_router as kernels

    x = torch.ones(3, 16)
    weight = torch.zeros(6, 16)
    weight[4] = 0.5  # expert 4 first, then 0, 1, 2 ... tied at zero
    logits, weights, index = kernels.router_topk(x, weight, None, 3, True, True)
    assert index.tolist() == [[4, 0, 1]] * 3
    assert torch.all(weights[:, 1] == weights[:, 2]) and torch.all(weights[:, 0] > weights[:, 1])
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(3))


@interpreted_only
@pytest.mark.parametrize("softmax_first, normalize", RULES, ids=RULE_IDS)
def test_kernels_interpreted_backward_without_the_logits_gradient(softmax_first, normalize):
    """The weights alone read (no auxiliary loss): the backward kernel gets no logits' gradient, and a
    frozen router weight gets no ``dlogits`` written (only dx)."""
    x, weight, bias = _inputs(21, 48, 12, torch.float32, bias=False)
    weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(4)
    probe = torch.randn(21, 4, generator=gen)
    ours = route_topk(x, weight, None, 4, softmax_first, normalize)[1]
    ref = _reference(x, weight, None, 4, softmax_first, normalize)[1]
    (dx,) = torch.autograd.grad((ours * probe).sum(), x)
    (ref_dx,) = torch.autograd.grad((ref * probe).sum(), x)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
