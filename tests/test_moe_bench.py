"""benchmarks/moe_bench.py's pure parts on the CPU: the tile sweep's configurations, the router knob, the summary's rows, the power meter over NVML."""

import json
from pathlib import Path

import pytest
import torch
from _scripts import benchmark_script

bench = benchmark_script("moe_bench")


def test_tile_configurations_parse_and_default():
    assert bench._tiles(None) == [None]
    assert bench._tiles("default; 128,256,64,8,3") == [None, (128, 256, 64, 8, 3)]
    with pytest.raises(ValueError, match="five integers"):
        bench._tiles("128,128,64")
    assert bench._tiles("default;768:128,128,32,8,4") == [None, ("depth", 768, (128, 128, 32, 8, 4))]
    with pytest.raises(ValueError, match="five integers"):
        bench._tiles("768:128,128,32")


def test_the_sweep_moves_one_knob_at_a_time():
    variants = bench._variants("128,128,64,8,3;64,128,64,4,4", "default;128,64,128,4,3")
    assert variants == [
        ((128, 128, 64, 8, 3), None, None, None, None, None),
        ((64, 128, 64, 4, 4), None, None, None, None, None),
        ((128, 128, 64, 8, 3), (128, 64, 128, 4, 3), None, None, None, None),
    ]
    assert bench._variants(None, None) == [(None, None, None, None, None, None)]
    assert bench._variants(None, None, "32;0") == [
        (None, None, 32, None, None, None),
        (None, None, 0, None, None, None),
    ]
    assert bench._variants(None, None, None, "none;both") == [
        (None, None, None, "none", None, None),
        (None, None, None, "both", None, None),
    ]
    assert bench._variants(None, None, None, None, "pointer;tma_ws") == [
        (None, None, None, None, "pointer", None),
        (None, None, None, None, "tma_ws", None),
    ]
    assert bench._variants(None, None, None, None, None, "1;0") == [
        (None, None, None, None, None, True),
        (None, None, None, None, None, False),
    ]
    with pytest.raises(ValueError, match="--lora-grad-pair takes 1 or 0; got 'yes'"):
        bench._variants(None, None, None, None, None, "yes")
    with pytest.raises(
        ValueError, match="--weight-loads takes auto, pointer, tma, tma_ws, tma_rows; got 'tmaws'"
    ):
        bench._variants(None, None, None, None, "tmaws")
    with pytest.raises(ValueError, match="--grouped-mm takes"):
        bench._variants(None, None, None, "all")


def test_the_knobs_reach_the_kernels_module():
    from lightning_sloth.kernels import moe_fused

    try:
        bench._set_tiles((64, 64, 32, 4, 2), (32, 32, 16, 4, 2))
        assert moe_fused.TILES == (64, 64, 32, 4, 2) and moe_fused.WGRAD_TILES == (32, 32, 16, 4, 2)
    finally:
        bench._set_tiles(None, None)
    assert moe_fused.TILES is None and moe_fused.WGRAD_TILES is None
    try:
        bench._set_tiles(("depth", 768, (128, 128, 32, 8, 4)), None)
        assert moe_fused.TILES is None and moe_fused.TILES_BY_DEPTH == ((768, (128, 128, 32, 8, 4)),)
    finally:
        bench._set_tiles(None, None)
    assert moe_fused.TILES_BY_DEPTH == ()


def test_the_down_rank_knob_reaches_the_ops_and_comes_back():
    from lightning_sloth.kernels import moe_fused

    from lightning_sloth.moe import indexed

    default = indexed.DOWN_IN_KERNEL_MAX_RANK
    flags = (indexed.ORDERED_ROWS_GROUPED_MM, indexed.GATHERED_ROWS_GROUPED_MM)
    try:
        bench._set_tiles(None, None, 0, "gathered", "tma", False)
        assert moe_fused.WEIGHT_LOADS == "tma" and not indexed.LORA_GRAD_PAIR
        assert indexed.DOWN_IN_KERNEL_MAX_RANK == 0
        assert (indexed.ORDERED_ROWS_GROUPED_MM, indexed.GATHERED_ROWS_GROUPED_MM) == (False, True)
    finally:
        bench._set_tiles(None, None)
    assert default == indexed.DOWN_IN_KERNEL_MAX_RANK and moe_fused.WEIGHT_LOADS == "auto"
    assert indexed.LORA_GRAD_PAIR
    assert flags == (indexed.ORDERED_ROWS_GROUPED_MM, indexed.GATHERED_ROWS_GROUPED_MM)
    assert bench._ranks("default;0") == [None, 0]


