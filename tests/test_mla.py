"""DeepSeek-V3's multi-head latent attention in the flash varlen layout (``lightning_sloth.ops.mla``,
``lightning_sloth.patching.mla``), on CPU in float32/float64.

The q/k/v assembly against transformers' own composition (``apply_rotary_pos_emb_interleave``, the
``cat``, ``expand_kv``, the pad to the query head size, the output slice): bit for bit forward,
gradients equal, ``gradcheck`` in float64. Then one patched ``DeepseekV3Attention`` on a packed row
against transformers' forward through the same "sloth" attention, on its sdpa path and on the flash
path (a CPU reference stands in for the flash varlen kernel), and the layout copies each path
writes, counted. The whole model's packed parity is ``test_moe_family_ops.py``'s (the mla forward is
installed there).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_moe_family_ops import tiny
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

from lightning_sloth.attention import enable_packed_attention
from lightning_sloth.attention import packed as packed_attention
from lightning_sloth.attention import varlen as varlen_attention
from lightning_sloth.ops.mla import mla_key_value, mla_output, mla_query
from lightning_sloth.patching import apply_kernels, patched_op
from lightning_sloth.patching import mla as mla_forward

TOKENS, HEADS, NOPE, ROPE, VALUE = 11, 3, 8, 6, 5


def _rotary(tokens: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, r]`` as the rotary embedding gives them (``cat(freqs, freqs)``), positions of
    two documents."""
    positions = torch.cat((torch.arange(4), torch.arange(tokens - 4))).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, dtype=dtype) / ROPE))
    freqs = positions[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _transformers_qkv(q, kv, k_rot, cos, sin, pad: bool):
    """transformers' composition on ``[1, H, T, D]`` tensors, returned as ``[T, H, D]``."""
    q_states = q.transpose(0, 1)[None]
    q_pass, q_rot = torch.split(q_states, [NOPE, ROPE], dim=-1)
    q_rot, k_rot = deepseek.apply_rotary_pos_emb_interleave(q_rot, k_rot[None, None], cos[None], sin[None])
    query = torch.cat((q_pass, q_rot), dim=-1)
    kv_states = kv.transpose(0, 1)[None]
    k_nope, value = torch.split(kv_states, [NOPE, VALUE], dim=-1)
    key = kv_states.new_empty(*kv_states.shape[:-1], NOPE + ROPE)
    key[..., :NOPE].copy_(k_nope)
    key[..., NOPE:].copy_(k_rot.expand(-1, HEADS, -1, -1))
    if pad:
        value = F.pad(value, (0, NOPE + ROPE - VALUE))
    return (t[0].transpose(0, 1) for t in (query, key, value))


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()

    return leaf(TOKENS, HEADS, NOPE + ROPE), leaf(TOKENS, HEADS, NOPE + VALUE), leaf(TOKENS, ROPE)


@pytest.mark.parametrize("pad", [True, False])
def test_qkv_equal_transformers_bit_for_bit_and_so_do_the_gradients(pad):
    cos, sin = _rotary(TOKENS)
    ours_in, theirs_in = _inputs(), [t.detach().clone().requires_grad_() for t in _inputs()]
    q, kv, k_rot = ours_in
    rotated = deepseek.apply_rotary_pos_emb_interleave(
        k_rot[None, None], k_rot[None, None], cos[None], sin[None]
    )[1]
    query = mla_query(q, cos, sin, NOPE)
    key, value = mla_key_value(kv, rotated[0, 0], NOPE, NOPE + ROPE if pad else VALUE)
    expected = list(_transformers_qkv(*theirs_in, cos, sin, pad))

    for ours, theirs in zip((query, key, value), expected, strict=True):
        assert ours.is_contiguous() and torch.equal(ours, theirs)
    grads = [torch.randn_like(t) for t in expected]
    torch.autograd.backward([query, key, value], grads)
    torch.autograd.backward(expected, grads)
    assert torch.equal(q.grad, theirs_in[0].grad) and torch.equal(kv.grad, theirs_in[1].grad)
    torch.testing.assert_close(k_rot.grad, theirs_in[2].grad, rtol=1e-6, atol=1e-6)  # a sum over heads


def test_output_slice_equals_transformers_and_pads_its_gradient_with_zeros():
    out = torch.randn(TOKENS, HEADS, NOPE + ROPE, requires_grad=True)
    flat = mla_output(out, VALUE)
    assert flat.is_contiguous() and torch.equal(flat, out[..., :VALUE].reshape(TOKENS, -1))
    grad = torch.randn_like(flat)
    flat.backward(grad)
    assert torch.equal(out.grad[..., :VALUE].reshape(TOKENS, -1), grad) and not out.grad[..., VALUE:].any()


def test_gradcheck_float64():
    cos, sin = _rotary(TOKENS, torch.float64)
    q, kv, k_rot = _inputs(torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda x: mla_query(x, cos, sin, NOPE), (q,))
    assert torch.autograd.gradcheck(lambda a, b: mla_key_value(a, b, NOPE, NOPE + ROPE), (kv, k_rot))
    out = torch.randn(TOKENS, HEADS, NOPE + ROPE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mla_output(x, VALUE), (out,))


# ------------------------------------------------------------------------ one patched attention
LENGTHS = [5, 1, 9, 7]
HEAD_DIMS = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # DeepSeek-V3's
_PAUSED = [False]  # inside the stand-in kernel: its own ops are not layout copies


class _ReferenceVarlen(torch.autograd.Function):
    """The flash varlen kernel's math on ``[T, H, D]``, per document: a CPU stand-in whose forward
    and backward the layout counter does not see."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, scale):
        ctx.save_for_backward(q, k, v, cu_q)
        ctx.scale = scale
        return _ReferenceVarlen.attend(q, k, v, cu_q, scale)

    @staticmethod
    def attend(q, k, v, cu_q, scale):
        bounds = cu_q.tolist()
        outs = [
            F.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale
            ).transpose(0, 1)
            for s, e in zip(bounds, bounds[1:], strict=False)
        ]
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_q = ctx.saved_tensors
        _PAUSED[0] = True
        try:
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in (q, k, v)]
                out = _ReferenceVarlen.attend(*inputs, cu_q, ctx.scale)
                grads = torch.autograd.grad(out, inputs, grad)
        finally:
            _PAUSED[0] = False
        return (*grads, None, None)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, **_):
    assert window_size == (-1, 0) and q.shape[-1] == k.shape[-1] == v.shape[-1] and torch.equal(cu_q, cu_k)
    _PAUSED[0] = True
    try:
        return _ReferenceVarlen.apply(q, k, v, cu_q, scale)
    finally:
        _PAUSED[0] = False


class _LayoutWrites(TorchDispatchMode):
    """Elements written by layout ops (copies, cats, pads, clones, fills), outside the attention."""

    OPS = {"copy_", "cat", "clone", "constant_pad_nd", "fill_", "zero_", "_to_copy", "stack", "slice_scatter"}
    IN_PLACE = {"copy_", "fill_", "zero_"}

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if not _PAUSED[0] and name in self.OPS:
            self.elements += (args[0] if name in self.IN_PLACE else out).numel()
        return out


def _model_and_inputs(seed=0):
    model = tiny("deepseek_v3", seed=seed, **HEAD_DIMS)
    enable_packed_attention(model, backend="auto")  # explicit: the flash case below needs "auto"
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size, generator=gen)
    kwargs = dict(
        position_embeddings=model.model.rotary_emb(hidden, positions), attention_mask=None,
        position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
        max_length_k=max(LENGTHS),
    )  # fmt: skip
    return model, hidden, kwargs


def _run(attention, hidden, kwargs, counter):
    x = hidden.clone().requires_grad_()
    params = dict(attention.named_parameters())
    with counter:
        out, _ = attention(hidden_states=x, **kwargs)
        forward = counter.elements
        grads = torch.autograd.grad(out, [x, *params.values()], torch.ones_like(out))
    return out, dict(zip(["x", *params], grads, strict=True)), (forward, counter.elements - forward)


@pytest.mark.parametrize("flash", [False, True], ids=["sdpa", "flash-reference"])
def test_patched_attention_equals_transformers_on_a_packed_row(flash, monkeypatch):
    """The same output and gradients as transformers' forward through the same "sloth" attention.

    On the flash path (every layout step of both sides taken as on CUDA; DeepSeek-V3's head dims)
    the layout copies one layer writes, in ``[T, H, n + r]`` tensors: 3.75 in the forward (q, k, v,
    the output's first v columns, the shared rotary key) and 3.44 in the backward (the output
    gradient padded, q's and the kv projection's gradients, the rotary key's); transformers' 5.24
    forward with the packed attention writes 7.08 and 8.77.
    """
    model, hidden, kwargs = _model_and_inputs()
    reference = copy.deepcopy(model).model.layers[1].self_attn
    assert apply_kernels(model, ["mla"]).counts["mla"] == 3
    attention = model.model.layers[1].self_attn
    assert patched_op(attention) == "mla"
    if flash:
        monkeypatch.setattr(varlen_attention, "varlen_attn", _reference_varlen)
        for module in (mla_forward, packed_attention):
            monkeypatch.setattr(module, "varlen_usable", lambda query: True)
    calls = []
    monkeypatch.setattr(mla_forward, "mla_query", lambda *a: calls.append(1) or mla_query(*a))

    out, grads, ours = _run(attention, hidden, kwargs, _LayoutWrites())
    ref_out, ref_grads, theirs = _run(reference, hidden, kwargs, _LayoutWrites())

    assert calls == [1]
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    full = sum(LENGTHS) * attention.num_heads * attention.qk_head_dim
    if flash:
        assert [round(n / full, 2) for n in ours] == [3.75, 3.44], ours
        assert ours[0] < theirs[0] and ours[1] < theirs[1]
