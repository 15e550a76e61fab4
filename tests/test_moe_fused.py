"""Fused permutation (``lightning_sloth.moe.fused``): the GEMMs read and write token rows through perm.

Plain-torch path (CPU, float64): both ops equal the separate passes (gather, grouped GEMM + LoRA,
combine / sum) in the output and every gradient, for both weight layouts, top_k 1/2/4, experts with
zero tokens, rank 0 and with a bias; opcheck; 4-bit experts; a tiny Qwen3-MoE and GPT-OSS with LoRA
on the experts give the same loss and gradients with the switch on and off.

Triton kernels (``interpreted`` cases, rerun under ``TRITON_INTERPRET=1`` by the launcher test):
the same in float32 against float64, bit-identical across two runs, and the tiny models.
"""

from __future__ import annotations

import _processes
import pytest
import torch
from _interpreter import INTERPRETED, interpreted_only, launcher_only, run_interpreted_cases
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from lightning_sloth.moe import fused, group_by_expert, moe_combine, moe_gather, moe_sum
from lightning_sloth.moe.fused import gather_lora_grouped_mm, lora_grouped_mm_combine, set_fused_permutation
from lightning_sloth.moe.gemm import lora_grouped_mm
from lightning_sloth.ops.nf4_formats import dequantize_4bit_reference, quantize_4bit
from lightning_sloth.patching import apply_experts

torch.set_num_threads(2)


@pytest.fixture
def fused_switch():
    """Restore the switch after a test that flips it."""
    before = fused.fused_permutation_setting()
    yield set_fused_permutation
    set_fused_permutation(before)


