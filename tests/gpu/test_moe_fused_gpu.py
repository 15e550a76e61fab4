"""GPU checks of the fused-permutation MoE path (``lightning_sloth.moe.fused``): bf16 parity of both ops
with a float64 reference (Hopper-sized tiles, odd sizes, idle experts, top_k 1/2/8), the bits of two runs,
the experts of Qwen3-MoE and GPT-OSS with LoRA (dense and NF4) against the current path, opcheck on
the ``triton_op`` path, both ops under ``torch.compile(fullgraph=True)``, and no host sync in a
training step; each also with every expert GEMM through
``torch._grouped_mm`` (``ORDERED_ROWS_GROUPED_MM``, ``GATHERED_ROWS_GROUPED_MM``), and with the Triton
GEMMs' weight tiles through TMA descriptors, with and without warp specialisation (``WEIGHT_LOADS``).

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_moe_fused_gpu.py`` (under a minute).
"""

import pytest
import torch
from _moe_blocks import assert_no_host_sync_in_a_training_step, block_step, lora_block

from lightning_sloth.moe import group_by_expert, moe_combine, moe_gather
from lightning_sloth.moe.fused import (
    fused_permutation_setting,
    gather_lora_grouped_mm,
    lora_grouped_mm_combine,
    set_fused_permutation,
)
from lightning_sloth.moe.gemm import lora_grouped_mm
from lightning_sloth.moe.quant import quantize_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(
    params=[(False, "pointer"), (True, "pointer"), (False, "tma"), (False, "tma_ws"), (False, "tma_rows")],
    ids=[
        "triton-gemms",
        "grouped-mm-gemms",
        "triton-gemms-tma",
        "triton-gemms-tma-ws",
        "triton-gemms-tma-rows",
    ],
)
def ordered(request, monkeypatch):
    """The ways of the expert GEMMs: the Triton kernels reading and writing through the permutation
    (their weight tiles through pointers, a TMA descriptor, or a descriptor in a warp-specialised K
    loop, or weights and the rows already in expert order through descriptors:
    ``kernels.moe_fused.WEIGHT_LOADS``), and torch._grouped_mm for all four (bf16 on Hopper):
    the rows in expert order summed through the inverse permutation (ORDERED_ROWS_GROUPED_MM), the
    gathered copies (GATHERED_ROWS_GROUPED_MM)."""
    from lightning_sloth.kernels import moe_fused as kernels

    from lightning_sloth.moe import indexed

    grouped, loads = request.param
    monkeypatch.setattr(indexed, "ORDERED_ROWS_GROUPED_MM", grouped)
    monkeypatch.setattr(indexed, "GATHERED_ROWS_GROUPED_MM", grouped)
    monkeypatch.setattr(kernels, "WEIGHT_LOADS", loads)
    return request.param


@pytest.fixture
def switch():
    before = fused_permutation_setting()
    yield set_fused_permutation
    set_fused_permutation(before)


def _inputs(dtype, transposed, top_k, tokens=777, experts=16, n_in=200, n_out=328, rank=16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e % 5], device="cuda")  # experts 0, 5, 10, 15 idle
    scores = torch.rand(tokens, len(pool), device="cuda", generator=gen)
    index = pool[scores.topk(top_k, dim=-1).indices]
    grouping = group_by_expert(index, experts)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64) * scale).to(dtype)

    w_shape = (experts, n_in, n_out) if transposed else (experts, n_out, n_in)
    return dict(
        grouping=grouping,
        weights=torch.rand(tokens, top_k, device="cuda", generator=gen, dtype=torch.float64).to(dtype),
        x=rnd(tokens, n_in),
        a=rnd(tokens * top_k, n_in),
        w=rnd(*w_shape, scale=n_in**-0.5),
        lora_a=rnd(experts, rank, n_in, scale=n_in**-0.5),
        lora_b=rnd(experts, n_out, rank, scale=0.1),
        bias=rnd(experts, n_out),
        top_k=top_k,
        transposed=transposed,
    )


def _run(case, dtype, fused):
    g, k = case["grouping"], case["top_k"]
    t = {
        n: case[n].to(dtype).requires_grad_() for n in ("x", "a", "w", "lora_a", "lora_b", "bias", "weights")
    }
    kw = dict(transposed=case["transposed"], bias=t["bias"], expert_ids=g.expert_ids)
    lora = (t["lora_a"], t["lora_b"], 0.5, g.ends)
    if fused:
        first = gather_lora_grouped_mm(t["x"], g.perm, k, t["w"], *lora, **kw)
        second = lora_grouped_mm_combine(t["a"], t["weights"], g.perm, k, t["w"], *lora, **kw)
    else:
        first = lora_grouped_mm(moe_gather(t["x"], g.perm, g.inv, k), t["w"], *lora, **kw)
        second = moe_combine(lora_grouped_mm(t["a"], t["w"], *lora, **kw), t["weights"], g.perm, g.inv)
    gen = torch.Generator(device="cuda").manual_seed(7)
    grads = (
        torch.randn(first.shape, device="cuda", generator=gen),
        torch.randn(second.shape, device="cuda", generator=gen),
    )
    leaves = list(t.values())
    got = torch.autograd.grad((first, second), leaves, tuple(g.to(dtype) for g in grads))
    return [first.detach(), second.detach(), *got]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_ops_match_float64_and_repeat_bit_for_bit(dtype, transposed, top_k, ordered):
    case = _inputs(dtype, transposed, top_k)
    reference = _run(case, torch.float64, fused=False)
    ours = _run(case, dtype, fused=True)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        assert _rel(got, want) < tolerance, i
    again = _run(case, dtype, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(again, ours, strict=True))