def test_rounds_interleave_the_configurations_and_pool_their_steps():
    assert bench._interleaved(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert bench._interleaved(2, 0) == [(0, 0), (0, 1)]  # at least one round
    pooled = bench._pooled([3.0, 1.0, 2.0, 10.0])
    assert pooled["median_ms"] == 2.5 and pooled["min_ms"] == 1.0 and pooled["timed_steps"] == 4


def test_the_summary_gives_the_back_to_back_ratio_beside_the_synchronised_one():
    result = {
        "grouped_mm": {"median_ms": 30.0, "pipelined_ms": 24.0},
        "sloth_fused": {"median_ms": 10.0, "pipelined_ms": 6.0},
        "fused_speedup_vs_grouped_mm": 3.0,
        "fused_pipelined_speedup_vs_grouped_mm": 4.0,
    }
    line = bench.summary({"results": {"shape/lora": result}}).splitlines()[1]
    assert "30.00 ms" in line and "10.00 ms" in line
    assert "3.00x" in line and "(back to back: 4.00x vs grouped_mm)" in line


def test_the_summary_gives_the_graphed_replays_and_names_a_step_that_was_not_captured():
    result = {
        "grouped_mm": {
            "median_ms": 30.0,
            "graphed": {"median_ms": 28.0, "pipelined_ms": 27.0, "power": {"energy_per_step_j": 15.5}},
        },
        "sloth": {"median_ms": 12.0, "graphed": {"error": "RuntimeError: capture failed"}},
        "sloth_fused": {
            "median_ms": 10.0,
            "graphed": {"median_ms": 8.0, "pipelined_ms": 7.5, "power": {"energy_per_step_j": 5.25}},
        },
        "fused_speedup_vs_grouped_mm": 3.0,
        "fused_graphed_speedup_vs_grouped_mm": 3.5,
        "fused_graphed_pipelined_speedup_vs_grouped_mm": 3.6,
        "sweep": [
            {"tiles": None, "wgrad_tiles": None, "median_ms": 10.0, "graphed": {"median_ms": 8.0}},
            {"tiles": None, "wgrad_tiles": None, "grouped_mm": "ordered", "median_ms": 9.5, "graphed": {}},
        ],
    }
    lines = bench.summary({"results": {"shape/lora": result}}).splitlines()
    graphed = lines[2]
    assert graphed.startswith("  as a CUDA graph")
    assert "28.00 ms" in graphed and "8.00 ms" in graphed and "not captured" in graphed
    assert "3.50x vs grouped_mm (back to back: 3.60x)" in graphed
    energy = lines[3]
    assert energy.startswith("  energy per replay") and "15.50 J" in energy and "5.25 J" in energy
    assert lines[4].endswith("10.00 ms (as a CUDA graph: 8.00 ms)")
    assert "torch._grouped_mm for ordered" in lines[5] and lines[5].endswith("9.50 ms")


def test_the_power_meter_reads_nvml_and_is_inert_without_it(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("pynvml")
    state = {"energy": 1_000, "clock": 1_695, "reasons": 0x4}
    fake.NVML_CLOCK_SM = 1
    fake.nvmlClocksEventReasonSwPowerCap = 0x4
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda handle: state["energy"]
    fake.nvmlDeviceGetClockInfo = lambda handle, kind: state["clock"] if kind == 1 else 0
    fake.nvmlDeviceGetCurrentClocksEventReasons = lambda handle: state["reasons"]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", lambda device=None: "handle", raising=False)
    meter = bench.PowerMeter()
    assert meter.available and meter.error is None
    assert (meter.energy_mj(), meter.sm_clock_mhz(), meter.power_capped()) == (1_000, 1_695, True)
    state["reasons"] = 0x1  # idle, not the power cap
    assert not meter.power_capped()

    def no_driver(device=None):
        raise RuntimeError("cuda driver can't be loaded")

    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", no_driver, raising=False)
    inert = bench.PowerMeter()
    assert not inert.available and "driver can't be loaded" in inert.error
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", lambda device=None: "handle", raising=False)

    def not_supported(handle):
        raise RuntimeError("Not Supported")

    fake.nvmlDeviceGetCurrentClocksEventReasons = not_supported  # a virtual machine's NVML
    partial = bench.PowerMeter()
    assert not partial.available and "Not Supported" in partial.error


def test_power_summary_gives_energy_per_step_power_and_clocks():
    summary = bench.power_summary(2_800, 0.4, 20, [1980, 1700, 1600], [False, True, True])
    assert summary["energy_per_step_j"] == pytest.approx(0.14)
    assert summary["mean_power_w"] == pytest.approx(7.0)
    assert summary["sm_clock_mhz_median"] == 1700 and summary["sm_clock_mhz_min"] == 1600
    assert summary["power_capped_share"] == pytest.approx(2 / 3)
    empty = bench.power_summary(1_000, 0.0, 10, [], [])
    assert empty["mean_power_w"] is None and empty["sm_clock_mhz_median"] is None
    assert empty["power_capped_share"] is None


def test_the_router_knob_installs_the_plugins_router_on_sloth_systems_only():
    """``--router sloth`` gives lightning_sloth's systems the router apply_experts installs; transformers'
    systems, and every system by default, run transformers' own."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from lightning_sloth.moe.fused import fused_permutation_setting, set_fused_permutation
    from lightning_sloth.patching import patched_op

    block = GptOssMLP(
        GptOssConfig(hidden_size=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    )
    switch = fused_permutation_setting()  # _select sets the process-wide switch
    try:
        bench._select(block, "sloth")
        assert patched_op(block.router) is None  # the default: transformers' router
        bench._set_router("sloth")
        bench._select(block, "sloth_fused")
        assert patched_op(block.router) == "moe_router"
        bench._select(block, "grouped_mm")
        assert patched_op(block.router) is None
    finally:
        bench._set_router("transformers")
        set_fused_permutation(switch)


def test_the_fp8_system_gets_the_fused_paths_speedups_and_a_summary_line():
    """``sloth_fp8`` gets the same ratios as the fused block (synchronised, back to back, as a graph),
    and the summary names them: the committed GPT-OSS-20B run gives 3.03x as a graph."""
    path = Path(__file__).parents[1] / "benchmarks" / "results" / "moe_fp8_graphs_energy_h200.json"
    result = json.loads(path.read_text())["results"]["gpt_oss_20b/lora"]
    systems = {name: result[name] for name in ("grouped_mm", "sloth_fused", "sloth_fp8")}
    ratios = bench._speedups("fp8", systems["sloth_fp8"], {"grouped_mm": systems["grouped_mm"]})
    assert ratios["fp8_graphed_speedup_vs_grouped_mm"] == pytest.approx(37.08 / 12.22, rel=1e-3)
    assert ratios["fp8_speedup_vs_grouped_mm"] == pytest.approx(result["fp8_speedup_vs_grouped_mm"])
    fused = bench._speedups("fused", systems["sloth_fused"], {"grouped_mm": systems["grouped_mm"]})
    assert fused == {
        k: v for k, v in result.items() if k.startswith("fused_") and k.endswith("vs_grouped_mm")
    }
    assert bench._speedups("fp8", {}, {"grouped_mm": systems["grouped_mm"]}) == {}
    lines = bench.summary({"results": {"gpt_oss_20b/lora": {**systems, **ratios}}}).splitlines()
    fp8 = next(line for line in lines if line.startswith("  FP8 experts vs grouped_mm"))
    assert "synchronised 2.89x" in fp8 and "back to back 3.06x" in fp8 and "as a CUDA graph 3.03x" in fp8
