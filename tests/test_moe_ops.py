"""sloth::moe_* ops: grouping, float64 agreement, opcheck, FLOPs, and the Triton kernels under the interpreter.

The Triton kernels run on CPU under the Triton interpreter. ``TRITON_INTERPRET`` must be set before
triton is imported, so ``test_kernels_under_triton_interpreter`` reruns this file's ``interpreted``
cases in a fresh process with it set (they skip in the normal run).
"""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.moe import clamped_swiglu, group_by_expert, grouped_mm, moe_combine, moe_gather
from lightning_sloth.moe import gemm as moe_gemm
from lightning_sloth.moe import ops as moe_ops
from lightning_sloth.moe.gemm import grouped_mm_reference, lora_grouped_mm
from lightning_sloth.moe.ops import clamped_swiglu_reference, moe_sum, weighted_swiglu

# Uneven groups: an empty expert first, one in the middle, one at the end, a single row.
COUNTS = [0, 5, 70, 0, 1, 37, 0]


def _ends(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _routing(tokens=11, experts=6, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    return index, weights


# ----------------------------------------------------------------------------------- grouping
def test_grouping_sorts_stably_and_inverts():
    index, _ = _routing(tokens=9, experts=5, top_k=3)
    g = group_by_expert(index, 5)
    flat = index.reshape(-1)
    assert torch.equal(flat[g.perm], g.expert_ids)
    assert torch.equal(g.inv[g.perm], torch.arange(flat.numel()))
    assert g.ends.dtype == torch.int32 and g.counts.dtype == torch.int32
    assert torch.equal(g.counts.long(), torch.bincount(flat, minlength=5))
    assert int(g.ends[-1]) == flat.numel()
    for e in range(5):  # stable: slots of one expert keep their token order
        slots = g.perm[g.expert_ids == e]
        assert torch.equal(slots, slots.sort().values)


def test_grouping_edge_cases_all_to_one_expert_and_unused_experts():
    index = torch.full((4, 1), 2)
    g = group_by_expert(index, 5)
    assert g.counts.tolist() == [0, 0, 4, 0, 0] and g.ends.tolist() == [0, 0, 4, 4, 4]
    g = group_by_expert(torch.zeros(0, 2, dtype=torch.int64), 3)
    assert g.ends.tolist() == [0, 0, 0] and g.perm.numel() == 0


# -------------------------------------------------------------------------------- float64 checks
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_matches_float64_with_uneven_and_empty_groups(transposed):
    ends = _ends(COUNTS)
    rows, experts, k, n = int(ends[-1]), len(COUNTS), 19, 23
    x = torch.randn(rows, k, dtype=torch.float64, requires_grad=True)
    w = torch.randn(
        (experts, k, n) if transposed else (experts, n, k), dtype=torch.float64, requires_grad=True
    )
    bias = torch.randn(experts, n, dtype=torch.float64, requires_grad=True)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(COUNTS))
    out = grouped_mm(x, w, ends, transposed=transposed, bias=bias, expert_ids=ids)
    we = w if transposed else w.transpose(1, 2)
    expected = torch.einsum("sk,skn->sn", x, we[ids]) + bias[ids]
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, bias), grad)
    want = torch.autograd.grad(expected, (x, w, bias), grad)
    torch.testing.assert_close(got, want)
    assert got[1][torch.tensor(COUNTS) == 0].abs().max() == 0  # empty experts get a zero gradient


def test_gather_and_combine_match_float64_with_router_gradient():
    index, weights = _routing(tokens=13, experts=6, top_k=3)
    g = group_by_expert(index, 6)
    x = torch.randn(13, 17, dtype=torch.float64, requires_grad=True)
    weights.requires_grad_()
    xg = moe_gather(x, g.perm, g.inv, 3)
    torch.testing.assert_close(xg, x[g.perm // 3])
    y = xg * 2.5 + 1.0
    out = moe_combine(y, weights, g.perm, g.inv)
    expected = (weights[..., None] * (x * 2.5 + 1.0)[:, None, :]).sum(1)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, weights), grad)
    want = torch.autograd.grad(expected, (x, weights), grad)
    torch.testing.assert_close(got, want)


