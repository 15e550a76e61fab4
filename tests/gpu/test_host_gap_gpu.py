"""GPU checks of the host-gap work: GQA without K/V copies in the varlen backend.

Run on the GPU machine with ``pytest -m gpu tests/gpu/test_host_gap_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_attention_gpu import SEGMENTS, _Layer  # the same odd documents and attention stand-in
from torch.profiler import ProfilerActivity, profile

from lightning_sloth.attention import set_varlen_kv_repeat, sloth_attention_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _default_switches():
    yield
    set_varlen_kv_repeat(False)  # the default: GQA without the K/V copy
    torch._dynamo.reset()


def _packed_kwargs():
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(SEGMENTS), max_length_k=max(SEGMENTS))


def _qkv(heads_q=32, heads_kv=8, head_dim=64, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads):
        x = torch.randn(1, sum(SEGMENTS), heads, head_dim, generator=gen, device="cuda", dtype=dtype)
        return x.transpose(1, 2).requires_grad_()

    return make(heads_q), make(heads_kv), make(heads_kv)


def _rel_err(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _per_document(q, k, v, scale, window=None):
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in SEGMENTS:
        sl = slice(start, start + n)
        pos = torch.arange(n, device=q.device)
        distance = pos[:, None] - pos[None, :]
        mask = distance >= 0
        if window is not None:
            mask &= distance < window
        outs.append(
            F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], attn_mask=mask, scale=scale)
        )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def _run(q, k, v, window=None, sinks=None):
    out, _ = sloth_attention_forward(
        _Layer(q.shape[1] // k.shape[1]),
        q,
        k,
        v,
        None,
        scaling=1 / math.sqrt(q.shape[-1]),
        sliding_window=window,
        s_aux=sinks,
        **_packed_kwargs(),
    )
    return out


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_gqa_without_repeat_matches_float64_and_repeat(head_dim, window):
    q, k, v = _qkv(head_dim=head_dim)
    grad = torch.randn(1, sum(SEGMENTS), 32, head_dim, device="cuda", dtype=torch.bfloat16)
    results = {}
    for repeat in (False, True):
        set_varlen_kv_repeat(repeat)
        out = _run(q, k, v, window)
        results[repeat] = (out, *torch.autograd.grad(out, (q, k, v), grad))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _per_document(q64, k64, v64, 1 / math.sqrt(head_dim), window)
    want = (ref, *torch.autograd.grad(ref, (q64, k64, v64), grad.double()))
    direct, repeated = results[False], results[True]
    assert direct[2].shape == k.shape and direct[3].shape == v.shape
    for name, d, r, w in zip(("out", "dq", "dk", "dv"), direct, repeated, want):
        assert torch.isfinite(d).all(), name
        assert _rel_err(d, w) < 1e-2, (name, _rel_err(d, w))
        # The same flash kernel, only the dk/dv group sum differs in order: the two paths agree closely.
        assert _rel_err(d, r) < 5e-3, (name, _rel_err(d, r))


def _device_events(fn) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_direct_path_copies_no_kv_heads_and_saves_memory():
    q, k, v = _qkv()
    grad = torch.randn(1, sum(SEGMENTS), 32, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.autograd.grad(_run(q, k, v), (q, k, v), grad)

    counts, peaks = {}, {}
    for repeat in (False, True):
        set_varlen_kv_repeat(repeat)
        step()  # warm
        counts[repeat] = len(_device_events(step))
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peaks[repeat] = torch.cuda.max_memory_allocated() - base
    # The repeat path adds the K and V copies in the forward and their reductions in the backward.
    assert counts[False] < counts[True], counts
    assert peaks[False] < peaks[True], peaks


def test_direct_path_with_sinks_matches_repeat():
    q, k, v = _qkv(seed=2)
    sinks = torch.randn(32, device="cuda", dtype=torch.float32, requires_grad=True)
    grad = torch.randn(1, sum(SEGMENTS), 32, 64, device="cuda", dtype=torch.bfloat16)
    results = {}
    for repeat in (False, True):
        set_varlen_kv_repeat(repeat)
        out = _run(q, k, v, 128, sinks)
        results[repeat] = (out, *torch.autograd.grad(out, (q, k, v, sinks), grad))
    for name, d, r in zip(("out", "dq", "dk", "dv", "dsinks"), results[False], results[True]):
        assert _rel_err(d, r) < 5e-3, (name, _rel_err(d, r))


def test_direct_path_compiles_fullgraph_and_matches_eager():
    q, k, v = _qkv(seed=4)
    grad = torch.randn(1, sum(SEGMENTS), 32, 64, device="cuda", dtype=torch.bfloat16)
    eager = _run(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v), grad)
    compiled = torch.compile(_run, fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert _rel_err(out, eager) < 1e-2
    for g, e in zip(grads, eager_grads):
        assert _rel_err(g, e) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_kernel_matches_unfused(dtype, offset):
    from lightning_sloth.ops.rms_norm import add_rms_norm, rms_norm

    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (3, 1001, 2048)

    def make():
        return torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_()

    x, residual = make(), make()
    weight = (1 + 0.3 * torch.randn(2048, generator=gen, device="cuda")).to(dtype).requires_grad_()
    grad_y, grad_s = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    y, s = add_rms_norm(x, residual, weight, 1e-5, offset)
    got = (y, s, *torch.autograd.grad((y, s), (x, residual, weight), (grad_y, grad_s)))
    s_ref = residual + x
    y_ref = rms_norm(s_ref, weight, 1e-5, offset)
    want = (y_ref, s_ref, *torch.autograd.grad((y_ref, s_ref), (x, residual, weight), (grad_y, grad_s)))
    assert torch.equal(s, s_ref) and torch.equal(y, y_ref)  # the same roundings as the two ops
    for name, g, w in zip(("dx", "dresidual", "dweight"), got[2:], want[2:]):
        assert _rel_err(g, w) < (1e-5 if dtype == torch.float32 else 1e-2), (name, _rel_err(g, w))


@pytest.mark.parametrize("offload", ["off", "on"])
def test_transformed_step_matches_the_unfused_repeat_path_and_never_syncs(offload):
    """A packed LoRA step with the defaults (GQA without repeat, add_rms_norm, each checkpointed
    layer one autograd node) gives the loss and gradients of the path before them (K/V repeated,
    add and norm unfused, torch's checkpoint), and a step reads nothing back from the device."""
    import copy

    import _models

    from lightning_sloth.transform import transform_model

    master = _models.tiny_llama(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2
    )
    master = _models.add_lora(master, r=8).to("cuda", torch.bfloat16).train()
    before, after = copy.deepcopy(master), copy.deepcopy(master)
    transform_model(before, kernels={"add_rms_norm": False}, offload=offload, checkpoint_impl="torch")
    transform_model(after, kernels=True, offload=offload)
    docs = _models.random_documents([300, 17, 600, 5, 101], seed=1)
    warm = _models.packed_batch(docs, pad_to=1100).to("cuda")
    step = _models.packed_batch(_models.random_documents([64, 64, 513, 1, 331], seed=2), pad_to=1100).to(
        "cuda"
    )

    def loss_and_grads(model, batch, repeat):
        set_varlen_kv_repeat(repeat)
        model.zero_grad(set_to_none=True)
        loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = loss_and_grads(before, step, True)
    loss_and_grads(after, warm, False)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grads = loss_and_grads(after, step, False)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert _rel_err(grad, ref_grads[name]) < 3e-2, (name, _rel_err(grad, ref_grads[name]))


@pytest.mark.parametrize("offload", ["off", "on"])
def test_grouped_adapter_casts_and_embedding_look_up_bitwise_and_fewer_launches(offload):
    """bf16 autocast, float32 adapters (the benchmark's setting): the grouped adapter casts and the
    first layer's embedding look-up in its backward give the loss of per-call casts and a kept
    embedding output bit for bit and its gradients up to the flash backward's run-to-run spread, with one multi-tensor cast kernel per layer and pass in
    place of 42 single casts, the embedding output freed once the forward returns, and no sync."""
    import copy
    import gc
    import weakref

    import _models

    from lightning_sloth.transform import transform_model

    master = _models.tiny_qwen3(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4
    )
    master = _float_adapters(_models.add_lora(_models_bf16_base(master), r=8)).to("cuda").train()
    grouped, per_call = copy.deepcopy(master), copy.deepcopy(master)
    ckpt = transform_model(grouped, kernels=True, offload=offload).checkpointing
    old = transform_model(per_call, kernels=True, offload=offload).checkpointing
    old.group_adapter_casts = False
    old.rebuild_embedding = False
    assert ckpt.rebuild_embedding
    batch = _models.packed_batch(_models.random_documents([300, 17, 600, 5, 101], seed=1), pad_to=1100).to(
        "cuda"
    )

    def step(model):
        seen = []
        handle = model.get_input_embeddings().register_forward_hook(
            lambda m, i, o: seen.append(weakref.ref(o))
        )
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch.model_inputs(), labels=batch.labels).loss
        gc.collect()
        freed = seen[0]() is None
        loss.backward()
        handle.remove()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, freed

    want_loss, want, kept_freed = step(per_call)
    step(grouped)  # warm
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loss, grads, freed = step(grouped)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert freed and not kept_freed
    assert torch.equal(loss, want_loss)  # the forward is deterministic
    assert grads.keys() == want.keys() and len(grads) == 14 * len(ckpt.layers)
    # The flash backward sums dq with atomics (torch's non-deterministic default): two runs of one
    # path differ in the last bits already, so the gradients are compared to that run-to-run spread.
    again = step(per_call)[1]
    for name in want:
        spread = _rel_err(again[name], want[name])
        assert grads[name].dtype == torch.float32, name
        assert _rel_err(grads[name], want[name]) <= max(4 * spread, 1e-3), (name, spread)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    multi = [n for n in names if "multi_tensor_apply" in n]
    assert len(multi) >= 3 * len(ckpt.layers)  # forward, recompute, gradients: one each per layer


