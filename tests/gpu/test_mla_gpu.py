"""DeepSeek-V3's multi-head latent attention on CUDA in bf16 through the mla forward
(``lightning_sloth.patching.mla``): q, k and v built ``[T, H, D]`` and the flash varlen kernel called
on them directly. One ``DeepseekV3Attention`` with DeepSeek-V3's head dims on a packed row, forward
and backward, against the float32 truth (each document alone through transformers' forward), as close
as transformers' own bf16 forward on each document is; and no host sync in its step.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_mla_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _bf16_parity import rel
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_sloth.attention import enable_packed_attention
from lightning_sloth.attention import varlen as varlen_attention
from lightning_sloth.patching import apply_kernels, patched_op

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [300, 1, 129, 64, 530]
CONFIG = dict(
    vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    intermediate_size=64, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=1024, initializer_range=0.02,
    attn_implementation="sdpa",
)  # fmt: skip


def _attentions():
    """The float32 truth, transformers' bf16 and the patched bf16 attention of one layer (same weights),
    each with its model (for the rotary embedding)."""
    torch.manual_seed(0)
    truth = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **CONFIG)).cuda().float()
    theirs = copy.deepcopy(truth).to(torch.bfloat16)
    ours = copy.deepcopy(theirs)
    enable_packed_attention(ours)
    assert apply_kernels(ours, ["mla"]).counts["mla"] == 1
    assert patched_op(ours.model.layers[0].self_attn) == "mla"
    return truth, theirs, ours


_CU = {}


def _cu_seqlens(bounds: list[int]) -> torch.Tensor:
    """The row's ``cu_seqlens`` on the device, made once (outside the sync-checked step)."""
    key = tuple(bounds)
    if key not in _CU:
        _CU[key] = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    return _CU[key]


def _run(model, hidden, grad, packed: bool):
    """Output ``[T, hidden]`` and the gradients of the input and every attention parameter for
    ``sum(out * grad)``: one packed call, or each document alone."""
    attention = model.model.layers[0].self_attn
    params = dict(attention.named_parameters())
    x = hidden.to(next(attention.parameters()).dtype).detach().requires_grad_()
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    spans = [(0, bounds[-1])] if packed else list(zip(bounds, bounds[1:], strict=False))
    outs = []
    for start, end in spans:
        lengths = LENGTHS if packed else [end - start]
        positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
        kwargs = dict(position_embeddings=model.model.rotary_emb(x, positions), attention_mask=None)
        if packed:
            cu = _cu_seqlens(bounds)
            kwargs.update(
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS)
            )
        outs.append(attention(hidden_states=x[:, start:end], **kwargs)[0][0])
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, [x, *params.values()], grad.to(out.dtype))
    return out.float(), {name: g.float() for name, g in zip(["x", *params], grads, strict=True)}


def test_packed_mla_bf16_is_as_close_to_float32_as_transformers(monkeypatch):
    truth, theirs, ours = _attentions()
    calls = []
    flash = varlen_attention.varlen_attn
    monkeypatch.setattr(varlen_attention, "varlen_attn", lambda *a, **k: calls.append(1) or flash(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(1, sum(LENGTHS), CONFIG["hidden_size"], device="cuda", generator=gen)
    grad = torch.randn(sum(LENGTHS), CONFIG["hidden_size"], device="cuda", generator=gen)

    true_out, true_grads = _run(truth, hidden, grad, packed=False)
    ref_out, ref_grads = _run(theirs, hidden, grad, packed=False)
    out, grads = _run(ours, hidden, grad, packed=True)

    assert calls == [1]  # the flash kernel ran on the [T, H, D] tensors
    print(f"output: ours {rel(out, true_out):.4f}  transformers bf16 {rel(ref_out, true_out):.4f}")
    assert rel(out, true_out) <= 1.5 * rel(ref_out, true_out) + 1e-2
    for name, true_grad in true_grads.items():
        ours_rel, theirs_rel = rel(grads[name], true_grad), rel(ref_grads[name], true_grad)
        print(f"{name:40s} ours {ours_rel:.4f}  transformers bf16 {theirs_rel:.4f}")
        assert ours_rel <= 1.5 * theirs_rel + 1e-2, name


def test_no_host_sync_in_a_packed_mla_step():
    _, _, ours = _attentions()
    hidden = torch.randn(1, sum(LENGTHS), CONFIG["hidden_size"], device="cuda")
    grad = torch.randn(sum(LENGTHS), CONFIG["hidden_size"], device="cuda")
    _run(ours, hidden, grad, packed=True)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(ours, hidden, grad, packed=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
