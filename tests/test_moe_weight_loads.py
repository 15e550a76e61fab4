"""The fused MoE grouped GEMM's weight tiles through a TMA descriptor (``kernels.moe_fused.WEIGHT_LOADS``
``tma``, and ``tma_ws`` with a warp-specialised K loop) under the Triton interpreter: the same bits as
the pointer loads for either weight layout and its transposed views, K and N not multiples of the
tiles (the descriptor's zero fill past the edges), rows read through the permutation, scaled, with
the rank-r LoRA term, a bias, and the one-pass rank-r side; a weight no descriptor can address keeps
the pointer loads; an unknown choice is refused; ``auto`` (the default) gives descriptors (``tma_rows``)
on a CUDA device of compute capability 9.0 and above only; traced tensors (fake, functional: torch
captures no descriptor there) keep the pointer loads."""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases

from lightning_sloth.moe import group_by_expert

LAYOUTS = {  # name: (weight from a [E, K, N] draw, w_is_kn)
    "kn": (lambda w: w, True),
    "nk": (lambda w: w.transpose(1, 2).contiguous(), False),
    "nk-storage-read-as-kn": (lambda w: w.transpose(1, 2).contiguous().transpose(1, 2), True),
    "kn-storage-read-as-nk": (lambda w: w.transpose(1, 2), False),
}


