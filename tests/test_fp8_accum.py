"""The FP8 products' accumulation mode: every ``torch._scaled_mm`` call of the FP8 ops passes the
process's ``use_fast_accum`` (``lightning_sloth.ops.fp8.FAST_ACCUM``); ``SlothPrecision`` and the
Hydra preset set it, a bad value is refused. The GPU's two modes against each other and the
emulation: ``tests/gpu/test_fp8_gpu.py``."""

import pytest
import torch
from _models import add_lora, tiny_llama

from lightning_sloth import SlothPrecision
from lightning_sloth.ops import fp8 as fp8_ops
from lightning_sloth.ops.fp8_formats import fp8_linear_reference, quantize_rows


@pytest.fixture
def recorded(monkeypatch):
    """``torch._scaled_mm`` replaced by the float32 product of the dequantised operands, recording
    each call's ``use_fast_accum``; the FP8 path taken for every shape (as on an FP8 GPU)."""
    calls = []

    def fake_scaled_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False, out=None):
        calls.append(use_fast_accum)
        y = ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(fp8_ops, "scaled_mm_applies", lambda x, n: True)
    monkeypatch.setattr(fp8_ops, "FAST_ACCUM", fp8_ops.FAST_ACCUM)
    return calls


@pytest.mark.parametrize("fast", [True, False])
def test_every_fp8_product_passes_the_process_accumulation_mode(recorded, fast):
    fp8_ops.FAST_ACCUM = fast
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=gen)
    codes, scale = quantize_rows(torch.randn(16, 32, generator=gen), "e4m3")
    y = fp8_ops.fp8_product(x, codes, scale)
    torch.testing.assert_close(y, fp8_linear_reference(x, codes, scale), rtol=1e-5, atol=1e-5)
    out = torch.empty(8, 32)
    w_col = codes.float().t().contiguous().t().to(codes.dtype)  # [N, K], column-major
    assert fp8_ops._grad_scaled_mm(torch.randn(8, 16, generator=gen), w_col, scale, "e4m3", out) is out
    assert recorded == [fast, fast]


def test_precision_sets_the_accumulation_mode_when_it_converts(monkeypatch):
    monkeypatch.setattr(fp8_ops, "FAST_ACCUM", True)
    assert SlothPrecision("32-true", base_dtype="fp8").fp8_fast_accum is True
    exact = SlothPrecision("32-true", base_dtype="fp8", fp8_fast_accum=False)
    assert fp8_ops.FAST_ACCUM is True  # set when the module is converted, not before
    exact.convert_module(add_lora(tiny_llama()))
    assert fp8_ops.FAST_ACCUM is False
    SlothPrecision("32-true", quantize="nf4", base_dtype="fp8").convert_module(add_lora(tiny_llama()))
    assert fp8_ops.FAST_ACCUM is True
    SlothPrecision("32-true", fp8_fast_accum=False).convert_module(add_lora(tiny_llama()))
    assert fp8_ops.FAST_ACCUM is True  # without FP8 bases the setting is left alone
    with pytest.raises(TypeError, match="fp8_fast_accum must be True or False, got 'no'"):
        SlothPrecision("32-true", base_dtype="fp8", fp8_fast_accum="no")


def test_hydra_preset_turns_fast_accumulation_off():
    from hydra import compose, initialize_config_module

    from lightning_sloth import build
    from lightning_sloth.config import validate

    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        cfg = compose("train", overrides=["precision=fp8_lora"])
        assert cfg.precision.fp8_fast_accum is True
        assert build.build_precision(cfg.precision).fp8_fast_accum is True
        exact = compose("train", overrides=["precision=fp8_lora", "precision.fp8_fast_accum=false"])
        validate(exact)
        assert build.build_precision(exact.precision).fp8_fast_accum is False
        with pytest.raises(Exception, match="fp8_fast_accum"):
            compose("train", overrides=["precision=fp8_lora", "precision.fp8_fast_accum=sometimes"])