def _routing(tokens, experts, top_k, seed, used=None):
    """Routing where only ``used`` experts (default all) get tokens: the others have zero rows."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(used if used is not None else range(experts))
    index = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    return group_by_expert(index, experts), weights


def _case(transposed, top_k, rank, bias, seed=0, tokens=9, experts=7, n_in=19, n_out=23):
    gen = torch.Generator().manual_seed(seed)
    grouping, weights = _routing(tokens, experts, top_k, seed, used=[1, 2, 4, 5, 6])  # 0 and 3 idle

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    w = rnd(*((experts, n_in, n_out) if transposed else (experts, n_out, n_in)))
    lora = (rnd(experts, rank, n_in), rnd(experts, n_out, rank)) if rank else (None, None)
    return dict(
        grouping=grouping,
        weights=weights,
        x=rnd(tokens, n_in),
        a=rnd(tokens * top_k, n_in),
        w=w,
        lora=lora,
        bias=rnd(experts, n_out) if bias else None,
        top_k=top_k,
        transposed=transposed,
    )


def _leaves(case, dtype):
    out = {}
    for key in ("x", "a", "w", "bias", "weights"):
        t = case[key]
        out[key] = None if t is None else t.detach().to(dtype).requires_grad_()
    out["lora"] = tuple(None if t is None else t.detach().to(dtype).requires_grad_() for t in case["lora"])
    return out


def _first(case, t, fused_path):
    g, k = case["grouping"], case["top_k"]
    lora_a, lora_b = t["lora"]
    kw = dict(transposed=case["transposed"], bias=t["bias"], expert_ids=g.expert_ids)
    if fused_path:
        return gather_lora_grouped_mm(t["x"], g.perm, k, t["w"], lora_a, lora_b, 0.5, g.ends, **kw)
    x = moe_gather(t["x"], g.perm, g.inv, k)
    if lora_a is None:
        from lightning_sloth.moe import grouped_mm

        return grouped_mm(x, t["w"], g.ends, **kw)
    return lora_grouped_mm(x, t["w"], lora_a, lora_b, 0.5, g.ends, **kw)


def _second(case, t, fused_path, weighted):
    g, k = case["grouping"], case["top_k"]
    lora_a, lora_b = t["lora"]
    weights = t["weights"] if weighted else None
    kw = dict(transposed=case["transposed"], bias=t["bias"], expert_ids=g.expert_ids)
    if fused_path:
        return lora_grouped_mm_combine(t["a"], weights, g.perm, k, t["w"], lora_a, lora_b, 0.5, g.ends, **kw)
    if lora_a is None:
        from lightning_sloth.moe import grouped_mm

        y = grouped_mm(t["a"], t["w"], g.ends, **kw)
    else:
        y = lora_grouped_mm(t["a"], t["w"], lora_a, lora_b, 0.5, g.ends, **kw)
    return moe_combine(y, weights, g.perm, g.inv) if weighted else moe_sum(y, g.perm, g.inv, k)


def _grads(out, t, grad):
    leaves = [v for v in (t["x"], t["a"], t["w"], t["bias"], t["weights"], *t["lora"]) if v is not None]
    got = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return [torch.zeros_like(v) if g is None else g for v, g in zip(leaves, got, strict=True)]


def _compare(case, dtype, rtol, atol, weighted=True):
    """Both fused ops in ``dtype`` against the separate passes in float64: outputs and every gradient."""
    results = {}
    for fused_path, dt in ((False, torch.float64), (True, dtype)):
        t = _leaves(case, dt)
        first = _first(case, t, fused_path)
        second = _second(case, t, fused_path, weighted)
        g1 = torch.linspace(-1, 1, first.numel(), dtype=dt).view_as(first)
        g2 = torch.linspace(1, -1, second.numel(), dtype=dt).view_as(second)
        results[fused_path] = (first, second, _grads((first, second), t, (g1, g2)))
    (f_ref, s_ref, g_ref), (f, s, g) = results[False], results[True]
    torch.testing.assert_close(f.double(), f_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(s.double(), s_ref, rtol=rtol, atol=atol)
    for got, want in zip(g, g_ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    return f, s, g


# ------------------------------------------------------------------------- plain-torch path
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_ops_equal_the_separate_passes_in_float64(transposed, top_k):
    for rank, bias, weighted in ((3, False, True), (0, True, True), (3, True, False)):
        _compare(_case(transposed, top_k, rank, bias), torch.float64, 1e-12, 1e-12, weighted)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("flags", [("ORDERED",), ("GATHERED",), ("ORDERED", "GATHERED")])
def test_gemms_through_grouped_mm_equal_the_separate_passes(transposed, top_k, flags, monkeypatch):
    """ORDERED_ROWS_GROUPED_MM: the second GEMM's forward and the first's input gradient make their rows
    in expert order (torch._grouped_mm on Hopper; the per-expert reference here) and sum each token's
    k rows through the inverse permutation; the routing weights' gradient reads them the same way.
    GATHERED_ROWS_GROUPED_MM: the first GEMM's forward and the second's input gradient make the
    gathered (scaled) copy instead of reading through the permutation. Both: every GEMM is CUTLASS's."""
    from lightning_sloth.moe import indexed

    calls = []
    spied = {
        "ORDERED": ("ordered_rows_sum", "ordered_rows_dot", "ordered_input_grad_sum"),
        "GATHERED": ("gathered_rows",),
    }
    for flag in flags:
        monkeypatch.setattr(indexed, f"{flag}_ROWS_GROUPED_MM", True)
        for name in spied[flag]:
            real = getattr(indexed, name)
            monkeypatch.setattr(
                indexed, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
            )
    monkeypatch.setattr(indexed, "_grouped_mm_takes", lambda x, shape: True)
    for rank, bias, weighted in ((8, False, True), (0, True, True), (8, True, False)):
        _compare(_case(transposed, top_k, rank, bias), torch.float64, 1e-12, 1e-12, weighted)
    assert {n for f in flags for n in spied[f]} <= set(calls)
    assert not indexed.ordered_grouped_mm(torch.zeros(2, 8), [3, 8, 8], 3)  # rank 3: rows of 6 bytes
    assert not indexed.gathered_grouped_mm(torch.zeros(2, 8), [3, 8, 8], 3)


def test_opcheck_both_ops():
    case = _case(False, 2, 3, True)
    t = _leaves(case, torch.float64)
    g, k = case["grouping"], case["top_k"]
    empty = g.ends.new_zeros(0, dtype=torch.int64)
    a_, b_ = t["lora"]
    torch.library.opcheck(
        torch.ops.sloth.moe_gather_lora_grouped_mm.default,
        (t["x"], g.perm, k, t["w"], None, None, 0, list(t["w"].shape), t["bias"], a_, b_, 0.5, g.ends,
         g.expert_ids, False),
    )  # fmt: skip
    torch.library.opcheck(
        torch.ops.sloth.moe_lora_grouped_mm_combine.default,
        (t["a"], t["weights"], g.perm, k, t["w"], None, None, 0, list(t["w"].shape), None, a_, b_, 0.5, g.ends,
         empty, False),
    )  # fmt: skip


def test_flops_are_counted():
    case = _case(False, 2, 0, False)
    t = _leaves(case, torch.float64)
    t["w"].requires_grad_(False)  # frozen base weight: no weight gradient GEMM
    with FlopCounterMode(display=False) as counter:
        _first(case, t, True).sum().backward()
    rows, (_, n_out, n_in) = case["a"].shape[0], case["w"].shape
    assert counter.get_total_flops() == 2 * (2 * rows * n_out * n_in)  # forward + the input's gradient


