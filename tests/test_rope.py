"""sloth::rope: float64 agreement, transformers' apply_rotary_pos_emb, op checks, compile, Triton kernels.

The Triton kernels run on CPU under the Triton interpreter. ``TRITON_INTERPRET`` must be set before
triton is imported, so ``test_kernels_under_triton_interpreter`` reruns this file's ``interpreted``
cases in a fresh process with it set (they skip in the normal run).
"""

import pytest
import torch
from _interpreter import interpreted_only, launcher_only, run_interpreted_cases
from torch.utils.flop_counter import FlopCounterMode

from lightning_sloth.ops.rope import (
    _rope,
    _rope_backward,
    apply_rope,
    rope_backward_reference,
    rope_reference,
)


def _qk(batch, n_q_heads, n_kv_heads, seq_len, head_dim, dtype=torch.float32):
    """q and k as transformers' attention modules make them: ``[B, T, H, D]`` projections transposed to ``[B, H, T, D]``."""
    q = torch.randn(batch, seq_len, n_q_heads, head_dim, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq_len, n_kv_heads, head_dim, dtype=dtype).transpose(1, 2)
    return q, k


def _cos_sin(batch, seq_len, rotary_dim, dtype=torch.float32):
    """cos/sin in the layout of transformers' rotary embeddings (repeated halves), from random positions."""
    angles = torch.rand(batch, seq_len, 1) * 100 * torch.rand(rotary_dim // 2)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _reference64(x, cos, sin):
    """The rotation written out half by half in float64 (not via rotate_half)."""
    x, cos, sin = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    half = cos.shape[-1] // 2
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, rest), dim=-1)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("partial", [False, True])
def test_forward_and_backward_match_float64(head_dim, partial):
    rotary_dim = head_dim // 2 if partial else head_dim
    q, k = _qk(2, 6, 2, 9, head_dim)  # GQA: 6 query heads, 2 key/value heads
    q.requires_grad_(), k.requires_grad_()
    # Fully random cos/sin (halves unrelated): the op must be the exact linear map, not just a rotation.
    cos, sin = torch.randn(2, 9, rotary_dim), torch.randn(1, 9, rotary_dim)
    q_out, k_out = apply_rope(q, k, cos, sin.expand(2, -1, -1))
    grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
    grads = torch.autograd.grad((q_out, k_out), (q, k), (grad_q, grad_k))

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    q_ref, k_ref = _reference64(q64, cos, sin), _reference64(k64, cos, sin)
    grads64 = torch.autograd.grad((q_ref, k_ref), (q64, k64), (grad_q.double(), grad_k.double()))
    torch.testing.assert_close((q_out.double(), k_out.double()), (q_ref, k_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tuple(g.double() for g in grads), grads64, rtol=1e-5, atol=1e-5)


def test_output_keeps_the_transposed_layout():
    q, k = _qk(2, 4, 2, 5, 16)
    q_out, k_out = apply_rope(q, k, *_cos_sin(2, 5, 16))
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_strided_feature_dimension_is_accepted():
    q = torch.randn(1, 3, 4, 32)[..., ::2]
    k = torch.randn(1, 1, 4, 32)[..., ::2]
    cos, sin = _cos_sin(1, 4, 16)
    q_out, k_out = apply_rope(q, k, cos, sin)
    torch.testing.assert_close(
        (q_out.double(), k_out.double()), (_reference64(q, cos, sin), _reference64(k, cos, sin))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_type", ["default", "llama3", "yarn"])
def test_matches_apply_rotary_pos_emb_exactly(dtype, rope_type):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    parameters = {
        "default": {"rope_type": "default", "rope_theta": 10000.0},
        "llama3": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "yarn": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }[rope_type]
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=parameters,
    )
    q, k = _qk(2, 4, 2, 13, 64, dtype)
    position_ids = torch.stack((torch.arange(13), torch.arange(100, 113)))
    cos, sin = LlamaRotaryEmbedding(config)(q, position_ids)
    q_out, k_out = apply_rope(q, k, cos, sin)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close((q_out, k_out), (q_hf, k_hf), rtol=0, atol=0)


def test_gradients_match_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _qk(2, 4, 2, 7, 32)
    q.requires_grad_(), k.requires_grad_()
    cos, sin = _cos_sin(2, 7, 32)
    grad_q, grad_k = torch.randn(2, 4, 7, 32), torch.randn(2, 2, 7, 32)
    ours = torch.autograd.grad(apply_rope(q, k, cos, sin), (q, k), (grad_q, grad_k))
    theirs = torch.autograd.grad(apply_rotary_pos_emb(q, k, cos, sin), (q, k), (grad_q, grad_k))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_partial_rotary_matches_the_split_and_concatenate_modules():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _qk(1, 4, 4, 6, 80)
    cos, sin = _cos_sin(1, 6, 32)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :32], k[..., :32], cos, sin)
    expected = (torch.cat((q_rot, q[..., 32:]), dim=-1), torch.cat((k_rot, k[..., 32:]), dim=-1))
    torch.testing.assert_close(apply_rope(q, k, cos, sin), expected, rtol=0, atol=0)


