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


def test_bf16_mixed_clips_gradients_of_an_optimizer_that_unscales_in_its_step():
    """Lightning refuses to clip for fused AdamW under any AMP; bf16 has no loss scale to undo."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    weight = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    weight.grad = torch.full((8, 8), 3.0)
    optimizer = torch.optim.AdamW([weight])
    optimizer._step_supports_amp_scaling = True  # what fused=True sets (CUDA only)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        MixedPrecision("bf16-mixed", "cpu").clip_gradients(optimizer, 1.0)
    plugin = SlothPrecision("bf16-mixed", device="cpu")
    assert plugin.scaler is None
    plugin.clip_gradients(optimizer, 1.0)
    assert torch.linalg.vector_norm(weight.grad).item() == pytest.approx(1.0, rel=1e-4)


def test_fused_adamw_only_where_clipping_sees_unscaled_gradients():
    from lightning_sloth.module import use_fused_adamw

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    params = [torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)]
    assert use_fused_adamw(cuda, params, loss_scaled=False, clipped=True)  # bf16-mixed, 32, bf16-true
    assert use_fused_adamw(cuda, params, loss_scaled=True, clipped=False)  # fp16 scaler, no clipping
    assert not use_fused_adamw(cuda, params, loss_scaled=True, clipped=True)  # fp16 scaler + clipping
    assert not use_fused_adamw(cpu, params, loss_scaled=False, clipped=False)
    assert not use_fused_adamw(cuda, [torch.zeros(2, dtype=torch.float16)], loss_scaled=False, clipped=False)