@pytest.mark.parametrize("transposed", [False, True])
def test_4bit_experts_equal_the_dequantised_weight(transposed):
    case = _case(transposed, 2, 3, False, n_in=32, n_out=48)
    t = _leaves(case, torch.float32)
    storage = quantize_4bit(t["w"].detach(), "nf4")
    dense = dequantize_4bit_reference(storage, torch.float32)
    g, k = case["grouping"], 2
    lora_a, lora_b = t["lora"]
    kw = dict(transposed=transposed, expert_ids=g.expert_ids)
    outs = []
    for weight, packed in ((dense, None), (None, storage)):
        h = gather_lora_grouped_mm(
            t["x"], g.perm, k, weight, lora_a, lora_b, 0.5, g.ends, storage=packed, **kw
        )
        a = h[:, :32] if not transposed else h[:, :32]
        y = lora_grouped_mm_combine(
            a, t["weights"], g.perm, k, weight, lora_a, lora_b, 0.5, g.ends, storage=packed, **kw
        )
        outs.append((y, torch.autograd.grad(y.sum(), (t["x"], t["weights"], lora_a, lora_b))))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for got, want in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(got, want)


def test_bad_input_is_named():
    case = _case(False, 2, 3, False)
    g = case["grouping"]
    with pytest.raises(ValueError, match="gather_lora_grouped_mm.*do not fit"):
        gather_lora_grouped_mm(case["x"][:, :5], g.perm, 2, case["w"], *case["lora"], 0.5, g.ends)
    with pytest.raises(ValueError, match="perm has"):
        gather_lora_grouped_mm(case["x"], g.perm, 3, case["w"], *case["lora"], 0.5, g.ends)
    with pytest.raises(ValueError, match="weights"):
        lora_grouped_mm_combine(
            case["a"], case["weights"][:-1], g.perm, 2, case["w"], *case["lora"], 0.5, g.ends
        )
    with pytest.raises(ValueError, match="a bias needs expert_ids"):
        gather_lora_grouped_mm(
            case["x"], g.perm, 2, case["w"], *case["lora"], 0.5, g.ends, bias=case["w"][:, :, 0]
        )


# ---------------------------------------------------------------------------- tiny models
_COMMON = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip


def _tiny(family, layers=2):
    torch.manual_seed(0)
    common = {**_COMMON, "num_hidden_layers": layers}
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
            norm_topk_prob=True, attn_implementation="sdpa",
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    else:
        config = GptOssConfig(
            **common,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=24,
            attn_implementation="eager",
        )
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "experts" in name or "router" in name:
                    param.normal_(0.0, 0.3)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )  # fmt: skip
    model = get_peft_model(model.float(), lora).train()
    apply_experts(model)
    return model


def _model_run(model, ids, switch, enabled):
    switch(enabled)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model_parity(family, switch, layers=1):
    model = _tiny(family, layers)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    loss_ref, grads_ref = _model_run(model, ids, switch, False)
    loss, grads = _model_run(model, ids, switch, True)
    assert grads.keys() == grads_ref.keys() and any("experts" in n for n in grads)
    assert abs(float(loss - loss_ref)) <= 1e-5 * abs(float(loss_ref))
    for name, want in grads_ref.items():
        rel = float((grads[name] - want).norm() / want.norm().clamp_min(1e-30))
        assert rel <= 1e-5, (name, rel)
    return loss, grads


@pytest.mark.skipif(INTERPRETED, reason="the interpreted run has its own model case")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_tiny_model_equals_the_current_experts_path(family, fused_switch):
    _model_parity(family, fused_switch)


