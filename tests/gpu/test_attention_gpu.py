"""Packed attention on CUDA: bf16 backends, float32, no device->host sync, a Llama-3.2-1B-shaped run.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_attention_gpu.py``.
"""

from __future__ import annotations

import copy
import math
import warnings

import _models  # tests/_models.py: tests/ is on sys.path through tests/conftest.py
import pytest
import torch
import torch.nn.functional as F

from lightning_sloth.attention import (
    enable_packed_attention,
    set_packed_attention_backend,
    sloth_attention_forward,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# Odd lengths, single tokens, one document longer than a flex tile row; 2024 tokens in all.
SEGMENTS = [1, 129, 300, 77, 511, 3, 1003]


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from the default backend and no compiled flex graphs (keeps under the recompile limit)."""
    torch._dynamo.reset()
    yield
    set_packed_attention_backend("auto")
    torch._dynamo.reset()


def cu_from(segments):
    return torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def packed_kwargs(segments):
    cu = cu_from(segments)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(segments), max_length_k=max(segments))


def qkv(seq_len, head_dim, dtype, heads_q=8, heads_kv=2, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads):
        x = torch.randn(1, seq_len, heads, head_dim, generator=gen, device="cuda", dtype=dtype).transpose(
            1, 2
        )
        return x.requires_grad_()

    return make(heads_q), make(heads_kv), make(heads_kv)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def per_document_sdpa(q, k, v, segments, scale, window=None, dtype=None):
    """Reference ``[1, T, Hq, D]``: SDPA on each document alone (in ``dtype`` if given)."""
    groups = q.shape[1] // k.shape[1]
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in segments:
        sl = slice(start, start + n)
        if window is None:
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, scale=scale
                )
            )
        else:
            pos = torch.arange(n, device=q.device)
            distance = pos[:, None] - pos[None, :]
            mask = (distance >= 0) & (distance < window)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, sl], k[:, :, sl], v[:, :, sl], attn_mask=mask, scale=scale
                )
            )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def run_and_reference(backend, dtype, head_dim, window=None, ref_dtype=None):
    """Packed forward+backward and per-document reference forward+backward on the same inputs."""
    set_packed_attention_backend(backend)
    q, k, v = qkv(sum(SEGMENTS), head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, _ = sloth_attention_forward(
        _Layer(q.shape[1] // k.shape[1]),
        q,
        k,
        v,
        None,
        scaling=scale,
        sliding_window=window,
        **packed_kwargs(SEGMENTS),
    )
    grad = torch.randn(
        out.shape, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(1)
    )
    out.backward(grad)
    q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = per_document_sdpa(q_ref, k_ref, v_ref, SEGMENTS, scale, window, ref_dtype)
    ref.backward(grad.to(ref.dtype))
    return (out, q.grad, k.grad, v.grad), (ref, q_ref.grad, k_ref.grad, v_ref.grad)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_bf16_packed_matches_per_document_sdpa(backend, head_dim):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="packed attention backend")  # no fallback: the backend runs
        got, want = run_and_reference(backend, torch.bfloat16, head_dim)
    assert got[0].shape == (1, sum(SEGMENTS), 8, head_dim) and got[0].dtype == torch.bfloat16
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))


@pytest.mark.parametrize("shared_kv", [False, True])
@pytest.mark.parametrize("backend", ["auto", "varlen"])
def test_bf16_wide_heads_run_the_efficient_varlen_kernel(backend, shared_kv, monkeypatch):
    """Heads over flash's 256 (Gemma 4's 512-dim global layers, GQA, K shared as V there): the
    memory-efficient kernel's varlen mode, never the masked SDPA, equals each document alone."""
    import lightning_sloth.attention.packed as packed

    def refuse(*args, **kwargs):
        raise AssertionError("wide heads fell back to the masked sdpa")

    monkeypatch.setattr(packed, "sdpa_packed", refuse)
    set_packed_attention_backend(backend)
    q, k, v = qkv(sum(SEGMENTS), 512, torch.bfloat16, seed=5)
    v = k if shared_kv else v
    scale = 1 / math.sqrt(512)
    out, _ = sloth_attention_forward(_Layer(4), q, k, v, None, scaling=scale, **packed_kwargs(SEGMENTS))
    assert out.shape == (1, sum(SEGMENTS), 8, 512) and out.dtype == torch.bfloat16
    grad = torch.randn(
        out.shape, device="cuda", dtype=out.dtype, generator=torch.Generator("cuda").manual_seed(1)
    )
    out.backward(grad)
    q_ref, k_ref = (t.detach().double().requires_grad_() for t in (q, k))
    v_ref = k_ref if shared_kv else v.detach().double().requires_grad_()
    ref = per_document_sdpa(q_ref, k_ref, v_ref, SEGMENTS, scale)
    ref.backward(grad.double())
    pairs = [("out", out, ref), ("dq", q.grad, q_ref.grad), ("dk", k.grad, k_ref.grad)]
    if not shared_kv:
        pairs.append(("dv", v.grad, v_ref.grad))
    for name, g, w in pairs:
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_bf16_sliding_window(backend):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="packed attention backend")
        got, want = run_and_reference(backend, torch.bfloat16, 64, window=64)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_bf16_autocast_with_float32_qk_uses_the_backend(backend):
    """bf16-mixed: rotary leaves q/k float32; the function casts like SDPA's autocast rule and runs the backend."""
    set_packed_attention_backend(backend)
    q, k, v = qkv(sum(SEGMENTS), 64, torch.float32, seed=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="packed attention backend")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = sloth_attention_forward(
                _Layer(4), q, k, v.bfloat16(), None, scaling=0.125, **packed_kwargs(SEGMENTS)
            )
    assert out.dtype == torch.bfloat16
    want = per_document_sdpa(q.detach(), k.detach(), v.detach(), SEGMENTS, 0.125, dtype=torch.float64)
    assert rel_err(out, want) < 2e-2


