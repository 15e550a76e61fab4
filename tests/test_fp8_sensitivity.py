"""``benchmarks/fp8_sensitivity.py``: a trained run's validation loss with its base layers switched to
FP8 one projection kind at a time (CPU emulation), as the docs' table of which layers FP8 hurts."""

import json

from _scripts import benchmark_script
from test_export import SHORT_RUN, run_app


def test_configurations_cover_each_projection_every_one_and_the_preset():
    script = benchmark_script("fp8_sensitivity")
    configs = script.configurations()
    assert (
        configs["trained"] is None
        and configs["all"] == ()
        and configs["preset (k/v kept)"] == ("k_proj", "v_proj")
    )
    for name in script.PROJECTIONS:
        assert set(script.PROJECTIONS) - set(configs[f"{name} alone"]) == {name}


def test_a_short_run_is_measured_per_configuration(tmp_path):
    run = tmp_path / "run"
    run_app(run, SHORT_RUN)
    script = benchmark_script("fp8_sensitivity")
    script.main([str(run), "--out", str(tmp_path)])
    record = json.loads((tmp_path / "fp8_sensitivity.json").read_text())
    losses = record["runs"][str(run)]
    assert losses.keys() == script.configurations().keys() and losses["trained"]["relative"] == 0
    assert all(v["val_loss"] > 0 for v in losses.values())
    assert losses["all"]["val_loss"] != losses["trained"]["val_loss"]  # the FP8 rounding shows
    assert record["mean_relative"]["all"] == losses["all"]["relative"]
