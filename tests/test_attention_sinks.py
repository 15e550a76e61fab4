"""GPT-OSS attention in the packed "sloth" path: per-head sinks (``s_aux``) and sliding windows.

The function is checked against a float64 per-document reference with the sink as an extra logit
column; the whole model against transformers' eager GPT-OSS attention on the same weights, one
document at a time.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from _models import packed_batch, random_documents
from transformers import GptOssConfig, GptOssForCausalLM

from lightning_sloth.attention import (
    enable_packed_attention,
    masked,
    set_packed_attention_backend,
    sloth_attention_forward,
    varlen,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

# Odd lengths, a single-token document, and a trailing padding segment (3 tokens).
SEGMENTS = [7, 1, 13, 5, 3]
LENGTHS = [9, 1, 17, 6]  # documents of the whole-model tests, all but one longer than WINDOW
PAD_TO = 40
WINDOW = 4


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.fixture
def backend():
    yield set_packed_attention_backend
    set_packed_attention_backend("auto")


def cu_from(segments: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)


def packed_kwargs(segments: list[int]) -> dict:
    cu = cu_from(segments)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(segments), max_length_k=max(segments))


def inputs(seq_len: int, head_dim: int = 16, batch: int = 1, seed: int = 0, dtype=torch.float32):
    """q ``[B, 4, T, D]``, k/v ``[B, 2, T, D]`` (transposed views, as transformers makes them), sinks ``[4]``."""
    gen = torch.Generator().manual_seed(seed)

    def make(heads):
        return torch.randn(batch, seq_len, heads, head_dim, generator=gen, dtype=dtype).transpose(1, 2)

    q, k, v = make(4), make(2), make(2)
    sinks = torch.randn(4, generator=gen, dtype=dtype) * 2
    return tuple(t.requires_grad_() for t in (q, k, v, sinks))


def reference(q, k, v, sinks, segments, scale, window=None) -> torch.Tensor:
    """float64 sink attention document by document: ``[1, T, Hq, D]``."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in segments:
        sl = slice(start, start + n)
        scores = q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) * scale
        pos = torch.arange(n)
        distance = pos[:, None] - pos[None, :]
        keep = distance >= 0
        if window is not None:
            keep &= distance < window
        scores = scores.masked_fill(~keep, -math.inf)
        column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        outs.append(probs @ v[:, :, sl])
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def float64_leaves(*tensors):
    return tuple(t.detach().double().requires_grad_() for t in tensors)


def assert_grads_close(got, want, rtol=1e-5):
    for index, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.grad.double(), w.grad, rtol=rtol, atol=rtol, msg=f"input {index}")


@pytest.mark.parametrize("window", [None, WINDOW])
def test_packed_sinks_match_reference_forward_and_backward(window):
    seq_len = sum(SEGMENTS)
    q, k, v, sinks = inputs(seq_len)
    out, _ = sloth_attention_forward(
        _Layer(2), q, k, v, None, scaling=0.25, sliding_window=window, s_aux=sinks, **packed_kwargs(SEGMENTS)
    )
    assert out.shape == (1, seq_len, 4, 16) and out.dtype == torch.float32
    leaves = float64_leaves(q, k, v, sinks)
    ref = reference(*leaves, SEGMENTS, 0.25, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # The sinks move the output: without them it is plain attention.
    plain, _ = sloth_attention_forward(
        _Layer(2), q, k, v, None, scaling=0.25, sliding_window=window, **packed_kwargs(SEGMENTS)
    )
    assert (plain - out).abs().max() > 1e-2

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad_out)
    ref.backward(grad_out.double())
    assert_grads_close((q, k, v, sinks), leaves)


def _flash_like_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):
    """CPU float64 stand-in with the flash varlen contract: ``[T, H, D]`` in, ``lse [Hq, T]`` out."""
    p, lse = _probs(q, k, cu_q, scale, window_left)
    out = torch.einsum("hts,shd->thd", p, _repeat(v, q.shape[1]).double()).to(q.dtype)
    return out, lse.float(), torch.empty(2), torch.empty(0)