def test_opcheck_triton_op_path():
    case = _inputs(torch.bfloat16, False, 2, tokens=64, experts=4, n_in=64, n_out=96, rank=8)
    g = case["grouping"]
    args = (case["lora_a"], case["lora_b"], 0.5, g.ends, g.expert_ids, False)
    x, a, w = (case[n].requires_grad_() for n in ("x", "a", "w"))
    torch.library.opcheck(
        torch.ops.sloth.moe_gather_lora_grouped_mm.default,
        (x, g.perm, 2, w, None, None, 0, list(w.shape), None, *args),
    )
    torch.library.opcheck(
        torch.ops.sloth.moe_lora_grouped_mm_combine.default,
        (a, case["weights"].requires_grad_(), g.perm, 2, w, None, None, 0, list(w.shape), None, *args),
    )


@pytest.mark.parametrize("rank", [8, 16])
def test_lora_grad_pair_matches_float64_and_repeats(rank):
    """g = grad B_e and dB = grad^T side from one pass over a GPT-OSS-wide gradient (2,880 columns:
    a partial last column block), bf16 against float64, zero for idle experts, the same bits twice."""
    from lightning_sloth.kernels import moe_lora_pair as kernels

    case = _inputs(torch.bfloat16, False, 4, tokens=700, experts=16, n_in=64, n_out=2880, rank=rank)
    g = case["grouping"]
    rows = g.perm.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(5)
    grad = torch.randn(rows, 2880, device="cuda", generator=gen).to(torch.bfloat16)
    side = torch.randn(rows, rank, device="cuda", generator=gen).to(torch.bfloat16)
    up = case["lora_b"]
    got_g, got_up = kernels.lora_grad_pair(grad, up, side, g.ends)
    ends = [0, *g.ends.tolist()]
    want_g = torch.cat([grad[a:b].double() @ up[e].double() for e, (a, b) in enumerate(zip(ends, ends[1:]))])
    want_up = torch.stack([grad[a:b].double().t() @ side[a:b].double() for a, b in zip(ends, ends[1:])])
    assert _rel(got_g, want_g) < 1e-2 and _rel(got_up, want_up) < 1e-2
    assert not got_up[[0, 5, 10, 15]].any()  # idle experts
    again = kernels.lora_grad_pair(grad, up, side, g.ends)
    assert torch.equal(again[0], got_g) and torch.equal(again[1], got_up)


@pytest.mark.parametrize("transposed", [False, True])
def test_ops_with_the_rank_r_side_outside_the_gemm_match_float64(transposed, ordered, monkeypatch):
    """Outputs wider than DOWN_IN_KERNEL_MAX_OUT (GPT-OSS's) make the rank-r side in separate passes;
    the first op's backward then takes g and dB from one pass over its gradient (LORA_GRAD_PAIR)."""
    from lightning_sloth.moe import indexed

    monkeypatch.setattr(indexed, "DOWN_IN_KERNEL_MAX_RANK", 0)
    case = _inputs(torch.bfloat16, transposed, 2)
    reference = _run(case, torch.float64, fused=False)
    ours = _run(case, torch.bfloat16, fused=True)
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        assert _rel(got, want) < 2e-2, i
    again = _run(case, torch.bfloat16, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(again, ours, strict=True))


