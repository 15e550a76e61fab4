"""benchmarks/gemm_energy.py on the CPU: the block's four products, their FLOPs, and the ways agreeing."""

import pytest
import torch
from _scripts import benchmark_script

energy = benchmark_script("gemm_energy")


def test_the_block_step_has_four_products_and_their_flops():
    spec = energy.products("gpt_oss_20b", 16384)
    assert (spec["rows"], spec["experts"], spec["hidden"], spec["intermediate"]) == (65536, 32, 2880, 2880)
    assert [(name, k, n) for name, k, n, _, _ in spec["gemms"]] == [
        ("gate_up", 2880, 5760),
        ("down", 2880, 2880),
        ("d_act", 2880, 2880),
        ("d_x", 5760, 2880),
    ]
    assert spec["flops"] == 2 * 2 * 65536 * (2880 * 5760 + 2880 * 2880)  # forward, and as much for dx
    assert energy.products("qwen3_30b_a3b", 16384)["rows"] == 131072
    with pytest.raises(ValueError, match="do not split evenly"):
        energy.products("gpt_oss_20b", 7)


def test_the_ways_compute_the_same_products(monkeypatch):
    shapes = dict(energy.moe_bench.SHAPES)
    shapes["tiny"] = dict(
        model_type="gpt_oss", hidden_size=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16
    )
    monkeypatch.setattr(energy.moe_bench, "SHAPES", shapes)
    spec = energy.products("tiny", 8)
    outs = {way: energy._runner(way, spec, torch.device("cpu"))() for way in energy.WAYS}
    per = spec["rows"] // spec["experts"]
    for grouped, sloth, dense in zip(outs["grouped_mm"], outs["sloth"], outs["dense"]):
        torch.testing.assert_close(sloth.float(), grouped.float(), rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(grouped[:per].float(), dense[:per].float(), rtol=2e-2, atol=2e-3)
        assert not torch.allclose(grouped[per:].float(), dense[per:].float())  # other experts' weights
    with pytest.raises(ValueError, match="unknown way"):
        energy._runner("cutlass", spec, torch.device("cpu"))


def test_it_needs_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        energy.main(["--shapes", "gpt_oss_20b"])
