"""benchmarks/moe_gemm_variants.py's kernel variants under the Triton interpreter: every configuration
(no K mask, grouped order, TMA descriptors, warp specialisation, persistent) gives the product of
each expert's rows, read through the permutation or in expert order, for either weight layout."""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from _scripts import benchmark_script

bench = benchmark_script("moe_gemm_variants")


@interpreted_only
@pytest.mark.parametrize("w_is_kn", [True, False])
@pytest.mark.parametrize("config", range(len(bench.CONFIGS) + len(bench.RANK_CONFIGS)))
def test_kernels_interpreted_every_variant_is_the_grouped_product(w_is_kn, config):
    gen = torch.Generator().manual_seed(config)
    rank_case = config >= len(bench.CONFIGS)
    tokens, experts, top_k, hidden, out = 40, 4, 2, 64, 16 if rank_case else 48
    chosen = torch.randn(tokens, experts, generator=gen).topk(top_k, 1).indices.reshape(-1)
    perm = torch.sort(chosen, stable=True).indices
    ends = torch.cumsum(torch.bincount(chosen, minlength=experts), 0).to(torch.int32)
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(*((experts, hidden, out) if w_is_kn else (experts, out, hidden)), generator=gen)
    rows = x.double()[perm // top_k]
    w64 = w.double() if w_is_kn else w.double().transpose(1, 2)
    starts = [0, *ends[:-1].tolist()]
    want = torch.cat([rows[s:e] @ w64[i] for i, (s, e) in enumerate(zip(starts, ends.tolist(), strict=True))])
    chosen_cfg = bench.RANK_CONFIGS[config - len(bench.CONFIGS)] if rank_case else bench.CONFIGS[config]
    cfg = (16, 16 if rank_case else 32, 16, 4, 2, *chosen_cfg[5:])
    in_order = cfg[7]  # X through a descriptor: rows already in expert order
    got = bench.variant(
        rows.float() if in_order else x, w, ends, w_is_kn, None if in_order else perm, 1 if in_order else top_k,
        tokens * top_k, cfg,
    )  # fmt: skip
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_configurations_parse():
    assert all(len(c) == 10 for c in bench.CONFIGS + bench.RANK_CONFIGS)


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