@pytest.mark.skipif(INTERPRETED, reason="compiled in the normal run")
def test_block_with_the_switch_on_compiles_fullgraph_with_the_same_result(fused_switch):
    """Both ops have fake and autograd implementations: Dynamo traces a GPT-OSS block (router, bias,
    clamped SwiGLU, weighted combine, PEFT LoRA on the experts) in one graph."""
    block = _tiny("gpt_oss", layers=1).base_model.model.model.layers[0].mlp
    fused_switch(True)
    x = torch.randn(1, 9, 32, requires_grad=True)
    grad = torch.randn(1, 9, 32)
    params = [x, *(p for p in block.parameters() if p.requires_grad)]
    expected = block(x)[0]
    expected_grads = torch.autograd.grad(expected, params, grad)
    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(x)[0]
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, params, grad), expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_switch_is_auto_by_default_fused_on_cuda_and_one_flag(fused_switch, monkeypatch):
    """Unset, the switch is "auto": the fused ops where the rows are on a CUDA device, the separate
    passes elsewhere; True and False force either; the environment variable takes 1, 0 or auto and
    names a bad value."""
    from lightning_sloth.moe import switch

    monkeypatch.delenv("LIGHTNING_SLOTH_MOE_FUSED", raising=False)
    assert switch._from_environment() is None
    fused_switch(None)
    assert fused.fused_permutation_setting() is None
    assert fused.fused_permutation_enabled(None, torch.device("cuda", 0)) is True
    assert fused.fused_permutation_enabled(None, "cpu") is False
    assert fused.fused_permutation_enabled() is torch.cuda.is_available()
    fused_switch(True)
    assert fused.fused_permutation_enabled(None, "cpu") is True
    fused_switch(False)
    assert fused.fused_permutation_enabled(None, "cuda") is False
    with pytest.raises(ValueError, match="True, False or None"):
        fused_switch("yes")
    for value, want in [("1", True), ("0", False), ("auto", None), ("off", False), ("", None)]:
        monkeypatch.setenv("LIGHTNING_SLOTH_MOE_FUSED", value)
        assert switch._from_environment() is want, value
    monkeypatch.setenv("LIGHTNING_SLOTH_MOE_FUSED", "fast")
    with pytest.raises(ValueError, match="LIGHTNING_SLOTH_MOE_FUSED must be 1, 0 or auto, got 'fast'"):
        switch._from_environment()