@pytest.mark.parametrize("backend", ["auto", "varlen", "flex"])
def test_float32_on_cuda_is_exact(backend):
    """float32 stays float32: varlen (fp16/bf16 only) falls back to the masked SDPA, flex runs fp32."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="packed attention backend")
        got, want = run_and_reference(backend, torch.float32, 64, ref_dtype=torch.float64)
    assert got[0].dtype == torch.float32
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 2e-4, (name, rel_err(g, w))


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_bf16_tiny_llama_loss_matches_documents_alone(backend):
    set_packed_attention_backend(backend)
    model = _models.tiny_llama(hidden_size=256, intermediate_size=512, max_position_embeddings=2048).to(
        "cuda", torch.bfloat16
    )
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    docs = _models.random_documents(SEGMENTS, seed=5)
    batch = _models.packed_batch(docs, pad_to=2048).to("cuda")
    with torch.no_grad():
        loss = packed(**batch.model_inputs(), labels=batch.labels).loss
        total = 0.0
        for doc in docs:
            tokens = torch.tensor([doc], device="cuda")
            logits = model(input_ids=tokens).logits[0, :-1].float()
            total += F.cross_entropy(logits, tokens[0, 1:], reduction="sum")
    ref = total / batch.num_target_tokens
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-2


def _packed_loss(model, batch) -> torch.Tensor:
    """Mean next-token loss over the batch's targets, written without host reads."""
    logits = model(**batch.model_inputs()).logits[0, :-1].float()
    labels = batch.labels[0, 1:]
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return -(logp * (labels != -100)).sum() / batch.num_target_tokens


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_packed_step_never_syncs(backend):
    set_packed_attention_backend(backend)
    model = _models.tiny_llama(hidden_size=256, intermediate_size=512, max_position_embeddings=2048)
    model = _models.add_lora(model, r=8).to("cuda", torch.bfloat16).train()
    enable_packed_attention(model)
    warm = _models.packed_batch(_models.random_documents([300, 17, 600, 5, 101], seed=1), pad_to=1100).to(
        "cuda"
    )
    # A different batch of the same capacity: its masks are new, so building them is checked too.
    step = _models.packed_batch(_models.random_documents([64, 64, 513, 1, 331], seed=2), pad_to=1100).to(
        "cuda"
    )
    _packed_loss(model, warm).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            loss = _packed_loss(model, step)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.isfinite(loss).item()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and torch.isfinite(g).all() for g in lora_grads)


