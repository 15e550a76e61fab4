"""The README's user example runs as written (reduced step count)."""

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_lightning_trainer_example_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("lightning_trainer", EXAMPLES / "lightning_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = example.main(max_steps=4, out=str(tmp_path))
    assert {"train/loss", "val/loss", "val/token_acc", "val/exact_match"} <= set(metrics)
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 16