@pytest.mark.skipif(INTERPRETED, reason="the reference path is enough")
def test_moe_fused_is_a_per_model_choice_through_transform_model(fused_switch, monkeypatch):
    """transform_model(moe="fused") (SlothStrategy(moe="fused"), sloth.moe=fused) turns the fused path
    on for that model's experts with the process-wide switch off, with the same loss and gradients;
    another model keeps the switch's choice; moe=True gives the choice back; moe="separate" keeps
    the separate passes with the switch on; a bad value is named."""
    from lightning_sloth.moe import experts as moe_experts
    from lightning_sloth.transform import transform_model

    calls = []
    real = moe_experts._fused_project
    monkeypatch.setattr(moe_experts, "_fused_project", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused_switch(False)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    plain = dict(packed_attention=False, gradient_checkpointing=False)

    def run(model):
        calls.clear()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model, other = _tiny("qwen3_moe", 1), _tiny("qwen3_moe", 1)
    loss_ref, grads_ref = run(model)
    assert not calls
    report = transform_model(model, moe="fused", **plain)
    assert report.experts.fused and "moe experts, permutation fused" in report.applied
    loss, grads = run(model)
    assert calls  # the fused ops ran, the switch still off
    assert abs(float(loss - loss_ref)) <= 1e-5 * abs(float(loss_ref))
    for name, want in grads_ref.items():
        assert float((grads[name] - want).norm() / want.norm().clamp_min(1e-30)) <= 1e-5, name
    run(other)
    assert not calls and not fused.fused_permutation_enabled()
    assert not transform_model(model, moe=True, **plain).experts.fused
    run(model)
    assert not calls
    fused_switch(True)  # moe="separate": this model keeps the separate passes with the switch on
    report = transform_model(model, moe="separate", **plain)
    assert not report.experts.fused and "moe experts, permutation separate" in report.applied
    loss, grads = run(model)
    assert not calls
    assert abs(float(loss - loss_ref)) <= 1e-5 * abs(float(loss_ref))
    run(other)
    assert calls  # another model follows the switch
    with pytest.raises(ValueError, match="moe must be true, false, 'fused' or 'separate', got 'yes'"):
        transform_model(model, moe="yes", **plain)


# ------------------------------------------------------------------------------ Triton kernels
@interpreted_only
@pytest.mark.parametrize(
    "top_k, transposed, rank, bias, weighted",
    [(1, False, 3, False, True), (2, True, 0, True, True), (4, True, 3, False, False)],
)
def test_kernels_interpreted_ops_match_float64_and_are_deterministic(top_k, transposed, rank, bias, weighted):
    case = _case(transposed, top_k, rank, bias, n_in=19, n_out=22)
    first, second, grads = _compare(case, torch.float32, 2e-5, 2e-5, weighted)
    t = _leaves(case, torch.float32)  # a second run: the same bits (no atomics, fixed sum orders)
    again = (_first(case, t, True), _second(case, t, True, weighted))
    grads_again = _grads(
        again, t, tuple(torch.linspace(s, -s, v.numel()).view_as(v) for s, v in zip((-1, 1), again))
    )
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    assert all(torch.equal(a, b) for a, b in zip(grads_again, grads, strict=True))


@interpreted_only
@pytest.mark.parametrize("rank", [3, 16])
def test_kernels_interpreted_lora_grad_pair_equals_the_two_products(rank):
    """g = grad B_e and dB = grad^T side from one pass over grad: float32 against float64, zero for
    idle experts, the same bits on a rerun."""
    from lightning_sloth.kernels import moe_lora_pair as kernels

    grouping, _ = _routing(11, 7, 3, 2, used=[1, 2, 4, 6])
    gen = torch.Generator().manual_seed(8)
    grad = torch.randn(33, 70, generator=gen)  # 70 columns: three 32-wide blocks, the last partial
    up = torch.randn(7, 70, rank, generator=gen)
    side = torch.randn(33, rank, generator=gen)
    g, d_up = kernels.lora_grad_pair(grad, up, side, grouping.ends)
    slices = list(_slices(grouping.ends))
    experts = [e for e, sl in enumerate(slices) for _ in range(sl.stop - sl.start)]
    want_g = torch.stack([grad.double()[s] @ up.double()[e] for s, e in enumerate(experts)])
    want_up = torch.stack([grad.double()[sl].t() @ side.double()[sl] for sl in slices])
    torch.testing.assert_close(g.double(), want_g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_up.double(), want_up, rtol=1e-5, atol=1e-5)
    assert not d_up[[0, 3, 5]].any()  # idle experts
    again = kernels.lora_grad_pair(grad, up, side, grouping.ends)
    assert torch.equal(again[0], g) and torch.equal(again[1], d_up)
    with pytest.raises(ValueError, match="lora_grad_pair"):
        kernels.lora_grad_pair(grad, up, side[:, :2], grouping.ends)


@interpreted_only
@pytest.mark.parametrize("pair", [True, False])
def test_kernels_interpreted_ops_with_the_rank_r_side_outside_the_gemm(pair, monkeypatch):
    """With the rank-r side in separate passes (wide outputs, as GPT-OSS's), the first op's backward
    makes g and dB in one pass (``LORA_GRAD_PAIR``) or two: both equal the float64 separate passes."""
    from lightning_sloth.moe import indexed

    monkeypatch.setattr(indexed, "DOWN_IN_KERNEL_MAX_RANK", 0)
    monkeypatch.setattr(indexed, "LORA_GRAD_PAIR", pair)
    for top_k, transposed, bias in ((2, False, True), (4, True, False)):
        _compare(_case(transposed, top_k, 3, bias, n_in=19, n_out=70), torch.float32, 2e-5, 2e-5)


@interpreted_only
def test_kernels_interpreted_a_layer_call_builds_its_tile_table_once_per_tiling(monkeypatch):
    from lightning_sloth.kernels import moe as moe_kernels

    requests, builds = [], []
    build, lookup = moe_kernels._build_tile_table, moe_kernels._tile_table

    def counted_build(ends, block_m, max_tiles):
        builds.append((block_m, max_tiles))
        return build(ends, block_m, max_tiles)

    def counted_lookup(ends, block_m, max_tiles):
        requests.append((block_m, max_tiles))
        return lookup(ends, block_m, max_tiles)

    monkeypatch.setattr(moe_kernels, "_build_tile_table", counted_build)
    monkeypatch.setattr(moe_kernels, "_tile_table", counted_lookup)
    import lightning_sloth.kernels.moe_fused as fused_kernels

    monkeypatch.setattr(fused_kernels, "_tile_table", counted_lookup)
    case = _case(True, 2, 3, True, n_in=19, n_out=22)
    t = _leaves(case, torch.float32)
    outs = (_first(case, t, True), _second(case, t, True, True))
    _grads(outs, t, tuple(torch.ones_like(o) for o in outs))
    assert len(requests) >= 4  # two GEMMs forward, two backward
    assert sorted(builds) == sorted(set(requests)) and len(builds) < len(requests)  # built once per tiling


@interpreted_only
def test_kernels_interpreted_inference_mode_gives_the_no_grad_result():
    case = _case(True, 2, 3, True)
    t = _leaves(case, torch.float32)
    with torch.no_grad():
        expected = (_first(case, t, True), _second(case, t, True, True))
    g = case["grouping"]
    index = torch.empty_like(g.expert_ids).index_put_((g.perm,), g.expert_ids).view(-1, case["top_k"])
    with torch.inference_mode():  # generation: the grouping's tensors are inference tensors
        inference = {**case, "grouping": group_by_expert(index.clone(), case["w"].shape[0])}
        got = (_first(inference, t, True), _second(inference, t, True, True))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _non_contiguous_equals_contiguous():
    case = _case(True, 2, 3, True)
    g = case["grouping"]
    kw = dict(transposed=True, bias=case["bias"].float(), expert_ids=g.expert_ids)
    lora = tuple(t.float() for t in case["lora"])
    x, a = case["x"].float(), case["a"].float()
    x_strided = torch.empty(x.shape[1], x.shape[0]).t().copy_(x)  # column-major rows
    a_strided = torch.empty(a.shape[0], 2 * a.shape[1])[:, ::2].copy_(a)  # every other column
    w = case["w"].float()
    w_strided = w.transpose(1, 2).contiguous().transpose(1, 2)
    for xx, aa, ww in ((x, a, w), (x_strided, a_strided, w_strided)):
        first = gather_lora_grouped_mm(xx, g.perm, 2, ww, *lora, 0.5, g.ends, **kw)
        second = lora_grouped_mm_combine(aa, case["weights"].float(), g.perm, 2, ww, *lora, 0.5, g.ends, **kw)
        if xx is x:
            expected = (first, second)
    torch.testing.assert_close(first, expected[0])
    torch.testing.assert_close(second, expected[1])


def test_non_contiguous_inputs_give_the_same_result():
    _non_contiguous_equals_contiguous()


@interpreted_only
def test_kernels_interpreted_non_contiguous_inputs_give_the_same_result():
    _non_contiguous_equals_contiguous()


@interpreted_only
def test_kernels_interpreted_indexed_weight_grad_and_slot_kernels():
    from lightning_sloth.kernels import moe_fused as kernels

    grouping, weights = _routing(7, 5, 3, 1, used=[0, 2, 3])
    flat = weights.reshape(-1).float()
    x = torch.randn(7, 13)
    grad = torch.randn(21, 9)
    got = kernels.grouped_mm_weight_grad(grad, x, grouping.ends, b_idx=grouping.perm, b_div=3)
    rows = x.double()[grouping.perm // 3]
    want = torch.stack([grad.double()[s].t() @ rows[s] for s in _slices(grouping.ends)])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got = kernels.grouped_mm_weight_grad(x, grad, grouping.ends, a_idx=grouping.perm, a_div=3, a_scale=flat)
    scaled = rows * flat.double()[grouping.perm, None]
    want = torch.stack([scaled[s].t() @ grad.double()[s] for s in _slices(grouping.ends)])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    src = torch.randn(21, 9)
    torch.testing.assert_close(
        kernels.slot_sum(src, 3, flat), (src.view(7, 3, 9) * weights.float()[..., None]).sum(1)
    )
    dout = torch.randn(7, 9)
    torch.testing.assert_close(kernels.slot_dot(dout, src, 3), (src.view(7, 3, 9) * dout[:, None]).sum(-1))


@interpreted_only
@pytest.mark.parametrize("group_m", [1, 2, 3, 8])
@pytest.mark.parametrize("n_in", [19, 64])  # 64: K a multiple of the K tile, loads without a K mask
def test_kernels_interpreted_program_order_and_even_k_give_the_same_bits(group_m, n_in, monkeypatch):
    """Any grouping of the M tiles in the program order, with or without the K mask, writes every row
    once with the same fixed-order sums: equal bits, and the float64 product."""
    from lightning_sloth.kernels import moe_fused as kernels

    grouping, weights = _routing(40, 6, 2, 5)
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(40, n_in, generator=gen), torch.randn(6, n_in, 70, generator=gen)
    rows = dict(a_idx=grouping.perm, div=2, scale=weights.reshape(-1).float())
    monkeypatch.setattr(kernels, "_tiles", lambda *a, **k: (16, 32, 32, 4, 2))  # 10+ M tiles, 3 N tiles
    monkeypatch.setattr(kernels, "GROUP_M", 1)
    want = kernels.grouped_mm(x, w, grouping.ends, True, covered=True, **rows)
    monkeypatch.setattr(kernels, "GROUP_M", group_m)
    got = kernels.grouped_mm(x, w, grouping.ends, True, covered=True, **rows)
    assert torch.equal(got, want)
    full = torch.empty(80, 70, dtype=torch.float64)
    rows64 = x.double()[grouping.perm // 2] * weights.reshape(-1).double()[grouping.perm, None]
    for e, s in enumerate(_slices(grouping.ends)):
        full[s] = rows64[s] @ w.double()[e]
    torch.testing.assert_close(got.double(), full, rtol=1e-5, atol=1e-4)


@interpreted_only
def test_one_pass_side_only_for_narrow_outputs():
    """The in-kernel rank-r side is recomputed by every N tile: wide outputs take the separate pass."""
    from lightning_sloth.moe import indexed

    x = torch.randn(4, 8)
    assert indexed.down_in_kernel(x, 16, indexed.DOWN_IN_KERNEL_MAX_OUT)
    assert not indexed.down_in_kernel(x, 16, indexed.DOWN_IN_KERNEL_MAX_OUT + 1)
    assert not indexed.down_in_kernel(x, indexed.DOWN_IN_KERNEL_MAX_RANK + 1, 64)
    assert not indexed.down_in_kernel(x, 0, 64)


@interpreted_only
@pytest.mark.parametrize("rank, down_is_kn", [(3, False), (17, True)])
@pytest.mark.parametrize("keep_scaled", [False, True])
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("n_in", [21, 32])
def test_kernels_interpreted_lora_down_in_the_same_pass_equals_the_separate_passes(
    rank, down_is_kn, keep_scaled, indexed, n_in
):
    """grouped_mm(down=...) computes the rank-r side from the rows it reads, with the separate passes'
    roundings (float16 here: x @ D to x's dtype, times the scale, again), and writes the side once."""
    from lightning_sloth.kernels import moe_fused as kernels

    top_k, n_out = 3, 37
    grouping, weights = _routing(7, 5, top_k, 2, used=[0, 2, 3])  # experts 1 and 4 without rows
    gen = torch.Generator().manual_seed(3)
    half = torch.float16
    x = torch.randn(7 if indexed else 21, n_in, generator=gen).to(half)
    w = torch.randn(5, n_out, n_in, generator=gen).to(half)
    down = torch.randn(*((5, n_in, rank) if down_is_kn else (5, rank, n_in)), generator=gen).to(half)
    up = torch.randn(5, n_out, rank, generator=gen).to(half) * 0.5
    rows = dict(a_idx=grouping.perm, div=top_k, scale=weights.reshape(-1).float()) if indexed else {}
    where = {} if indexed else dict(out_idx=grouping.perm)
    side = kernels.grouped_mm(x, down, grouping.ends, down_is_kn, covered=True, **rows)
    x2 = side * 0.25
    want = kernels.grouped_mm(x, w, grouping.ends, False, x2=x2, w2=up, covered=True, **rows, **where)
    got_side = torch.full_like(side, float("nan"))
    got = kernels.grouped_mm(
        x, w, grouping.ends, False, w2=up, covered=True, down=down, down_is_kn=down_is_kn,
        lora_scale=0.25, r_out=got_side, keep_scaled=keep_scaled, **rows, **where,
    )  # fmt: skip
    torch.testing.assert_close(got_side, x2 if keep_scaled else side, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    # and against float64: rows through the permutation, the side rounded as the passes round it
    rows64 = x.double()[grouping.perm // top_k] if indexed else x.double()
    row_scale = weights.reshape(-1).double()[grouping.perm, None] if indexed else 1.0
    d64 = down.double() if down_is_kn else down.double().transpose(1, 2)
    full = torch.empty(21, n_out, dtype=torch.float64)
    for e, s in enumerate(_slices(grouping.ends)):
        side64 = (rows64[s] @ d64[e]) * (row_scale[s] if indexed else 1.0)
        full[s] = (rows64[s] @ w.double()[e].t()) * (row_scale[s] if indexed else 1.0)
        full[s] += ((side64.to(half).double() * 0.25).to(half).double()) @ up.double()[e].t()
    expected = full if indexed else torch.empty_like(full).index_copy_(0, grouping.perm, full)
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=2e-2)


@interpreted_only
def test_kernels_interpreted_one_pass_that_does_not_fit_falls_back_with_a_warning(monkeypatch):
    from lightning_sloth.kernels import moe_fused as kernels

    from lightning_sloth.moe import indexed

    grouping, weights = _routing(7, 5, 3, 2)
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 21, generator=gen), torch.randn(5, 37, 21, generator=gen)
    down, up = torch.randn(5, 3, 21, generator=gen), torch.randn(5, 37, 3, generator=gen)
    kw = dict(down=down, down_is_kn=False, up=up, up_is_kn=False, lora_scale=0.5, keep_scaled=False)
    rows = dict(a_idx=grouping.perm, div=3, scale=weights.reshape(-1).float())
    want = indexed.indexed_lora_grouped_mm(x, w, grouping.ends, False, **rows, **kw)
    real = kernels.grouped_mm

    def too_big(*args, **kwargs):
        if kwargs.get("down") is not None:
            raise kernels.OutOfResources(240_000, 232_448, "shared memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "grouped_mm", too_big)
    monkeypatch.setattr(indexed, "DOWN_IN_KERNEL_MAX_RANK", indexed.DOWN_IN_KERNEL_MAX_RANK)
    with pytest.warns(RuntimeWarning, match="does not fit this device"):
        got = indexed.indexed_lora_grouped_mm(x, w, grouping.ends, False, **rows, **kw)
    assert indexed.DOWN_IN_KERNEL_MAX_RANK == 0 and not indexed.down_in_kernel(x, 3, 37)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pipeline_stages_are_what_the_shared_memory_holds(monkeypatch):
    """The built-in tiles keep their stages where they fit (Hopper's 227 KiB, also with a rank-16
    down factor's tile), fewer on Ampere's 163 KiB with a wide side; 32-deep K tiles in 5 stages up
    to 2,048 inputs, 64-deep in 4 above; small tiles off CUDA."""
    pytest.importorskip("triton")
    from lightning_sloth.kernels import moe_fused as kernels

    cuda = torch.device("cuda")
    for optin, stages in ((232_448, 4), (166_912, 3)):
        monkeypatch.setattr(kernels, "_shared_memory", lambda device, optin=optin: optin)
        assert kernels._tiles(cuda, torch.bfloat16, 2880, 2880) == (128, 256, 64, 8, stages)
        assert kernels._tiles(cuda, torch.bfloat16, 2880, 2880, side=16)[4] == stages
        assert kernels._tiles(cuda, torch.bfloat16, 2048, 768) == (128, 256, 32, 8, 5)  # 5 x 24 KiB
        assert kernels._tiles(cuda, torch.bfloat16, 1536, 2048, side=16) == (128, 256, 32, 8, 5)
    assert kernels._tiles(cuda, torch.bfloat16, 2880, 2880, side=32)[4] == 2  # 3 x 52 KiB > 155 KiB
    assert kernels._tiles(cuda, torch.bfloat16, 16, 2048) == (128, 16, 32, 8, 5)  # rank-r output
    assert kernels._tiles(cuda, torch.bfloat16, 16, 2880) == (128, 16, 64, 8, 4)
    assert kernels._tiles(torch.device("cpu"), torch.float32, 2048, 768) == (64, 64, 32, 4, 2)


def test_tiles_by_depth_take_only_the_shallow_gemms(monkeypatch):
    """``TILES_BY_DEPTH``: the first pair whose depth covers the GEMM's inputs; deeper GEMMs keep the
    built-in tiles, ``TILES`` overrides both, and nothing changes off CUDA."""
    pytest.importorskip("triton")
    from lightning_sloth.kernels import moe_fused as kernels

    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "_shared_memory", lambda device: 232_448)
    monkeypatch.setattr(kernels, "TILES_BY_DEPTH", ((768, (128, 128, 32, 8, 4)), (2048, (64, 256, 32, 4, 3))))
    assert kernels._tiles(cuda, torch.bfloat16, 2048, 768) == (128, 128, 32, 8, 4)  # Qwen3's second GEMM
    assert kernels._tiles(cuda, torch.bfloat16, 768, 2048) == (64, 256, 32, 4, 3)
    assert kernels._tiles(cuda, torch.bfloat16, 2880, 2880) == (128, 256, 64, 8, 4)  # built-in
    assert kernels._tiles(torch.device("cpu"), torch.float32, 2048, 768) == (64, 64, 32, 4, 2)
    monkeypatch.setattr(kernels, "TILES", (128, 64, 64, 4, 3))
    assert kernels._tiles(cuda, torch.bfloat16, 2048, 768) == (128, 64, 64, 4, 3)


@interpreted_only
def test_kernels_interpreted_lora_down_rank_is_checked():
    from lightning_sloth.kernels import moe_fused as kernels

    grouping, _ = _routing(4, 2, 1, 0)
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match="rank 65 must be 1..64"):
        kernels.grouped_mm(
            x, w, grouping.ends, False, w2=torch.randn(2, 8, 65), down=torch.randn(2, 65, 8),
            r_out=torch.empty(4, 65),
        )  # fmt: skip


def _slices(ends):
    start = 0
    for end in ends.tolist():
        yield slice(start, end)
        start = end


@interpreted_only
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_kernels_interpreted_tiny_model_equals_the_current_experts_path(family, fused_switch):
    _model_parity(family, fused_switch, layers=1)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )


def test_grouped_mm_choice_from_the_environment():
    """LIGHTNING_SLOTH_MOE_GROUPED_MM sets both flags at import; a wrong name is an error naming it."""
    import os
    import sys

    code = "from lightning_sloth.moe import indexed as i; print(i.ORDERED_ROWS_GROUPED_MM, i.GATHERED_ROWS_GROUPED_MM)"
    for name, want in (("both", "True True"), ("gathered", "False True"), ("", "False False")):
        env = {**os.environ, "LIGHTNING_SLOTH_MOE_GROUPED_MM": name}
        done = _processes.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and done.stdout.split()[-2:] == want.split(), done.stderr[-2000:]
    env = {**os.environ, "LIGHTNING_SLOTH_MOE_GROUPED_MM": "all"}
    done = _processes.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "LIGHTNING_SLOTH_MOE_GROUPED_MM / --grouped-mm takes" in done.stderr