def test_weighted_swiglu_and_sum_equal_swiglu_then_weighted_combine():
    index, weights = _routing(tokens=10, experts=5, top_k=2)
    g = group_by_expert(index, 5)
    h = torch.randn(20, 2 * 13, dtype=torch.float64, requires_grad=True)
    weights.requires_grad_()
    out = moe_sum(weighted_swiglu(h, weights, g.perm) * 1.5, g.perm, g.inv, 2)
    gate, up = h.chunk(2, dim=-1)
    expected = moe_combine(torch.nn.functional.silu(gate) * up * 1.5, weights, g.perm, g.inv)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad(out, (h, weights), grad), torch.autograd.grad(expected, (h, weights), grad)
    )


@pytest.mark.parametrize("transposed", [False, True])
def test_lora_grouped_mm_equals_the_merged_weight(transposed):
    ends = _ends(COUNTS)
    rows, experts, n_in, n_out, rank = int(ends[-1]), len(COUNTS), 19, 23, 4
    x = torch.randn(rows, n_in, dtype=torch.float64, requires_grad=True)
    w = torch.randn((experts, n_in, n_out) if transposed else (experts, n_out, n_in), dtype=torch.float64)
    a = torch.randn(experts, rank, n_in, dtype=torch.float64, requires_grad=True)
    b = torch.randn(experts, n_out, rank, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(experts, n_out, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(COUNTS))
    out = lora_grouped_mm(x, w, a, b, 0.5, ends, transposed=transposed, bias=bias, expert_ids=ids)
    delta = 0.5 * b @ a  # [E, out, in]
    merged = w + (delta.transpose(1, 2) if transposed else delta)
    expected = grouped_mm(x, merged, ends, transposed=transposed, bias=bias, expert_ids=ids)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad(out, (x, a, b), grad), torch.autograd.grad(expected, (x, a, b), grad)
    )


def test_clamped_swiglu_matches_transformers_expression_and_gradients():
    h = (6 * torch.randn(29, 2 * 21, dtype=torch.float64)).requires_grad_()  # values on both sides of +-7
    out = clamped_swiglu(h, 1.702, 7.0)
    expected = clamped_swiglu_reference(h, 1.702, 7.0)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, h, grad), torch.autograd.grad(expected, h, grad))


def test_bad_input_is_named():
    ends = _ends([2, 1])
    with pytest.raises(ValueError, match="does not fit weight"):
        grouped_mm(torch.randn(3, 4), torch.randn(2, 5, 6), ends)
    with pytest.raises(TypeError, match="float64"):
        grouped_mm(torch.randn(3, 4), torch.randn(2, 5, 4, dtype=torch.float64), ends)
    with pytest.raises(ValueError, match="interleaved"):
        clamped_swiglu(torch.randn(3, 5), 1.7, 7.0)


# ------------------------------------------------------------------------------ opcheck / FLOPs
def _opcheck(op, args):
    torch.library.opcheck(op, args)


