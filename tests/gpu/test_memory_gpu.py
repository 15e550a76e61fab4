"""Memory at long sequences on CUDA: token-chunked MLPs (bf16 and NF4 bases, with offload), the
loss's one gradient buffer, the shared dequantisation buffer. Memory is read from the allocator's
peak, never from time.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_memory_gpu.py`` (about a minute).
"""

from __future__ import annotations

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sloth.ops import nf4
from lightning_sloth.ops.linear_cross_entropy import linear_cross_entropy
from lightning_sloth.quant import Linear4bit, quantize_model
from lightning_sloth.transform import transform_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, INTERMEDIATE, TOKENS = 512, 8192, 32768
MIB = 2**20


def _model(base: str, chunk, offload: str = "on", **sloth):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1024, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    )  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    if base == "nf4":
        quantize_model(model, "nf4")
    model.sloth_report = transform_model(
        model, kernels=True, offload=offload, mlp_chunk_tokens=chunk, **sloth
    )
    return model.train()


def _batch(tokens: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (1, tokens), generator=gen)
    cu = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32)
    positions = torch.cat([torch.arange(tokens // 3), torch.arange(tokens - tokens // 3)]).unsqueeze(0)
    labels = ids.clone()
    labels[0, 0] = labels[0, tokens // 3] = -100
    inputs = dict(
        input_ids=ids, labels=labels, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=tokens - tokens // 3, max_length_k=tokens - tokens // 3, use_cache=False,
    )  # fmt: skip
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = model(**inputs).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads, peak


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_chunked_mlp_same_gradients_and_less_memory(base):
    """32k tokens, a wide MLP (I = 16 H): chunks of 4096 tokens give the unchunked loss and
    gradients (bf16 tolerance) and a peak at least 1 GiB lower (three [T, I] bf16 tensors are
    1.5 GiB; one chunk's are 192 MiB)."""
    inputs = _batch(TOKENS)
    want_loss, want, whole_peak = _step(_model(base, None), inputs)
    loss, got, chunked_peak = _step(_model(base, 4096), inputs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-6)
        assert (got[name] - want[name]).abs().max() / scale < 3e-2, name
    assert chunked_peak < whole_peak - 1024 * MIB, (chunked_peak / MIB, whole_peak / MIB)


def test_loss_holds_one_chunk_and_one_hidden_gradient():
    """65,536 rows over a 128,256 vocabulary: the peak over the inputs is hidden's gradient and one
    chunk of logits (with the row kernel's small per-row state), not twice ``[N, H]``."""
    n, h, v = 65536, 2048, 128256
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(hidden, weight, targets, chunk_bytes=256 * MIB)
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated() - before
    grad_bytes = n * h * 2
    peaks = (forward_peak / MIB, backward_peak / MIB)
    assert forward_peak <= grad_bytes + 256 * MIB + 64 * MIB, peaks  # d hidden, one chunk
    assert backward_peak <= 2 * grad_bytes + 64 * MIB + 64 * MIB, peaks  # d hidden, hidden.grad, a slice


def test_dequant_buffer_is_the_largest_weight():
    nf4.release_scratch()
    model = _model("nf4", None, offload="off")
    _step(model, _batch(2048))
    largest = max(m.out_features * m.in_features for m in model.modules() if isinstance(m, Linear4bit))
    assert nf4.scratch_bytes() == largest * 2  # one bf16 buffer for every shape


def test_4bit_down_projection_writes_its_input_gradient_in_place(monkeypatch):
    """The NF4 MLP's down projection writes the activation's gradient where the activation was:
    the step's peak is lower by about one ``[T, I]`` bf16 buffer (512 MiB at 32k tokens, I = 8192)
    than with the plain backward, with the same loss and gradients."""
    from lightning_sloth.patching import _forwards

    inputs = _batch(TOKENS)
    model = _model("nf4", None, offload="on")
    loss, got, peak = _step(model, inputs)
    original = _forwards.lora_4bit_forward
    monkeypatch.setattr(
        _forwards,
        "lora_4bit_forward",
        lambda module, x, overwrite_input=False, **kw: original(module, x, **kw),
    )
    want_loss, want, plain_peak = _step(model, inputs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    assert got.keys() == want.keys()
    for name in want:  # the same products; cuBLAS may pick another algorithm for another buffer
        scale = want[name].abs().max().clamp_min(1e-6)
        assert (got[name] - want[name]).abs().max() / scale < 1e-2, name
    saved = TOKENS * INTERMEDIATE * 2
    assert peak <= plain_peak - saved * 3 // 4, (peak / MIB, plain_peak / MIB)


def test_the_plan_measures_each_layers_backward_and_keeps_the_gradients():
    """``memory_budget`` measures each layer's backward beyond its saved activations (at least the
    incoming ``[tokens, hidden]`` gradient) in the first step, without touching ``.grad``: the
    step's gradients are those of the same model without a plan."""
    tokens = 8192
    inputs = _batch(tokens)
    planned = _model("bf16", None, offload="off", memory_budget="auto")
    loss, got, _ = _step(planned, inputs)
    layers = planned.sloth_report.checkpointing
    assert layers.backward_bytes is not None and len(layers.backward_bytes) == 2
    assert all(b >= tokens * HIDDEN * 2 for b in layers.backward_bytes), layers.backward_bytes
    assert layers.plan == ["keep", "keep"]  # a 2-layer model keeps everything on a whole card
    plain = _model("bf16", None, offload="off")
    want_loss, want, _ = _step(plain, inputs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-6)
        assert (got[name] - want[name]).abs().max() / scale < 1e-2, name
