"""SlothPrecision resolves to Lightning's stock plugins and honours the dtype exactly."""

import pickle

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_sloth.data.batch import PackedBatch
from lightning_sloth.plugins import SlothPrecision


@pytest.mark.parametrize(
    ("mode", "base", "dtype"),
    [
        ("bf16-mixed", MixedPrecision, torch.bfloat16),
        ("bf16-true", HalfPrecision, torch.bfloat16),
        ("16-true", HalfPrecision, torch.float16),
        ("32-true", Precision, torch.float32),
    ],
)
def test_resolves_to_lightning_plugin(mode, base, dtype):
    plugin = SlothPrecision(mode)
    assert isinstance(plugin, SlothPrecision) and isinstance(plugin, base)
    assert plugin.precision == mode and plugin.compute_dtype == dtype
    clone = pickle.loads(pickle.dumps(plugin))  # ddp_spawn pickles plugins
    assert type(clone) is type(plugin) and clone.precision == mode


def test_auto_is_float32_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectation")
    assert SlothPrecision("auto").precision == "32-true"


def test_unknown_precision_is_named():
    with pytest.raises(ValueError, match="unknown precision 'bf17'"):
        SlothPrecision("bf17")


def test_true_half_converts_module_in_place_and_keeps_integer_inputs():
    plugin = SlothPrecision("bf16-true")
    module = torch.nn.Linear(3, 3)
    plugin.convert_module(module)  # DDPStrategy ignores the return value
    assert module.weight.dtype == torch.bfloat16
    batch = PackedBatch(
        input_ids=torch.tensor([[1, 2, 3]]),
        labels=torch.tensor([[-100, 2, 3]]),
        position_ids=torch.tensor([[0, 1, 2]]),
        cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
        max_seqlen=3,
        num_tokens=3,
        num_target_tokens=2,
        capacity=3,
    )
    out = plugin.convert_input(batch)
    assert out.cu_seqlens.dtype == torch.int32 and out.input_ids.dtype == torch.int64


def test_full_precision_changes_nothing():
    plugin = SlothPrecision("32-true")
    module = torch.nn.Linear(3, 3)
    plugin.convert_module(module)
    assert module.weight.dtype == torch.float32
    with plugin.forward_context():
        assert module(torch.randn(2, 3)).dtype == torch.float32