def test_opcheck_every_op():
    index, weights = _routing(tokens=7, experts=4, top_k=2)
    g = group_by_expert(index, 4)
    ends, ids = g.ends, g.expert_ids
    x = torch.randn(7, 12)
    xg = torch.randn(14, 12, requires_grad=True)
    w = torch.randn(4, 10, 12, requires_grad=True)
    wt = torch.randn(4, 12, 10, requires_grad=True)
    b = torch.randn(4, 10, requires_grad=True)
    y = torch.randn(14, 12, requires_grad=True)
    wts = weights.float().requires_grad_()
    h = (6 * torch.randn(14, 8)).requires_grad_()
    _opcheck(moe_gemm._grouped_mm_op, (xg, w, None, ends, ids, False))
    _opcheck(moe_gemm._grouped_mm_op, (xg, wt, b, ends, ids, True))
    _opcheck(
        moe_gemm._grouped_mm_backward_op,
        (torch.randn(14, 10), xg.detach(), w.detach(), ends, False, True, True),
    )
    _opcheck(moe_ops._gather_op, (x.requires_grad_(), g.perm, g.inv, 2))
    _opcheck(moe_ops._gather_sum_op, (torch.randn(14, 12, requires_grad=True), g.perm, g.inv, 2))
    _opcheck(moe_ops._weighted_swiglu_op, (torch.randn(14, 10, requires_grad=True), wts, g.perm))
    _opcheck(
        moe_ops._weighted_swiglu_backward_op, (torch.randn(14, 5), torch.randn(14, 10), wts.detach(), g.perm)
    )
    la = torch.randn(4, 3, 12, requires_grad=True)
    lb = torch.randn(4, 10, 3, requires_grad=True)
    _opcheck(moe_gemm._lora_grouped_mm_op, (xg, w.detach(), None, la, lb, 0.5, ends, ids, False))
    _opcheck(moe_gemm._lora_grouped_mm_op, (xg, wt.detach(), b, la, lb, 0.5, ends, ids, True))
    _opcheck(
        moe_gemm._lora_grouped_mm_backward_op,
        (torch.randn(14, 10), xg.detach(), torch.randn(14, 3), w.detach(), la.detach(), lb.detach(), 0.5, ends,
         False, True, False, True, True),
    )  # fmt: skip
    _opcheck(moe_ops._combine_op, (y, wts, g.perm, g.inv))
    _opcheck(
        moe_ops._combine_backward_op,
        (torch.randn(7, 12), y.detach(), wts.detach(), g.perm, g.inv, True, True),
    )
    _opcheck(moe_ops._clamped_swiglu_op, (h, 1.702, 7.0))
    _opcheck(moe_ops._clamped_swiglu_backward_op, (torch.randn(14, 4), h.detach(), 1.702, 7.0))


def test_flops_are_counted():
    ends = _ends([3, 0, 5])
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(3, 24, 16)
    with FlopCounterMode(display=False) as counter:
        grouped_mm(x, w, ends).backward(torch.randn(8, 24))
    assert counter.get_total_flops() == 2 * (2 * 8 * 24 * 16)  # forward + input gradient


# ------------------------------------------------------------------------------ Triton kernels
@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("w_is_kn", [False, True])
def test_kernels_interpreted_grouped_mm(dtype, w_is_kn):
    from lightning_sloth.kernels import moe as kernels

    ends = _ends(COUNTS)
    rows, experts, k, n = int(ends[-1]), len(COUNTS), 45, 70
    x = torch.randn(rows, k).to(dtype)
    w = torch.randn((experts, k, n) if w_is_kn else (experts, n, k)).to(dtype)
    out = kernels.grouped_mm(x, w, ends, w_is_kn)
    expected = grouped_mm_reference(x.double(), w.double(), ends, transposed=w_is_kn)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    dy = torch.randn(rows, n).to(dtype)
    a, b = (x, dy) if w_is_kn else (dy, x)
    dw = kernels.grouped_mm_weight_grad(a, b, ends)
    expected_dw = moe_gemm._weight_grad_reference(a.double(), b.double(), ends)
    torch.testing.assert_close(dw.double(), expected_dw, rtol=tol, atol=tol * 10)
    # accumulate a rank-16 product into an existing output
    xa = torch.randn(rows, 16).to(dtype)
    wb = torch.randn(experts, n, 16).to(dtype)
    base = torch.randn(rows, n).to(dtype)
    acc = kernels.grouped_mm(xa, wb, ends, False, out=base.clone())
    expected_acc = base.double() + grouped_mm_reference(xa.double(), wb.double(), ends, transposed=False)
    torch.testing.assert_close(acc.double(), expected_acc, rtol=tol, atol=tol * 10)
    # and with a per-expert bias in the same pass (one rounding)
    bias = torch.randn(experts, n).to(dtype)
    acc = kernels.grouped_mm(xa, wb, ends, False, out=base.clone(), bias=bias)
    expert_of_row = torch.repeat_interleave(torch.arange(experts), torch.tensor(COUNTS))
    expected_acc = expected_acc + bias.double()[expert_of_row]
    torch.testing.assert_close(acc.double(), expected_acc, rtol=tol, atol=tol * 10)


