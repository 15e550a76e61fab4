"""Faults on CUDA: a real out-of-memory error in a too-long step gives the app's message (the
step's tokens, the peak, the settings that fit), the last checkpoint untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_export import run_app  # noqa: E402

from lightning_sloth.plugins.callbacks import StepOutOfMemoryError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A 4-layer Llama without checkpointing over 32k-token rows: several GiB of activations in its
# first training step, on a process allowed 2 GiB.
TOO_LONG = [
    "model=tiny_llama",
    "model.hidden_size=512",
    "model.intermediate_size=2048",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.max_position_embeddings=32768",
    "data.num_train=3000",
    "data.num_val=8",
    "data.max_tokens=32768",
    "sloth.gradient_checkpointing=false",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.num_sanity_val_steps=0",
    "trainer.samples=0",
    "trainer.enable_progress_bar=false",
]


def test_a_real_out_of_memory_step_gives_the_message(tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)
    try:
        with pytest.raises(StepOutOfMemoryError) as error:
            run_app(tmp_path / "run", TOO_LONG)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    message = str(error.value)
    assert isinstance(error.value.__cause__, torch.OutOfMemoryError)
    assert "out of memory in training step 0 (" in message and "-token row" in message
    assert "peak allocated" in message and "GiB of the device's" in message
    for hint in ("sloth.gradient_checkpointing=true", "sloth.offload=on", "data.max_tokens=16384"):
        assert hint in message
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