def test_llama_1b_shape_trains_with_lora_and_checkpointing():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(_models.LORA_TARGETS)))
    enable_packed_attention(model)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-3)

    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        lengths = torch.randint(64, 2048, (12,), generator=gen).tolist()
        while sum(lengths) > 8192:
            lengths.pop()
        docs = _models.random_documents(lengths, seed=len(batches), vocab=config.vocab_size)
        batches.append(_models.packed_batch(docs, pad_to=8192).to("cuda"))

    losses = []
    for step in range(6):
        batch = batches[step % 2]
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
        assert all(torch.isfinite(g).all() for g in grads.values())
        # lora_B starts at 0, so lora_A's first gradient is 0; after one update both move.
        for part in ("lora_B",) if step == 0 else ("lora_A", "lora_B"):
            assert sum(g.float().norm() for n, g in grads.items() if part in n) > 0, (step, part)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[4] < losses[0], losses  # the same batch after four updates


# ---- GPT-OSS: per-head attention sinks (s_aux) and sliding-window layers ------------------------


def per_document_sinks(q, k, v, sinks, segments, scale, window=None):
    """float64 reference ``[1, T, Hq, D]``: each document alone, the sink as an extra logit column."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in segments:
        sl = slice(start, start + n)
        scores = q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) * scale
        pos = torch.arange(n, device=q.device)
        distance = pos[:, None] - pos[None, :]
        keep = distance >= 0
        if window is not None:
            keep &= distance < window
        scores = scores.masked_fill(~keep, -math.inf)
        column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        outs.append(torch.cat([scores, column], -1).softmax(-1)[..., :-1] @ v[:, :, sl])
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def random_sinks(heads: int, seed: int = 2) -> torch.Tensor:
    """float32 sinks near the rows' log-sum-exp (about 3-8 here), so ``sigmoid(lse - sink)`` is far from 0 and 1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (4 + 1.5 * torch.randn(heads, generator=gen, device="cuda")).requires_grad_()


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_bf16_sinks_match_per_document_reference(backend, window):
    set_packed_attention_backend(backend)
    q, k, v = qkv(sum(SEGMENTS), 64, torch.bfloat16, seed=4)
    sinks = random_sinks(8)
    kwargs = dict(scaling=0.125, sliding_window=window, **packed_kwargs(SEGMENTS))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="packed attention backend")
        out, _ = sloth_attention_forward(_Layer(4), q, k, v, None, s_aux=sinks, **kwargs)
    assert out.shape == (1, sum(SEGMENTS), 8, 64) and out.dtype == torch.bfloat16
    grad = torch.randn(
        out.shape,
        device="cuda",
        dtype=torch.bfloat16,
        generator=torch.Generator(device="cuda").manual_seed(5),
    )
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = per_document_sinks(*leaves, SEGMENTS, 0.125, window)
    ref.backward(grad.double())
    with torch.no_grad():  # the sinks carry real weight: without them the output is far off
        plain, _ = sloth_attention_forward(_Layer(4), q, k, v, None, **kwargs)
    assert rel_err(plain, ref) > 0.1
    got = (out, q.grad, k.grad, v.grad, sinks.grad)
    want = (ref, *(t.grad for t in leaves))
    assert sinks.grad.dtype == torch.float32
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))