@interpreted_only
@pytest.mark.parametrize("experts", [1, 5, 16, 40, 512])
@pytest.mark.parametrize("block_m", [16, 128])
def test_kernels_interpreted_tile_table_equals_the_torch_ops(experts, block_m):
    from lightning_sloth.kernels import moe as kernels

    gen = torch.Generator().manual_seed(experts * block_m)
    counts = torch.randint(0, 3 * block_m, (experts,), generator=gen)
    counts[torch.randperm(experts, generator=gen)[: experts // 3]] = 0  # experts without rows
    ends = torch.cumsum(counts, 0).to(torch.int32)
    for max_tiles in (int(ends[-1]) // block_m + experts, 3, 1000):
        expert, row = kernels._tile_table(ends, block_m, max_tiles)
        ref_expert, ref_row = kernels._tile_table_reference(ends, block_m, max_tiles)
        assert expert.dtype == row.dtype == torch.int32
        assert torch.equal(expert, ref_expert) and torch.equal(row, ref_row)
    held = len(kernels._TILE_TABLES)
    other = ends.clone()
    kernels._tile_table(other, block_m, 1000)
    assert len(kernels._TILE_TABLES) == held + 1
    del other  # a freed grouping's entry goes with it
    assert len(kernels._TILE_TABLES) == held
    with torch.inference_mode():  # generation: an inference tensor has no version to check
        inference_ends = ends.clone()
        got = kernels._tile_table(inference_ends, block_m, 1000)
    assert all(torch.equal(a, b) for a, b in zip(got, kernels._tile_table_reference(ends, block_m, 1000)))
    # every row is in exactly one valid tile, of its expert
    expert, row = kernels._tile_table(ends, block_m, int(ends[-1]) // block_m + experts)
    owner = torch.repeat_interleave(torch.arange(experts), counts)
    covered = torch.zeros(int(ends[-1]), dtype=torch.int64)
    for e, r in zip(expert.tolist(), row.tolist()):
        if e >= 0:
            stop = min(r + block_m, int(ends[e]))
            assert (owner[r:stop] == e).all()
            covered[r:stop] += 1
    assert (covered == 1).all()
    # the same ends tensor gives the same table again; one changed in place gets a new one
    again = kernels._tile_table(ends, block_m, 1000)
    assert again[0] is kernels._tile_table(ends, block_m, 1000)[0]
    if experts > 1:
        ends[0] = 0
        ends[1:] = ends[-1]
        fresh = kernels._tile_table(ends, block_m, 1000)
        assert all(
            torch.equal(a, b) for a, b in zip(fresh, kernels._tile_table_reference(ends, block_m, 1000))
        )


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_interpreted_clamped_swiglu_over_long_padded_rows(dtype):
    """Rows longer than one block (the second one partial) whose stride is wider than the row:
    the contiguous gate/up pair loads and the interleaved store stay inside each row."""
    from lightning_sloth.kernels import moe as kernels

    n = 1030  # 1024 + 6: two blocks, the last masked
    wide = (6 * torch.randn(3, 2 * n + 10)).to(dtype)  # values on both sides of +-7
    h = wide[:, : 2 * n]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    out = kernels.clamped_swiglu_forward(h, 1.702, 7.0)
    torch.testing.assert_close(
        out.float(), clamped_swiglu_reference(h.float(), 1.702, 7.0), rtol=tol, atol=tol
    )
    dz = torch.randn(3, n).to(dtype)
    dh = kernels.clamped_swiglu_backward(dz, h, 1.702, 7.0)
    expected = moe_ops._clamped_swiglu_backward_reference(dz.float(), h.float(), 1.702, 7.0)
    torch.testing.assert_close(dh.float(), expected, rtol=tol, atol=tol)
    assert dh.shape == (3, 2 * n) and dh.is_contiguous()


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_interpreted_gather_combine_bias_activation(dtype):
    from lightning_sloth.kernels import moe as kernels

    index, weights = _routing(tokens=9, experts=5, top_k=3)
    g = group_by_expert(index, 5)
    weights = weights.float()
    x = torch.randn(9, 37).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(kernels.gather_rows(x, g.perm, 3), x[g.perm // 3])
    scaled = kernels.gather_rows(x, g.perm, 3, weights.reshape(-1))
    torch.testing.assert_close(scaled, moe_ops._rows(x, g.perm, 3, weights.reshape(-1)), rtol=tol, atol=tol)
    y = torch.randn(27, 37).to(dtype)
    for w in (None, weights):
        torch.testing.assert_close(
            kernels.gather_sum(y, g.inv, 3, w), moe_ops._gather_sum(y, g.inv, 3, w), rtol=tol, atol=tol
        )
    dout = torch.randn(9, 37).to(dtype)
    expected_dw = (y.double()[g.inv].view(9, 3, 37) * dout.double()[:, None]).sum(-1)
    torch.testing.assert_close(
        kernels.combine_weight_grad(dout, y, g.inv, 3).double(), expected_dw, rtol=1e-4, atol=1e-4
    )
    bias = torch.randn(5, 37).to(dtype)
    out = y.clone()
    kernels.add_group_bias(out, bias, g.expert_ids)
    torch.testing.assert_close(out, (y.float() + bias.float()[g.expert_ids]).to(dtype), rtol=tol, atol=tol)
    h = (6 * torch.randn(27, 2 * 19)).to(dtype)
    torch.testing.assert_close(
        kernels.clamped_swiglu_forward(h, 1.702, 7.0).float(),
        clamped_swiglu_reference(h.float(), 1.702, 7.0),
        rtol=tol,
        atol=tol,
    )
    hs = torch.randn(27, 2 * 19).to(dtype)
    flat = weights.reshape(-1)
    torch.testing.assert_close(
        kernels.weighted_swiglu_forward(hs, flat, g.perm).float(),
        moe_ops._weighted_swiglu_reference(hs.float(), flat, g.perm),
        rtol=tol,
        atol=tol,
    )
    dz = torch.randn(27, 19).to(dtype)
    dh, dwk = kernels.weighted_swiglu_backward(dz, hs, flat, g.perm)
    dh_ref, dw_ref = moe_ops._weighted_swiglu_backward_reference(dz.float(), hs.float(), flat, g.perm)
    torch.testing.assert_close(dh.float(), dh_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(dwk, dw_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(
        kernels.clamped_swiglu_backward(dz, h, 1.702, 7.0).float(),
        moe_ops._clamped_swiglu_backward_reference(dz.float(), h.float(), 1.702, 7.0),
        rtol=tol,
        atol=tol,
    )


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )


@pytest.mark.parametrize("experts", [5, 256, 257, 40000])
def test_grouping_with_narrow_sort_keys_matches_the_int64_sort(experts):
    """The sort's keys are uint8/int16 where the ids fit: the same stable order, int64 ids out."""
    gen = torch.Generator().manual_seed(experts)
    index = torch.randint(0, experts, (300, 4), generator=gen)
    index[0, 0], index[-1, -1] = 0, experts - 1  # both ends of the id range
    g = group_by_expert(index, experts)
    ids, perm = torch.sort(index.reshape(-1), stable=True)
    assert torch.equal(g.perm, perm) and g.expert_ids.dtype == torch.int64 and torch.equal(g.expert_ids, ids)
    assert torch.equal(g.counts.long(), torch.bincount(index.reshape(-1), minlength=experts))
    assert int(g.ends[-1]) == index.numel()
