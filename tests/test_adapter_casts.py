"""One grouped cast of a decoder layer's LoRA adapters per pass (``lightning_sloth.ops.lora_layers.adapter_casts``).

Under autocast, float32 adapters are cast to the compute dtype by every fused LoRA call and their
gradients cast back by one autograd node each; inside a checkpointed layer that is one
``_foreach_copy_`` per pass instead, with the same values bit for bit.
"""

import copy

import _models  # tests/_models.py
import pytest
import torch
from torch import nn

from lightning_sloth.ops import lora_layers
from lightning_sloth.transform import transform_model


def test_grouped_cast_equals_per_weight_casts_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    weights = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((4, 16), (24, 4), (4, 24))]
    upstream = [torch.randn(w.shape, generator=gen, dtype=torch.bfloat16) for w in weights]
    copies = lora_layers._CastAdapters.apply(torch.bfloat16, *weights)
    for w, c in zip(weights, copies):
        assert c.dtype == torch.bfloat16 and torch.equal(c, w.to(torch.bfloat16))
    torch.autograd.backward(list(copies[:2]), upstream[:2])  # the third gets no gradient
    got = [w.grad for w in weights]
    for w in weights:
        w.grad = None
    torch.autograd.backward([w.to(torch.bfloat16) for w in weights[:2]], upstream[:2])
    for g, w in zip(got[:2], weights[:2]):
        assert g.dtype == torch.float32 and torch.equal(g, w.grad)
    assert got[2] is None


def _lora_qwen3():
    return _models.add_lora(_models.tiny_qwen3(), r=4).train()


@pytest.mark.parametrize("impl", ["node", "torch"])
def test_checkpointed_layers_cast_their_adapters_once_per_pass(impl, monkeypatch):
    """A packed LoRA step under bf16 autocast through transform_model(kernels=True): each layer casts
    its fourteen float32 adapters in one grouped cast in the forward, one in the recompute and one
    for their gradients in the backward, no fused LoRA call casts an adapter itself, and the loss
    and gradients equal those of per-call casts bit for bit."""
    master = _lora_qwen3()
    grouped, per_call = copy.deepcopy(master), copy.deepcopy(master)
    report = transform_model(grouped, kernels=True, checkpoint_impl=impl)
    layers = len(report.checkpointing.layers)
    assert all(len(modules) == 7 for modules in report.checkpointing._adapters)
    per_call_ckpt = transform_model(per_call, kernels=True, checkpoint_impl=impl).checkpointing
    per_call_ckpt.group_adapter_casts = False  # the reference: per-call casts
    batch = _models.packed_batch(_models.random_documents([37, 5, 60, 18], seed=3))

    groups, own_casts = [], []
    foreach_cast, cast = lora_layers._foreach_cast, lora_layers.cast_adapter

    def counted_group(tensors, dtype):
        groups.append(len(tensors))
        return foreach_cast(tensors, dtype)

    def counted_cast(tensor, dtype, copies):
        if isinstance(tensor, nn.Parameter) and tensor.requires_grad and id(tensor) not in (copies or {}):
            own_casts.append(tuple(tensor.shape))
        return cast(tensor, dtype, copies)

    monkeypatch.setattr(lora_layers, "_foreach_cast", counted_group)
    monkeypatch.setattr(lora_layers, "cast_adapter", counted_cast)

    def step(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(grouped)
    assert groups == [14] * (3 * layers) and own_casts == []
    groups.clear()
    want_loss, want = step(per_call)
    assert groups == [] and len(own_casts) == 2 * 7 * 2 * layers  # A and B, 7 layers, forward + recompute
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want.keys() and len(grads) == 14 * layers
    for name in want:
        assert grads[name].dtype == torch.float32
        assert torch.equal(grads[name], want[name]), name


def test_no_grouping_outside_autocast_or_for_adapters_in_the_compute_dtype():
    model = _lora_qwen3()
    modules = transform_model(model, kernels=True).checkpointing._adapters[0]
    with lora_layers.adapter_casts(modules):
        assert getattr(lora_layers.ADAPTER_CASTS, "copies", None) is None  # no autocast: nothing to cast
    with torch.autocast("cpu", dtype=torch.bfloat16), lora_layers.adapter_casts(modules):
        copies = lora_layers.ADAPTER_CASTS.copies
        assert len(copies) == 14 and all(c.dtype == torch.bfloat16 for c in copies.values())
    assert getattr(lora_layers.ADAPTER_CASTS, "copies", None) is None
    model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), lora_layers.adapter_casts(modules):
        assert getattr(lora_layers.ADAPTER_CASTS, "copies", None) is None  # already bf16


def _zeros_in_backward_nodes(model, batch) -> dict[str, int]:
    """``aten::zeros`` calls inside each autograd node's evaluation during one step's backward."""
    import collections

    model.zero_grad(set_to_none=True)
    loss = model(**batch.model_inputs(), labels=batch.labels).loss
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    events = prof.events()
    nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    counts: collections.Counter = collections.Counter()
    for e in events:
        if e.name == "aten::zeros":
            inside = [n for n in nodes if n.time_range.start <= e.time_range.start <= n.time_range.end]
            name = min(inside, key=lambda n: n.time_range.end - n.time_range.start).name if inside else "?"
            counts[name.split(": ")[-1]] += 1
    return dict(counts)


def test_eager_ops_make_no_zero_gradients_for_their_side_outputs():
    """The eager path hands None, not a fresh zero tensor, to a backward for outputs nothing
    differentiates (the LoRA op's saved product, the norms' rstd): no ``aten::zeros`` in those
    backward nodes (they were 7 LoRA + 3 norm + 1 fused-norm launches per Qwen3 layer)."""
    model = _lora_qwen3()
    transform_model(model, kernels=True, gradient_checkpointing=False)
    batch = _models.packed_batch(_models.random_documents([37, 5, 60, 18], seed=3))
    zeros = _zeros_in_backward_nodes(model, batch)
    assert not any("lora_linear" in n or "rms_norm" in n for n in zeros), zeros


def test_ddp_reduces_the_grouped_casts_gradients():
    """Under DDP (one gloo process) the adapters' gradients, views of one buffer from the grouped
    cast's backward, reach the reducer: two bf16-autocast steps give the gradients of the same model
    without DDP, bit for bit, with DDP's gradient buckets as views or not."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    batch = _models.packed_batch(_models.random_documents([37, 5, 60, 18], seed=3))

    def step(model, wrapper):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = wrapper(**batch.model_inputs(), labels=batch.labels).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    master = _lora_qwen3()
    plain = copy.deepcopy(master)
    transform_model(plain, kernels=True)
    want = step(plain, plain)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", world_size=1, rank=0)
    try:
        for as_view in (False, True):
            model = copy.deepcopy(master)
            transform_model(model, kernels=True)
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_view)
            for _ in range(2):
                got = step(model, ddp)
                assert got.keys() == want.keys() and got
                for name in want:
                    assert torch.equal(got[name], want[name]), (as_view, name)
    finally:
        dist.destroy_process_group()