def test_compiled_varlen_sinks_match_eager():
    """The sink path compiles in one graph with the flash ops inside, as in compiled decoder layers."""
    set_packed_attention_backend("varlen")
    q, k, v = qkv(sum(SEGMENTS), 64, torch.bfloat16, seed=6)
    sinks = random_sinks(8, seed=7)
    kwargs = packed_kwargs(SEGMENTS)

    def attend(q, k, v, sinks):
        return sloth_attention_forward(
            _Layer(4), q, k, v, None, scaling=0.125, sliding_window=64, s_aux=sinks, **kwargs
        )[0]

    grad = torch.randn(
        1,
        sum(SEGMENTS),
        8,
        64,
        device="cuda",
        dtype=torch.bfloat16,
        generator=torch.Generator(device="cuda").manual_seed(8),
    )
    eager = attend(q, k, v, sinks)
    eager.backward(grad)
    eager_grads = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    out = torch.compile(attend, fullgraph=True)(q, k, v, sinks)
    out.backward(grad)
    assert rel_err(out, eager) < 1e-2
    for name, t, want in zip(("dq", "dk", "dv", "dsinks"), (q, k, v, sinks), eager_grads):
        assert rel_err(t.grad, want) < 1e-2, (name, rel_err(t.grad, want))


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_sinks_and_window_never_sync(backend):
    set_packed_attention_backend(backend)
    sinks = random_sinks(8, seed=9)

    def prepare(segments, seed):
        q, k, v = qkv(sum(segments), 64, torch.bfloat16, seed=seed)
        return (q, k, v), dict(scaling=0.125, sliding_window=64, s_aux=sinks, **packed_kwargs(segments))

    def step(tensors, kwargs):
        out, _ = sloth_attention_forward(_Layer(4), *tensors, None, **kwargs)
        out.float().square().mean().backward()

    warm = prepare([300, 17, 600, 5, 101, 1001], 10)
    new = prepare([64, 64, 513, 1, 331, 1051], 11)  # same length, new boundaries: masks are rebuilt
    step(*warm)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            step(*new)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.isfinite(sinks.grad).all() and sinks.grad.abs().sum() > 0


def tiny_gpt_oss_cuda():
    """float32 GPT-OSS on CUDA: hidden 256, head_dim 64, one sliding (window 128) and one full layer,
    eager attention and experts, sinks set off zero."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=_models.VOCAB,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        # Every token uses every expert: no discrete top-k choice for bf16 rounding to flip.
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=2048,
        initializer_range=0.05,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(3 + torch.randn(4))
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    return model.to("cuda").eval()


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_bf16_gpt_oss_packed_matches_documents_alone(backend):
    """bf16 packed GPT-OSS vs each document alone through transformers' eager attention in float32
    (same bf16-rounded weights): the loss, and the gradients of the sinks and q/k/v projections at
    most twice as far from float32 as transformers' own bf16 eager run of the same documents (bf16
    rounding elsewhere in the model alone moves them by several percent)."""
    set_packed_attention_backend(backend)
    reference = tiny_gpt_oss_cuda()
    eager_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    with torch.no_grad():
        for ref_param, param in zip(reference.parameters(), eager_bf16.parameters()):
            ref_param.copy_(param.float())
    packed = copy.deepcopy(eager_bf16)
    enable_packed_attention(packed)
    docs = _models.random_documents(SEGMENTS, seed=12)
    batch = _models.packed_batch(docs, pad_to=2048).to("cuda")

    loss = packed(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    ref_losses = {}
    for model in (reference, eager_bf16):
        total = 0.0
        for doc in docs:
            tokens = torch.tensor([doc], device="cuda")
            logits = model(input_ids=tokens).logits[0, :-1].float()
            total = total + F.cross_entropy(logits, tokens[0, 1:], reduction="sum")
        ref_losses[model] = total / batch.num_target_tokens
        ref_losses[model].backward()

    ref_loss = ref_losses[reference].item()
    assert abs(loss.item() - ref_loss) / ref_loss < 1e-2
    ref_params, bf16_params = dict(reference.named_parameters()), dict(eager_bf16.named_parameters())
    checked = 0
    for name, param in packed.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "sinks")):
            assert torch.isfinite(param.grad).all(), name
            err = rel_err(param.grad, ref_params[name].grad)
            eager_err = rel_err(bf16_params[name].grad, ref_params[name].grad)
            assert err < max(2 * eager_err, 2e-2), (name, err, eager_err)
            checked += 1
    assert checked == 2 * 4