def _flash_like_backward(
    grad, q, k, v, out, lse, rng_state, unused, cu_q, cu_k, max_q, max_k, scale, window_left
):
    """The flash backward: ``P`` from the saved ``lse``, row term ``D = rowsum(grad * out)`` from its inputs."""
    scores = _scores(q, k, cu_q, scale, window_left)
    p = (scores - lse.double()[..., None]).exp()
    g, vr = grad.double(), _repeat(v, q.shape[1]).double()
    dv = torch.einsum("hts,thd->shd", p, g)
    dp = torch.einsum("thd,shd->hts", g, vr)
    row = (g * out.double()).sum(-1).transpose(0, 1)
    ds = p * (dp - row[..., None]) * scale
    dq = torch.einsum("hts,shd->thd", ds, _repeat(k, q.shape[1]).double())
    dk = torch.einsum("hts,thd->shd", ds, q.double())
    groups = q.shape[1] // k.shape[1]
    fold = lambda x: x.unflatten(1, (k.shape[1], groups)).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _repeat(x, heads):
    return x.repeat_interleave(heads // x.shape[1], 1)


def _scores(q, k, cu, scale, window_left):
    seq_len = q.shape[0]
    window = None if window_left < 0 else window_left + 1
    mask = masked.document_causal_mask(cu, seq_len, window)
    scores = torch.einsum("thd,shd->hts", q.double(), _repeat(k, q.shape[1]).double()) * scale
    return scores.masked_fill(~mask, -math.inf)


def _probs(q, k, cu, scale, window_left):
    scores = _scores(q, k, cu, scale, window_left)
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp(), lse


@pytest.mark.parametrize("window", [None, WINDOW])
def test_varlen_sink_function_with_flash_semantics(monkeypatch, window):
    """The CUDA path's gate and its backward (lse gradient folded into the flash row term), run on
    CPU with a stand-in that honours the flash kernels' contract."""
    monkeypatch.setattr(varlen, "_flash_varlen_forward", _flash_like_forward)
    monkeypatch.setattr(varlen, "_flash_varlen_backward", _flash_like_backward)
    seq_len = sum(SEGMENTS)
    q, k, v, sinks = inputs(seq_len, seed=2)
    cu = cu_from(SEGMENTS)
    out = varlen.varlen_packed(q, k, v, cu, cu, max(SEGMENTS), max(SEGMENTS), 0.25, window, sinks)
    leaves = float64_leaves(q, k, v, sinks)
    ref = reference(*leaves, SEGMENTS, 0.25, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad_out)
    ref.backward(grad_out.double())
    assert_grads_close((q, k, v, sinks), leaves)


def test_varlen_sink_function_compiles_fullgraph(monkeypatch):
    """Dynamo traces the CUDA path's autograd.Function in one graph (it runs inside compiled layers)."""
    monkeypatch.setattr(varlen, "_flash_varlen_forward", _flash_like_forward)
    monkeypatch.setattr(varlen, "_flash_varlen_backward", _flash_like_backward)
    q, k, v, sinks = inputs(sum(SEGMENTS), seed=8)
    cu = cu_from(SEGMENTS)

    def attend(q, k, v, sinks):
        return varlen.varlen_packed(q, k, v, cu, cu, max(SEGMENTS), max(SEGMENTS), 0.25, WINDOW, sinks)

    grad_out = torch.randn(sum(SEGMENTS), 4, 16, generator=torch.Generator().manual_seed(9))[None]
    attend(q, k, v, sinks).backward(grad_out)
    eager_grads = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    torch._dynamo.reset()
    try:
        out = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
        out.backward(grad_out)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, attend(q, k, v, sinks), rtol=1e-6, atol=1e-6)
    for t, want in zip((q, k, v, sinks), eager_grads):
        torch.testing.assert_close(t.grad, want, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, WINDOW])