def _routing(tokens, experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return group_by_expert(index, experts), torch.rand(tokens, top_k, generator=gen)


@interpreted_only
@pytest.mark.parametrize("loads", ["tma", "tma_ws"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n_in", [24, 64])  # 24: K ends inside a K tile
def test_kernels_interpreted_weight_tiles_through_a_descriptor_give_the_same_bits(
    loads, layout, n_in, monkeypatch
):
    from lightning_sloth.kernels import moe_fused as kernels

    top_k, experts, n_out, rank = 2, 5, 48, 4  # 48: the second 32-wide N tile ends inside the weight
    grouping, weights = _routing(20, experts, top_k, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20, n_in, generator=gen)
    make, w_is_kn = LAYOUTS[layout]
    w = make(torch.randn(experts, n_in, n_out, generator=gen))
    extra = dict(
        a_idx=grouping.perm,
        div=top_k,
        scale=weights.reshape(-1),
        bias=torch.randn(experts, n_out, generator=gen),
        x2=torch.randn(40, rank, generator=gen),
        w2=torch.randn(experts, rank, n_out, generator=gen),
        w2_is_kn=True,
        covered=True,
    )
    monkeypatch.setattr(kernels, "_tiles", lambda *a, **k: (16, 32, 16, 4, 2))
    want = kernels.grouped_mm(x, w, grouping.ends, w_is_kn, **extra)
    assert kernels._weight_loads(x.device) == "pointer"  # "auto" on the CPU: pointer loads
    monkeypatch.setattr(kernels, "WEIGHT_LOADS", loads)
    descriptor = kernels._weight_descriptor(w, w_is_kn, 16, 32)
    in_kn = (w if w_is_kn else w.transpose(1, 2)).stride(2) == 1  # [E, K, N] in memory
    assert descriptor is not None and descriptor[1] == in_kn
    got = kernels.grouped_mm(x, w, grouping.ends, w_is_kn, **extra)
    assert torch.equal(got, want)
    rows = x.double()[grouping.perm // top_k] * weights.reshape(-1).double()[grouping.perm, None]
    w64 = w.double() if w_is_kn else w.double().transpose(1, 2)
    full = torch.empty(40, n_out, dtype=torch.float64)
    start = 0
    for e, end in enumerate(grouping.ends.tolist()):
        s = slice(start, end)
        full[s] = (
            rows[s] @ w64[e] + extra["x2"].double()[s] @ extra["w2"].double()[e] + extra["bias"].double()[e]
        )
        start = end
    torch.testing.assert_close(got.double(), full, rtol=1e-5, atol=1e-4)


@interpreted_only
@pytest.mark.parametrize("loads", ["tma", "tma_ws"])
def test_kernels_interpreted_one_pass_side_with_descriptor_loads_gives_the_same_bits(loads, monkeypatch):
    """The one-pass rank-r side reads the same row tiles: with the weight through a descriptor (the K
    loop not warp-specialised then) the side and the output keep their bits."""
    from lightning_sloth.kernels import moe_fused as kernels

    grouping, weights = _routing(16, 4, 2, 3)
    gen = torch.Generator().manual_seed(4)
    half = torch.float16
    x = torch.randn(16, 32, generator=gen).to(half)
    w = torch.randn(4, 48, 32, generator=gen).to(half)
    down = torch.randn(4, 8, 32, generator=gen).to(half)
    up = torch.randn(4, 48, 8, generator=gen).to(half) * 0.5
    kw = dict(
        a_idx=grouping.perm, div=2, scale=weights.reshape(-1), covered=True, w2=up, down=down, lora_scale=0.25
    )
    monkeypatch.setattr(kernels, "_tiles", lambda *a, **k: (16, 32, 16, 4, 2))
    results = []
    for mode in ("pointer", loads):
        monkeypatch.setattr(kernels, "WEIGHT_LOADS", mode)
        side = torch.full((32, 8), float("nan"), dtype=half)
        results.append((kernels.grouped_mm(x, w, grouping.ends, False, r_out=side, **kw), side))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@interpreted_only
@pytest.mark.parametrize("n_in", [24, 64])  # 24: K ends inside a K tile (the descriptor's zero fill)
@pytest.mark.parametrize("side", ["x2", "one-pass"])
def test_kernels_interpreted_rows_in_expert_order_through_a_descriptor_give_the_same_bits(
    n_in, side, monkeypatch
):
    """``tma_rows``: a GEMM whose rows are already in expert order (the second GEMM's forward, the
    first's input gradient) reads its row tiles through a descriptor. A tile that runs past its
    expert's end reads the next expert's rows (or zeros past the last row) into rows it never stores:
    the output, written through the permutation, and the rank-r side keep the pointer loads' bits."""
    from lightning_sloth.kernels import moe_fused as kernels

    top_k, experts, n_out, rank = 2, 5, 48, 4
    grouping, _ = _routing(23, experts, top_k, 5)  # 46 rows: tiles of 16 straddle the experts' ends
    gen = torch.Generator().manual_seed(6)
    half = torch.float16
    x = torch.randn(46, n_in, generator=gen).to(half)
    w = torch.randn(experts, n_out, n_in, generator=gen).to(half)
    extra = dict(
        out_idx=grouping.perm, bias=torch.randn(experts, n_out, generator=gen).to(half), covered=True
    )
    if side == "x2":
        extra |= dict(
            x2=torch.randn(46, rank, generator=gen).to(half),
            w2=torch.randn(experts, rank, n_out, generator=gen).to(half),
            w2_is_kn=True,
        )
    else:
        down = torch.randn(experts, rank, n_in, generator=gen).to(half)
        extra |= dict(
            w2=torch.randn(experts, n_out, rank, generator=gen).to(half) * 0.5, down=down, lora_scale=0.25
        )
    monkeypatch.setattr(kernels, "_tiles", lambda *a, **k: (16, 32, 16, 4, 2))
    results = []
    for mode in ("pointer", "tma_rows"):
        monkeypatch.setattr(kernels, "WEIGHT_LOADS", mode)
        sides = {}
        if side == "one-pass":
            sides["r_out"] = torch.full((46, rank), float("nan"), dtype=half)
        out = kernels.grouped_mm(x, w, grouping.ends, False, **extra, **sides)
        results.append((out, sides.get("r_out")))
    assert kernels._rows_descriptor(x, 16, 16) is not None
    (want, want_side), (got, got_side) = results
    assert torch.equal(got, want)
    if side == "one-pass":
        assert torch.equal(got_side, want_side) and not got_side.isnan().any()
    rows64 = x.double()
    full = torch.empty(46, n_out, dtype=torch.float64)
    start = 0
    for e, end in enumerate(grouping.ends.tolist()):
        seg = slice(start, end)
        full[seg] = rows64[seg] @ w.double()[e].T + extra["bias"].double()[e]
        if side == "x2":
            full[seg] += extra["x2"].double()[seg] @ extra["w2"].double()[e]
        start = end
    slot = torch.empty_like(full)
    slot[grouping.perm] = full  # row s of expert order is written to slot perm[s]
    if side == "x2":
        torch.testing.assert_close(got.double(), slot, rtol=2e-2, atol=2e-2)


def test_rows_no_descriptor_can_address_keep_the_pointer_loads():
    pytest.importorskip("triton")
    from lightning_sloth.kernels import moe_fused as kernels

    assert kernels._rows_descriptor(torch.randn(40, 32), 16, 16) is not None
    assert kernels._rows_descriptor(torch.randn(40, 21), 16, 16) is None  # 84-byte rows
    assert kernels._rows_descriptor(torch.randn(40, 64)[:, ::2], 16, 16) is None  # no unit stride along K
    assert kernels._rows_descriptor(torch.randn(40 * 32 + 1)[1:].view(40, 32), 16, 16) is None  # base
    assert kernels._rows_descriptor(torch.randn(3, 40, 32), 16, 16) is None  # not [S, K]


def test_weights_no_descriptor_can_address_keep_the_pointer_loads(monkeypatch):
    pytest.importorskip("triton")
    from lightning_sloth.kernels import moe_fused as kernels

    monkeypatch.setattr(kernels, "WEIGHT_LOADS", "tma")
    aligned = torch.randn(3, 32, 48)
    assert kernels._weight_descriptor(aligned, True, 16, 32)[1] is True
    assert kernels._weight_descriptor(aligned, False, 16, 32)[1] is False  # [E, N, K] as in memory
    assert kernels._weight_descriptor(torch.randn(3, 32, 21), True, 16, 32) is None  # 84-byte rows
    assert (
        kernels._weight_descriptor(torch.randn(3, 64, 96)[:, ::2, ::2], True, 16, 32) is None
    )  # no unit stride
    assert kernels._weight_descriptor(torch.randn(3 * 32 * 48 + 1)[1:].view(3, 32, 48), True, 16, 32) is None
    monkeypatch.setattr(kernels, "WEIGHT_LOADS", "tmaa")
    with pytest.raises(
        ValueError,
        match=r"WEIGHT_LOADS must be one of \('auto', 'pointer', 'tma', 'tma_ws', 'tma_rows'\), got 'tmaa'",
    ):
        kernels._weight_descriptor(aligned, True, 16, 32)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )


def test_auto_gives_descriptors_only_where_the_device_has_tma(monkeypatch):
    pytest.importorskip("triton")
    from lightning_sloth.kernels import moe_fused as kernels

    assert kernels.WEIGHT_LOADS == "auto"
    assert kernels._weight_loads(torch.device("cpu")) == "pointer"
    for capability, want in (
        ((8, 0), "pointer"),
        ((8, 9), "pointer"),
        ((9, 0), "tma_rows"),
        ((10, 0), "tma_rows"),
    ):
        kernels._has_tma.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert kernels._weight_loads(torch.device("cuda", 0)) == want, capability
    kernels._has_tma.cache_clear()
    monkeypatch.setattr(kernels, "WEIGHT_LOADS", "tma_ws")
    assert kernels._weight_loads(torch.device("cpu")) == "tma_ws"  # an explicit choice holds anywhere


def test_traced_calls_keep_the_pointer_loads_and_plain_tiles(monkeypatch):
    """torch traces a ``triton_op``'s kernels outside Dynamo (``torch.compile``'s AOT pass,
    ``opcheck``) and captures no TMA descriptor there: fake and functional tensors get none (the
    pointer loads), where a real tensor of the same layout gets one. Under dynamic shapes the sizes are
    SymInts: the tiles still come back as plain ints (the kernel's constexprs)."""
    pytest.importorskip("triton")
    from lightning_sloth.kernels import moe_fused as kernels
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    monkeypatch.setattr(kernels, "WEIGHT_LOADS", "tma_rows")
    assert kernels._weight_descriptor(torch.empty(3, 32, 48), True, 16, 32) is not None
    assert kernels._rows_descriptor(torch.empty(40, 32), 16, 16) is not None
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def symbolic(*shape):
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        return mode.from_tensor(torch.empty(*shape), symbolic_context=context)

    x, w = symbolic(40, 24), symbolic(3, 20, 24)  # [S, K], [E, N, K]: N 20 and K 24 under the tiles
    assert isinstance(x.shape[1], torch.SymInt) and isinstance(w.shape[1], torch.SymInt)
    with mode:
        tiles = kernels._tiles(x.device, x.dtype, w.shape[1], x.shape[1])
        assert tiles == (64, 32, 32, 4, 2) and all(type(t) is int for t in tiles)
        assert kernels._weight_descriptor(torch.empty(3, 32, 48), True, 16, 32) is None  # fake
        assert kernels._rows_descriptor(torch.empty(40, 32), 16, 16) is None
    with mode, FunctionalTensorMode():
        functional = FunctionalTensor.to_functional(symbolic(40, 32))
        with pytest.raises(RuntimeError, match="Cannot access data pointer"):
            functional.data_ptr()
        assert kernels._rows_descriptor(functional, 16, 16) is None
        assert kernels._weight_descriptor(FunctionalTensor.to_functional(w), False, 16, 32) is None
    # functionalize()'s C++ wrapper around a real tensor: its data_ptr is 0, not the tensor's address
    wrapped = torch._to_functional_tensor(torch.empty(40, 32))
    assert wrapped.data_ptr() == 0 and kernels._rows_descriptor(wrapped, 16, 16) is None