def _models_bf16_base(model):
    """Base weights in bf16 (as the benchmark loads them); the adapters are float32."""
    return model.to(torch.bfloat16)


def _float_adapters(model):
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    return model


@pytest.mark.parametrize("scale", [2.0, 0.5, 4.0])
def test_power_of_two_lora_scale_as_cublas_alpha_is_bitwise(scale):
    """On cuBLAS too: a power-of-two LoRA scale applied as the backward products' alpha gives the
    gradients of scaling the small operands first, bit for bit (bf16, a bench-sized layer)."""
    from lightning_sloth.ops import lora as lora_ops

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    n, fan_in, fan_out, r = 4096, 1024, 3072, 16
    x, weight, lora_a, lora_b, dy = (
        randn(n, fan_in),
        randn(fan_out, fan_in),
        randn(r, fan_in),
        randn(fan_out, r),
        randn(n, fan_out),
    )
    xa = x @ lora_a.t()
    g = (dy @ lora_b) * scale
    want = ((dy @ weight).addmm_(g, lora_a), g.t() @ x, dy.t() @ (xa * scale))
    got = lora_ops._lora_linear_backward_op(dy, x, xa, weight, lora_a, lora_b, scale, True, True, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    target = x.clone()
    da, db = lora_ops._lora_linear_backward_inplace_op(
        dy, target, xa, weight, lora_a, lora_b, scale, True, True
    )
    for a, b in zip((target, da, db), want):
        assert torch.equal(a, b)


def test_packed_qwen3_backward_copies_no_activation():
    """The varlen layout is a view (``squeeze``, not ``x[0]``), so no backward builds a zero
    tensor for an index and copies into it, and the q/k/v gradients reach the norms and projections
    in their memory order: no ``SelectBackward0`` and no activation-sized clone or copy in the
    backward of a packed Qwen3 LoRA step's layers (there were 3 of each per layer; the loss's two
    casts remain); nor zero gradients for the ops' side outputs."""
    import _models

    from lightning_sloth.transform import transform_model

    model = _models.tiny_qwen3(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4
    )
    model = _float_adapters(_models.add_lora(_models_bf16_base(model), r=8)).to("cuda").train()
    transform_model(model, kernels=True)
    batch = _models.packed_batch(_models.random_documents([300, 17, 600, 5, 101], seed=1), pad_to=1100).to(
        "cuda"
    )
    big = 1100 * 256  # an activation: tokens x hidden

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    events = prof.events()
    nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    assert nodes and not [n for n in nodes if "SelectBackward" in n.name]

    def node_of(e):
        inside = [n for n in nodes if n.time_range.start <= e.time_range.start <= n.time_range.end]
        return min(inside, key=lambda n: n.time_range.end - n.time_range.start).name if inside else None

    def inside_backward(e):
        return node_of(e) is not None

    copies = [
        (e.name, node_of(e))
        for e in events
        if e.name in ("aten::clone", "aten::copy_")
        and e.input_shapes
        and e.input_shapes[0]
        and math.prod(e.input_shapes[0]) >= big
        and inside_backward(e)
    ]
    # The loss's backward scales the hidden states' gradient in float32 (two casts, once per step).
    assert [c for c in copies if "linear_cross_entropy" not in c[1]] == [], copies
    assert len(copies) <= 2, copies
    zeros = [node_of(e) for e in events if e.name == "aten::zeros" and inside_backward(e)]
    assert not [z for z in zeros if "lora_linear" in z or "rms_norm" in z], zeros
