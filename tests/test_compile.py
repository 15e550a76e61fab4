"""Patched decoder blocks under torch.compile: no graph breaks, eager numerics; compile_blocks training."""

from __future__ import annotations

import copy

import pytest
import test_patching as tp  # the tiny family models and helpers (tests/ is on sys.path)
import torch
from torch._dynamo.utils import counters

from lightning_sloth.patching import apply_kernels, compile_blocks

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:peft")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def patched_block(model_type: str, with_lora: bool):
    """Layer 0 of a patched tiny model, its inputs, and the model (kept alive)."""
    model = tp.tiny_model(model_type)
    model = tp.lora(model) if with_lora else model
    apply_kernels(model)
    base = model.get_base_model() if with_lora else model
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 12, 64, generator=gen)
    positions = torch.arange(12).expand(2, -1)
    rotary = base.model.rotary_emb
    # Gemma 3 keeps one rotary table per layer type.
    layer_type = getattr(base.config, "layer_types", [None])[0]
    cos_sin = (
        rotary(hidden, positions, layer_type) if model_type == "gemma3_text" else rotary(hidden, positions)
    )
    kwargs = dict(attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    return base.model.layers[0], hidden, kwargs


def forward_backward(block, hidden, kwargs, grad_out, call=None):
    """Output, input gradient and parameter gradients of ``call`` (default: the block itself)."""
    block.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_(True)
    out = (block if call is None else call)(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out)
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


# (model_type, LoRA, module compiled, sloth ops its graph must hold). GPT-OSS compiles its attention
# only: its MoE experts are transformers' own code, whose CPU grouped-mm fallback does not compile
# on every transformers version (lightning_sloth's experts live in the MoE room).
BLOCK_CASES = [
    ("llama", True, "block", ("rms_norm", "rope", "swiglu", "lora_linear")),
    ("qwen3", True, "block", ("rms_norm", "rope", "swiglu", "lora_linear")),
    ("qwen2", True, "block", ("rms_norm", "rope", "swiglu", "lora_linear")),  # q/k/v with a bias
    ("gemma3_text", False, "block", ("rms_norm", "rope", "geglu")),
    ("gpt_oss", False, "self_attn", ("rope",)),
]


@pytest.mark.parametrize(("model_type", "with_lora", "part", "ops"), BLOCK_CASES)
def test_patched_block_is_one_graph_with_eager_numerics(model_type, with_lora, part, ops):
    block, hidden, kwargs = patched_block(model_type, with_lora)
    module = block if part == "block" else getattr(block, part)
    explained = torch._dynamo.explain(module)(hidden, **kwargs)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    code = explained.graphs[0].code
    assert all(f"sloth.{op}" in code for op in ops)
    assert ("sloth.lora_linear" in code) == with_lora

    grad_out = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    expected = forward_backward(module, hidden, kwargs, grad_out)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    actual = forward_backward(module, hidden, kwargs, grad_out, call=compiled)
    torch.testing.assert_close(actual[:2], expected[:2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual[2], expected[2], rtol=1e-5, atol=1e-6)


def test_compile_blocks_trains_a_step_like_eager():
    model = tp.lora(tp.tiny_model("llama", num_hidden_layers=3))
    apply_kernels(model)
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())

    # aot_eager runs the autograd functionalization Inductor sees at a fraction of its CPU build
    # time; Inductor with the Triton kernels is tested on the GPU (tests/gpu/test_patching_gpu.py).
    assert compile_blocks(model, fullgraph=True, backend="aot_eager") == 3
    loss, grads = tp.loss_and_grads(model, tp.batch(), use_cache=False)
    # The layers share their graphs: one for layer 0, whose input (frozen embeddings) needs no
    # gradient, one for the others.
    assert counters["stats"]["unique_graphs"] == 2
    ref_loss, ref_grads = tp.loss_and_grads(reference, tp.batch(), use_cache=False)

    assert list(model.state_dict()) == keys  # compiled in place: no _orig_mod. prefixes
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    compiled_calls = [layer._compiled_call_impl for layer in model.get_base_model().model.layers]
    assert compile_blocks(model) == 3  # idempotent: the compiled calls (and their caches) are kept
    assert [layer._compiled_call_impl for layer in model.get_base_model().model.layers] == compiled_calls


@pytest.mark.parametrize("order", ["checkpointing_first", "compile_first"])
def test_compile_blocks_with_transformers_checkpointing(order):
    model = tp.lora(tp.tiny_model("qwen3"))
    apply_kernels(model)
    reference = copy.deepcopy(model)
    reference.gradient_checkpointing_enable()
    if order == "compile_first":
        compile_blocks(model, fullgraph=True, backend="aot_eager")
    model.gradient_checkpointing_enable()
    if order == "checkpointing_first":
        compile_blocks(model, fullgraph=True, backend="aot_eager")

    tp.assert_same_training_step(model.train(), reference.train(), use_cache=False)
    assert not counters["graph_break"]


def test_compile_blocks_needs_decoder_layers():
    with pytest.raises(TypeError, match="no transformers GradientCheckpointingLayer"):
        compile_blocks(torch.nn.Linear(3, 3))