def test_opcheck():
    q, k = _qk(2, 3, 1, 5, 24)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    torch.library.opcheck(_rope, (q.requires_grad_(), k.requires_grad_(), cos, sin))
    grad_q, grad_k = _qk(2, 3, 1, 5, 24)
    torch.library.opcheck(_rope_backward, (grad_q, grad_k, cos, sin))


def test_compiles_fullgraph():
    def attention_inputs(q, k, cos, sin):
        q, k = apply_rope(q, k, cos, sin)
        return q * 2 + 1, k

    q, k = _qk(2, 4, 2, 5, 32)
    q.requires_grad_(), k.requires_grad_()
    cos, sin = _cos_sin(2, 5, 32)
    grad_q, grad_k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    compiled = torch.compile(attention_inputs, fullgraph=True)(q, k, cos, sin)
    eager = attention_inputs(q, k, cos, sin)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(
        torch.autograd.grad(compiled, (q, k), (grad_q, grad_k)),
        torch.autograd.grad(eager, (q, k), (grad_q, grad_k)),
    )


def test_flops_are_counted():
    q, k = _qk(2, 4, 2, 5, 32)
    q.requires_grad_(), k.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        q_out, k_out = apply_rope(q, k, *_cos_sin(2, 5, 16))
        (q_out.sum() + k_out.sum()).backward()
    counts = counter.get_flop_counts()["Global"]
    expected = 3 * 2 * 5 * 16 * (4 + 2)
    assert counts[torch.ops.sloth.rope] == expected and counts[torch.ops.sloth.rope_backward] == expected


@pytest.mark.parametrize(
    ("cos_shape", "match"),
    [
        ((2, 5, 15), "must be even"),
        ((2, 5, 40), "at most head_dim"),
        ((2, 4, 16), "do not match"),
        ((3, 5, 16), "do not match"),
    ],
)
def test_bad_cos_sin_are_named(cos_shape, match):
    q, k = _qk(2, 4, 2, 5, 32)
    with pytest.raises(ValueError, match=match):
        apply_rope(q, k, torch.randn(cos_shape), torch.randn(cos_shape))


def test_cos_sin_needing_grad_are_refused():
    q, k = _qk(1, 2, 2, 3, 8)
    with pytest.raises(ValueError, match="require grad"):
        apply_rope(q, k, torch.randn(1, 3, 8, requires_grad=True), torch.randn(1, 3, 8))


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "n_q_heads", "n_kv_heads"),
    [(64, 64, 4, 2), (80, 80, 3, 1), (128, 64, 2, 2), (256, 256, 40, 1)],  # 40 heads of 256: two head blocks
)
def test_kernels_interpreted(dtype, head_dim, rotary_dim, n_q_heads, n_kv_heads):
    from lightning_sloth.kernels.rope import rope

    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    q, k = _qk(2, n_q_heads, n_kv_heads, 3, head_dim, dtype)
    cos, sin = torch.randn(1, 3, rotary_dim, dtype=dtype), torch.randn(1, 3, rotary_dim, dtype=dtype)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.stride() == q.stride()
    torch.testing.assert_close(
        (q_out, k_out),
        rope_reference(q.float(), k.float(), cos.float(), sin.float()),
        **tolerance,
        check_dtype=False,
    )

    grad_q, grad_k = _qk(2, n_q_heads, n_kv_heads, 3, head_dim, dtype)
    expected = rope_backward_reference(grad_q.float(), grad_k.float(), cos.float(), sin.float())
    torch.testing.assert_close(
        rope(grad_q, grad_k, cos, sin, backward=True), expected, **tolerance, check_dtype=False
    )


@launcher_only
def test_kernels_under_triton_interpreter():
    result = run_interpreted_cases(__file__)
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-5000:] + result.stderr[-2000:]
    )