@pytest.mark.parametrize("side_outside", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_both_ops_compile_in_one_graph_and_give_the_eager_values(
    transposed, side_outside, ordered, monkeypatch
):
    """``torch.compile(fullgraph=True)`` (inductor) traces both ops' Triton decompositions with every
    GEMM way, TMA descriptors included (their alignment check on traced tensors), with the rank-r side
    inside the GEMMs and outside them (wide outputs: the LoRA gradient pair's kernel), and the
    compiled forward and backward give the eager op's values and gradients."""
    from lightning_sloth.moe import indexed

    if side_outside:
        monkeypatch.setattr(indexed, "DOWN_IN_KERNEL_MAX_RANK", 0)
    case = _inputs(torch.bfloat16, transposed, 2, tokens=300, experts=8, n_in=128, n_out=192, rank=8)
    g, k = case["grouping"], case["top_k"]
    names = ("x", "a", "w", "lora_a", "lora_b", "bias", "weights")

    def step(x, a, w, lora_a, lora_b, bias, weights):
        kw = dict(transposed=transposed, bias=bias, expert_ids=g.expert_ids)
        lora = (lora_a, lora_b, 0.5, g.ends)
        first = gather_lora_grouped_mm(x, g.perm, k, w, *lora, **kw)
        second = lora_grouped_mm_combine(a, weights, g.perm, k, w, *lora, **kw)
        return first, second

    compiled = torch.compile(step, fullgraph=True)
    runs = []
    for fn in (step, compiled):
        leaves = [case[n].clone().requires_grad_() for n in names]
        outs = fn(*leaves)
        gen = torch.Generator(device="cuda").manual_seed(7)
        grads = tuple(torch.randn(o.shape, device="cuda", generator=gen, dtype=o.dtype) for o in outs)
        runs.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads)))
    for i, (got, want) in enumerate(zip(runs[1], runs[0], strict=True)):
        assert _rel(got, want) < 1e-2, ([*("first", "second"), *names][i], _rel(got, want))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("nf4", [False, True])
def test_moe_block_with_expert_lora_equals_the_current_path(family, nf4, switch, ordered):
    block = lora_block(family)
    if nf4:
        quantize_experts(block.experts.get_base_layer(), "nf4")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 1000, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(1, 1000, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    switch(False)
    reference, names = block_step(block, x, grad)
    switch(True)
    ours, names_fused = block_step(block, x, grad)
    again, _ = block_step(block, x, grad)
    assert names_fused == names and any("lora" in n for n in names)
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        assert _rel(got, want) < 1e-2, ([None, "x", *names][i], _rel(got, want))
    assert all(torch.equal(a, b) for a, b in zip(again, ours, strict=True))


@pytest.mark.parametrize("router", ["transformers", "sloth"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_block_step_captures_as_one_cuda_graph_and_replays_like_eager(family, router, switch, ordered):
    """A whole forward + backward of the block (router, grouping, every expert GEMM, LoRA gradients)
    captured once in a CUDA graph; replays on new inputs copied into the captured buffers give the
    eager step's output, input gradient and LoRA gradients, bit for bit (the ops are deterministic)."""
    from lightning_sloth.patching import install_router

    switch(True)
    block = lora_block(family)
    if router == "sloth":
        experts = block.experts.get_base_layer()
        install_router(
            getattr(block, "router", None) or block.gate, experts.config.model_type, experts.config
        )
    gen = torch.Generator(device="cuda").manual_seed(3)

    def fresh():
        x = torch.randn(1, 700, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
        return x, torch.randn(1, 700, 256, device="cuda", generator=gen, dtype=torch.bfloat16)

    static_x = torch.zeros(1, 700, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_grad = torch.zeros(1, 700, 256, device="cuda", dtype=torch.bfloat16)
    x0, g0 = fresh()
    with torch.no_grad():
        static_x.copy_(x0)
        static_grad.copy_(g0)
    params = [p for p in block.parameters() if p.requires_grad]

    def step():
        out = block(static_x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(static_grad)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, allocator settled
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x, g = fresh()
        with torch.no_grad():
            static_x.copy_(x)
            static_grad.copy_(g)
        graph.replay()
        got = [out.detach().clone(), static_x.grad.clone(), *(p.grad.clone() for p in params)]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        want, names = block_step(block, x, g)
        for p, grad in zip(params, saved):
            p.grad = grad
        assert any("lora" in n for n in names) and len(want) == len(got)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), ([None, "x", *names][i], _rel(a, b))


def test_no_host_sync_in_a_training_step(switch, ordered):
    switch(True)
    x = torch.randn(1, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_no_host_sync_in_a_training_step(lora_block("qwen3_moe"), x)


def test_the_default_is_the_fused_path_on_cuda_and_a_model_can_keep_the_separate_passes(switch):
    """With the switch unset ("auto") a CUDA block dispatches the fused ops, forward and backward;
    the model's own ``moe="separate"`` keeps the separate gather and combine passes; both give the
    same output and gradients (bf16)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_sloth.moe.fused import FUSED_ATTR

    class OpNames(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    switch(None)
    block = lora_block("qwen3_moe")
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 600, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(1, 600, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    runs = {}
    for choice in (None, False):  # None: the default; False: what moe="separate" sets on the experts
        experts = block.experts.get_base_layer()
        if choice is None and hasattr(experts, FUSED_ATTR):
            delattr(experts, FUSED_ATTR)
        elif choice is not None:
            setattr(experts, FUSED_ATTR, choice)
        mode = OpNames()
        mode.names = []
        with mode:
            runs[choice] = block_step(block, x, grad)[0]
        fused_ops = [n for n in mode.names if "moe_gather_lora_grouped_mm" in n]
        assert bool(fused_ops) == (choice is None), (choice, sorted(set(mode.names))[:20])
    for got, want in zip(runs[None], runs[False], strict=True):
        assert _rel(got, want) < 1e-2