def test_flex_backend_with_sinks_forward_matches_reference(backend, window):
    backend("flex")
    q, k, v, sinks = inputs(sum(SEGMENTS), seed=4)
    with torch.no_grad():  # CPU flex has no backward
        out, _ = sloth_attention_forward(
            _Layer(2),
            q,
            k,
            v,
            None,
            scaling=0.25,
            sliding_window=window,
            s_aux=sinks,
            **packed_kwargs(SEGMENTS),
        )
        want = reference(q, k, v, sinks, SEGMENTS, 0.25, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_unpacked_rows_with_sinks_match_reference(window):
    q, k, v, sinks = inputs(11, batch=2, seed=5)
    out, _ = sloth_attention_forward(
        _Layer(2), q, k, v, None, scaling=0.25, sliding_window=window, s_aux=sinks
    )
    leaves = float64_leaves(q, k, v, sinks)
    ref = torch.cat(
        [reference(*(t[i : i + 1] for t in leaves[:3]), leaves[3], [11], 0.25, window) for i in (0, 1)]
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    out.backward(grad_out)
    ref.backward(grad_out.double())
    assert_grads_close((q, k, v, sinks), leaves)


def test_unpacked_sinks_honour_a_4d_mask_and_fully_masked_rows_stay_finite():
    q, k, v, sinks = inputs(9, batch=2, seed=7)
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    mask[0, :, :, :3] = False  # row 0 is left-padded by 3: its first 3 queries see no key at all
    out, _ = sloth_attention_forward(_Layer(2), q, k, v, mask, scaling=0.25, s_aux=sinks)
    assert torch.isfinite(out).all()
    assert out[0, :3].abs().max() == 0  # all weight on the sink, whose value is zero
    want = reference(q[:, :, 3:][:1], k[:, :, 3:][:1], v[:, :, 3:][:1], sinks, [6], 0.25)
    torch.testing.assert_close(out[:1, 3:].double(), want, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out_add, _ = sloth_attention_forward(_Layer(2), q, k, v, additive, scaling=0.25, s_aux=sinks)
    torch.testing.assert_close(out_add[:, 3:], out[:, 3:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "bad", [torch.zeros(3), torch.zeros(1, 4), torch.zeros(4, dtype=torch.int64), [0.0] * 4]
)
def test_bad_sinks_raise(bad):
    q, k, v, _ = inputs(sum(SEGMENTS))
    with pytest.raises(ValueError, match="one logit per query head"):
        sloth_attention_forward(_Layer(2), q, k, v, None, s_aux=bad, **packed_kwargs(SEGMENTS))


# ---- whole model: GPT-OSS with sloth attention vs transformers' eager attention ---------------


def tiny_gpt_oss(seed: int = 0, **overrides) -> GptOssForCausalLM:
    """float32 GPT-OSS, hidden 64, 4 layers alternating sliding (window 4) and full attention, 4
    experts (top-2), eager attention and experts, random non-zero sinks, eval mode."""
    config = GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        initializer_range=0.15,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        **overrides,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 1.5)
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    return model


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def document_loss_sum(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].double(), tokens[1:], reduction="sum")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_gpt_oss_packed_documents_match_eager_alone():
    model = tiny_gpt_oss()
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    docs = random_documents(LENGTHS, seed=1)
    with torch.no_grad():
        logits = packed(**packed_batch(docs, pad_to=PAD_TO).model_inputs()).logits[0]
        for (start, end), doc in zip(spans(LENGTHS), docs):
            alone = model(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(logits[start:end], alone, rtol=1e-5, atol=1e-5)


def test_gpt_oss_packed_loss_and_gradients_match_eager(monkeypatch):
    builds = []
    original = masked.document_causal_mask
    monkeypatch.setattr(masked, "document_causal_mask", lambda *a: builds.append(a) or original(*a))
    reference_model = tiny_gpt_oss(seed=1).train()
    packed = copy.deepcopy(reference_model)
    enable_packed_attention(packed)
    docs = random_documents(LENGTHS, seed=2)
    batch = packed_batch(docs, pad_to=PAD_TO)

    loss = packed(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    total = sum(
        document_loss_sum(reference_model(input_ids=torch.tensor([doc])).logits[0], torch.tensor(doc))
        for doc in docs
    )
    ref_loss = total / batch.num_target_tokens
    ref_loss.backward()

    # One mask per window size (full and sliding layers) for the whole batch, forward and backward.
    assert sorted(str(b[2]) for b in builds) == sorted(["None", str(WINDOW)])
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    grads = dict(packed.named_parameters())
    checked = 0
    for name, param in reference_model.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name
        assert rel_err(grads[name].grad, param.grad) <= 1e-5, (name, rel_err(grads[name].grad, param.grad))
        checked += any(part in name for part in ("q_proj", "k_proj", "v_proj", "sinks"))
    assert checked == 4 * 7  # q/k/v weight and bias, sinks, in 4 layers


@pytest.mark.parametrize("with_padding_mask", [False, True])
def test_gpt_oss_unpacked_rows_match_eager(with_padding_mask):
    """Unpacked batches (e.g. validation rows) through "sloth" equal eager, right padding included."""
    model = tiny_gpt_oss(seed=3)
    ours = copy.deepcopy(model)
    enable_packed_attention(ours)
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if with_padding_mask:
        mask[1, 9:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
