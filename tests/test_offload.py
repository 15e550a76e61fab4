"""CPU tests of the activation offloader: a CPU "device" with a CPU "host" pool stands in for CUDA.

The bookkeeping (pool, prefetch order, plan, measurement) is the code that runs on the GPU; only
the streams and events are absent here (tests/gpu/test_offload_gpu.py covers them).
"""

import gc
import itertools
import pickle
import random
import weakref
from types import SimpleNamespace

import pytest
import torch
from _models import add_lora, packed_batch, random_documents  # tests/_models.py
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sloth import offload
from lightning_sloth.hf_model import find_decoder_layers
from lightning_sloth.offload import (
    ActivationOffloader,
    HostBufferPool,
    apply_checkpointing,
    plan_layers,
    plan_peak_bytes,
)
from lightning_sloth.plugins import OffloadStatsCallback

LAYERS, HIDDEN, BATCH, SEQ = 4, 64, 2, 33
INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # one fp32 layer input


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        use_cache=False,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random norms, so every layer's gradients depend on its input scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.train()


def batch(seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def step_grads(model, inputs: dict) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def cpu_offloader(**kwargs) -> ActivationOffloader:
    kwargs.setdefault("min_offload_bytes", 1)
    return ActivationOffloader("on", device="cpu", **kwargs)


# ------------------------------------------------------------------------------------- planner
def test_plan_peak_bytes_matches_hand_count():
    act, inp = [10, 20, 30, 40], [1, 2, 3, 4]
    # resident [10, 2, 0, 4]: forward end 16; backward of 1: 10 + 20 + 0 = 30;
    # backward of 2: 12 + 30 + prefetch 0 = 42; backward of 3: 12 + 40 + prefetch 3 = 55.
    assert plan_peak_bytes(["keep", "recompute", "offload", "recompute"], act, inp) == 55
    assert plan_peak_bytes(["keep"] * 4, act, inp) == 100


def test_plan_layers_spends_the_budget_last_layer_first():
    act, inp, n = 100, 10, 6
    leanest = ["offload"] * 5 + ["recompute"]
    assert plan_layers(n, act, inp, budget_bytes=0) == leanest  # returned even when it does not fit
    assert plan_layers(n, act, inp, 10**9) == ["keep"] * n
    # Leanest peak: the last layer's recompute (100) + the prefetched input of layer 4 (10).
    # Keeping the last layer is free (its recompute would hold the same bytes at the same time)
    # and so is recomputing layer 4 (its resident input replaces the prefetch buffer).
    assert plan_peak_bytes(leanest, [act] * n, [inp] * n) == 110
    assert plan_layers(n, act, inp, 110) == ["offload"] * 4 + ["recompute", "keep"]
    # 20 more bytes: two more offloads become recomputes.
    assert plan_layers(n, act, inp, 130) == ["offload"] * 2 + ["recompute"] * 3 + ["keep"]
    # All recompute peaks at 50 + 100; each further keep adds 90 at the end of the forward.
    assert plan_layers(n, act, inp, 150) == ["recompute"] * 5 + ["keep"]
    assert plan_layers(n, act, inp, 240) == ["recompute"] * 4 + ["keep"] * 2
    # Without an offloader the leanest plan is all recompute.
    assert plan_layers(n, act, inp, 0, offload=False) == ["recompute"] * n
    assert plan_layers(n, act, inp, 150, offload=False) == ["recompute"] * 5 + ["keep"]


def test_plan_layers_fits_and_beats_random_plans():
    rng = random.Random(0)
    modes = ("keep", "recompute", "offload")
    for _ in range(200):
        n = rng.randint(1, 6)
        inp = [rng.randint(1, 50) for _ in range(n)]
        act = [i + rng.randint(0, 500) for i in inp]
        budget = rng.randint(0, sum(act) + 100)
        plan = plan_layers(n, act, inp, budget)
        leanest = ["offload"] * (n - 1) + ["recompute"]
        peak = plan_peak_bytes(plan, act, inp)
        assert peak <= max(budget, plan_peak_bytes(leanest, act, inp))
        checkpointed = [m for m in plan if m != "keep"]
        assert not checkpointed or checkpointed[-1] != "offload"
        if peak <= budget and n <= 4:
            # No feasible plan keeps more layers and offloads no more of them.
            for other in itertools.product(modes, repeat=n):
                if plan_peak_bytes(other, act, inp) <= budget:
                    more_keep = other.count("keep") > plan.count("keep")
                    assert not (more_keep and other.count("offload") <= plan.count("offload")), (plan, other)


def test_plan_layers_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one layer"):
        plan_layers(0, 1, 1, 1)
    with pytest.raises(ValueError, match="act_bytes_per_layer has 2 entries for 3 layers"):
        plan_layers(3, [1, 2], 1, 10)
    with pytest.raises(ValueError, match="non-negative"):
        plan_layers(2, 1, [1, -1], 10)


# ------------------------------------------------------------------------- gradients, recompute
def test_gradients_bitwise_equal_with_offload():
    inputs = batch()
    plain = step_grads(tiny_llama(), inputs)
    model = tiny_llama()
    ckpt = apply_checkpointing(model)
    assert ckpt.plan == ["recompute"] * LAYERS
    assert_bitwise(step_grads(model, inputs), plain)
    for double_buffer in (True, False):
        model = tiny_llama()
        offloader = cpu_offloader(double_buffer=double_buffer)
        ckpt = apply_checkpointing(model, offloader=offloader)
        assert ckpt.plan == ["offload"] * (LAYERS - 1) + ["recompute"]
        assert_bitwise(step_grads(model, inputs), plain)
        stats = offloader.stats()
        assert stats["offloaded_bytes_per_step"] == (LAYERS - 1) * INPUT_BYTES  # last layer's input kept
        if double_buffer:  # the last layer's backward prefetches layer L-2, and so on down
            assert (stats["prefetched"], stats["fetched_on_demand"]) == (LAYERS - 1, 0)
        else:
            assert (stats["prefetched"], stats["fetched_on_demand"]) == (0, LAYERS - 1)


def test_gradients_bitwise_equal_with_lora():
    inputs = batch()
    plain = step_grads(add_lora(tiny_llama()), inputs)
    assert plain and all("lora" in name for name in plain)
    model = add_lora(tiny_llama())
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader)
    assert_bitwise(step_grads(model, inputs), plain)
    # The first layer's input is the frozen embedding's output: its node keeps the token ids instead.
    ids_bytes = inputs["input_ids"].numel() * inputs["input_ids"].element_size()
    assert offloader.stats()["offloaded_bytes_per_step"] == (LAYERS - 2) * INPUT_BYTES + ids_bytes


def test_hooks_around_checkpoint_still_recompute():
    model = tiny_llama()
    calls = [0] * LAYERS
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    apply_checkpointing(model, offloader=cpu_offloader(), plan=["offload", "offload", "keep", "recompute"])
    for step in range(1, 3):
        step_grads(model, batch(step))
        assert calls == [2 * step, 2 * step, step, 2 * step]  # forward + recompute; keep: forward only


def test_packed_batch_with_packed_attention():
    attention = pytest.importorskip("lightning_sloth.attention")
    packed = packed_batch(random_documents([15, 25, 9], seed=3, vocab=97), pad_to=56)
    inputs = packed.model_inputs() | {"labels": packed.labels}

    def packed_llama():
        model = tiny_llama()
        attention.enable_packed_attention(model, backend="sdpa")
        return model

    plain = step_grads(packed_llama(), inputs)
    model = packed_llama()
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader)
    assert_bitwise(step_grads(model, inputs), plain)
    # Only the hidden states travel; rotary tables and cu_seqlens are keyword arguments of the layer.
    assert offloader.stats()["offloaded_bytes_per_step"] == (LAYERS - 1) * 56 * HIDDEN * 4


def test_gradient_accumulation_two_micro_steps():
    micro = [batch(1), batch(2)]

    def accumulate(model):
        model.zero_grad(set_to_none=True)
        for inputs in micro:
            (model(**inputs).loss / 2).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = accumulate(tiny_llama())
    model = tiny_llama()
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader)
    assert_bitwise(accumulate(model), plain)
    stats = offloader.stats()
    assert stats["steps"] == 2
    assert stats["host_pool_allocations"] == LAYERS - 1  # the second micro-step reused the blocks
    assert stats["host_pool_in_use_bytes"] == 0


@pytest.mark.parametrize("impl", ["torch", "node"])
def test_compiled_layers_inside_the_checkpoint(impl):
    torch._dynamo.reset()
    inputs = batch()
    model = tiny_llama()
    apply_checkpointing(model, checkpoint_impl="torch")
    plain = step_grads(model, inputs)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tiny_llama()
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader, compile_layers={"backend": backend}, checkpoint_impl=impl)
    for _ in range(2):
        assert_bitwise(step_grads(model, inputs), plain)
    # One graph serves every layer, both steps: torch's checkpoint runs forward and recompute with
    # grad enabled (one graph); the node runs its forward without grad (a second graph).
    assert len(graphs) == (1 if impl == "torch" else 2)
    assert offloader.stats()["offloaded_bytes_per_step"] == (LAYERS - 1) * INPUT_BYTES
    torch._dynamo.reset()


@pytest.mark.parametrize("compile_arg", [True, {"mode": "default"}])
def test_transform_model_compile_true_compiles_the_checkpointed_layers(compile_arg, monkeypatch):
    """compile=True (Hydra's sloth.compile=true) compiles every checkpointed layer: it once reached
    the layer runner as an empty dict of options, which read as "off" and compiled nothing."""
    from lightning_sloth.offload import checkpoint as checkpoint_module
    from lightning_sloth.transform import transform_model

    requested = []

    real_compile = torch.compile

    def fake_compile(fn, **options):
        if fn is not checkpoint_module._call_layer:
            return real_compile(fn, **options)
        requested.append(options)
        return fn

    monkeypatch.setattr(checkpoint_module.torch, "compile", fake_compile)
    report = transform_model(tiny_llama(), kernels=False, compile=compile_arg)
    assert "regional compile" in report.applied
    assert report.checkpointing._compiled is not None
    assert requested == [compile_arg if isinstance(compile_arg, dict) else {}]


def _spy_torch_checkpoint(monkeypatch) -> list:
    from lightning_sloth.offload import checkpoint as checkpoint_module

    calls = []
    real = checkpoint_module.checkpoint
    monkeypatch.setattr(checkpoint_module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("with_offload", [False, True])
def test_node_checkpoint_gives_torch_checkpoints_gradients(lora, with_offload, monkeypatch):
    """checkpoint_impl="node": the same gradients, bit for bit, as torch's checkpoint (full and LoRA:
    the first layer's adapters train though its input needs no gradient), the offloader moving the
    same inputs, and torch's checkpoint never called."""
    inputs = batch()
    make = (lambda: add_lora(tiny_llama())) if lora else tiny_llama
    model = make()
    apply_checkpointing(model, offloader=cpu_offloader() if with_offload else None, checkpoint_impl="torch")
    want = step_grads(model, inputs)
    calls = _spy_torch_checkpoint(monkeypatch)
    model = make()
    offloader = cpu_offloader() if with_offload else None
    apply_checkpointing(model, offloader=offloader, checkpoint_impl="node")
    for _ in range(2):
        assert_bitwise(step_grads(model, inputs), want)
    assert calls == []
    if lora:  # the first layer's input needs no gradient; its adapters still get theirs
        assert any("layers.0." in n and "lora_A" in n and want[n].abs().sum() > 0 for n in want)
    if with_offload:  # with LoRA the first node keeps the token ids for the frozen embedding's output
        first = inputs["input_ids"].numel() * inputs["input_ids"].element_size() if lora else INPUT_BYTES
        assert offloader.stats()["offloaded_bytes_per_step"] == (LAYERS - 2) * INPUT_BYTES + first


def test_a_forward_that_records_outputs_runs_under_torchs_checkpoint(monkeypatch):
    """transformers records module outputs (here ``output_hidden_states``) with hooks that keep what
    each layer returns; through the node they would carry no gradient. A loss built from a recorded
    hidden state gets the gradients of torch's checkpoint, bit for bit, because such a forward runs
    the layers under it; a forward recording nothing still runs the node."""
    from lightning_sloth.hf_model import recorded_outputs

    inputs = batch()
    grads = []
    for impl in ("torch", "node"):
        model = tiny_llama()
        apply_checkpointing(model, checkpoint_impl=impl)
        calls = _spy_torch_checkpoint(monkeypatch)
        out = model(**inputs, output_hidden_states=True)
        (out.loss + out.hidden_states[1].float().square().mean()).backward()
        assert len(calls) == LAYERS
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_bitwise(grads[1], grads[0])
    assert recorded_outputs() == []  # outside a forward
    calls = _spy_torch_checkpoint(monkeypatch)
    model(**inputs).loss.backward()
    assert calls == []


def test_node_checkpoint_recomputes_under_the_forwards_autocast():
    """The backward runs outside autocast; the node's recompute re-enters the forward's bf16 autocast,
    so the gradients equal torch's checkpoint's (which does the same) bit for bit."""
    inputs = batch()
    grads = []
    for impl in ("torch", "node"):
        model = add_lora(tiny_llama())
        apply_checkpointing(model, checkpoint_impl=impl)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_bitwise(grads[1], grads[0])


def test_node_checkpoint_replays_dropout(monkeypatch):
    """Attention dropout draws random masks: the node replays the forward's random state in its
    recompute, as torch's checkpoint does, so both give the same gradients bit for bit (and a
    recompute with fresh masks would not)."""
    inputs = batch()
    grads = []
    for impl in ("torch", "node"):
        model = tiny_llama(attention_dropout=0.3)
        apply_checkpointing(model, checkpoint_impl=impl)
        torch.manual_seed(5)
        grads.append(step_grads(model, inputs))
    assert_bitwise(grads[1], grads[0])
    model = tiny_llama(attention_dropout=0.3)
    apply_checkpointing(model, checkpoint_impl="node")
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)  # no replay: other masks
    torch.manual_seed(5)
    fresh = step_grads(model, inputs)
    assert any(not torch.equal(fresh[n], grads[0][n]) for n in fresh)
    with pytest.raises(ValueError, match="checkpoint_impl must be one of"):
        apply_checkpointing(tiny_llama(), checkpoint_impl="reentrant")


def test_node_checkpoint_sends_keyword_tensors_needing_grad_to_torchs():
    from functools import partial

    from lightning_sloth.offload.checkpoint import CheckpointedLayers

    needs = torch.ones(2, requires_grad=True)
    assert CheckpointedLayers._node_fits(partial(torch.add, other=torch.ones(2)))
    assert not CheckpointedLayers._node_fits(partial(torch.add, other=needs))
    assert not CheckpointedLayers._node_fits(partial(lambda f, x: f(x), partial(torch.add, other=needs)))


class _LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive (made under the mode, not yet freed) and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak = 0, 0
        self._seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)

        def freed(key=key, size=size) -> None:
            self._seen.discard(key)
            self.live -= size

        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


@pytest.mark.parametrize("lora", [False, True])
def test_node_checkpoint_peak_is_torch_checkpoints(lora):
    """The node frees each layer's recomputed output before that layer's backward runs (its
    backward starts from gradient edges), so its peak of live tensor bytes over a step is torch's
    checkpoint's, not one hidden state more."""
    inputs = batch()
    peaks = {}
    for impl in ("torch", "node"):
        model = add_lora(tiny_llama()) if lora else tiny_llama()
        apply_checkpointing(model, checkpoint_impl=impl)
        step_grads(model, inputs)  # warm: lazily made state is not part of the step's peak
        model.zero_grad(set_to_none=True)
        with _LiveBytes() as mode:
            model(**inputs).loss.backward()
        peaks[impl] = mode.peak
    assert peaks["node"] <= peaks["torch"], peaks


def test_node_checkpoint_looks_the_frozen_embedding_up_again():
    """With LoRA the first layer's input is the frozen embedding's output: its node keeps the token
    ids and looks the embedding up again in its backward, so that hidden state is freed once the
    forward returns (one ``[tokens, hidden]`` tensor less held into the backward), with the same
    gradients bit for bit. A trained embedding's output is kept as before."""
    inputs = batch()
    want = step_grads(add_lora(tiny_llama()), inputs)
    results = {}
    for rebuild in (True, False):
        model = add_lora(tiny_llama())
        ckpt = apply_checkpointing(model)
        assert ckpt.rebuild_embedding
        ckpt.rebuild_embedding = rebuild
        seen = []
        model.get_input_embeddings().register_forward_hook(
            lambda m, i, out, seen=seen: seen.append(weakref.ref(out))
        )
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        gc.collect()
        alive = seen[0]() is not None
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert_bitwise(grads, want)
        assert len(seen) == 2 if rebuild else len(seen) == 1  # the backward's second look-up
        model.zero_grad(set_to_none=True)
        with _LiveBytes() as mode:
            loss = model(**inputs).loss
            held = mode.live  # what the forward leaves for the backward
            loss.backward()
        results[rebuild] = alive, held
    assert results[True][0] is False and results[False][0] is True
    assert results[True][1] == results[False][1] - INPUT_BYTES
    full = tiny_llama()  # the embedding trains: its output needs a gradient and stays saved
    apply_checkpointing(full)
    seen = []
    full.get_input_embeddings().register_forward_hook(lambda m, i, out: seen.append(weakref.ref(out)))
    loss = full(**inputs).loss
    gc.collect()
    assert seen[0]() is not None
    loss.backward()
    assert len(seen) == 1
    assert not apply_checkpointing(tiny_llama(), checkpoint_impl="torch").rebuild_embedding


@pytest.mark.parametrize("impl", ["torch", "node"])
def test_single_process_ddp(impl):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    inputs = batch()
    plain = step_grads(tiny_llama(), inputs)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", world_size=1, rank=0)
    ddp = None
    try:
        model = tiny_llama()
        apply_checkpointing(model, offloader=cpu_offloader(), checkpoint_impl=impl)
        ddp = DistributedDataParallel(model)
        for _ in range(2):  # DDP's reducer must see every gradient in each step's (nested) backward
            model.zero_grad(set_to_none=True)
            ddp(**inputs).loss.backward()
            assert_bitwise({n: p.grad for n, p in model.named_parameters()}, plain)
    finally:
        # The reducer (holding the group) goes first: freed after destroy_process_group(), its last
        # reference to the gloo group joined the group's threads from the test and could hang.
        del ddp
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ pool, lifetimes
def test_recompute_reads_the_copy_brought_back_from_the_host():
    from torch.utils.checkpoint import checkpoint

    offloader = cpu_offloader()
    weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    seen: list[tuple[int, int]] = []  # (block, data_ptr of its input) at every call

    def block(i, x):
        seen.append((i, x.data_ptr()))
        return torch.tanh(x @ weight)

    x = torch.randn(
        8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True
    )
    h, inputs = x * 1.0, []
    for i in range(3):
        inputs.append(h)
        with offloader.saved_tensors_hooks(offload=i < 2):  # block 2: kept, like the last layer
            h = checkpoint(block, i, h, use_reentrant=False)
    assert offloader.pool.in_use_bytes == 2 << 20
    h.sum().backward()
    forward = dict(seen[:3])
    recompute = dict(seen[3:])
    assert sorted(recompute) == [0, 1, 2]
    assert recompute[2] == forward[2] == inputs[2].data_ptr()  # kept: the original tensor
    assert recompute[0] != forward[0] and recompute[1] != forward[1]  # offloaded: a fresh copy
    assert offloader.pool.in_use_bytes == 0 and offloader.stats()["prefetched"] == 2

    reference = x.detach().clone().requires_grad_()
    r = reference * 1.0
    for _ in range(3):
        r = torch.tanh(r @ weight)
    r.sum().backward()
    assert torch.equal(x.grad, reference.grad)


def test_pool_reuse_allocates_nothing_after_the_first_step():
    model = tiny_llama()
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader)
    step_grads(model, batch(1))
    first = offloader.stats(reset=True)
    assert first["host_pool_allocations"] == LAYERS - 1
    assert first["host_pool_in_use_bytes"] == 0
    for seed in (2, 3):
        step_grads(model, batch(seed))
    later = offloader.stats()
    assert later["host_pool_allocations"] == LAYERS - 1
    assert later["host_pool_bytes"] == first["host_pool_bytes"]
    assert later["steps"] == 2 and later["offloaded_bytes_per_step"] == (LAYERS - 1) * INPUT_BYTES


def test_small_tensors_stay_on_the_device():
    inputs = batch()
    plain = step_grads(tiny_llama(), inputs)
    model = tiny_llama()
    offloader = cpu_offloader(min_offload_bytes=INPUT_BYTES + 1)
    apply_checkpointing(model, offloader=offloader)
    assert_bitwise(step_grads(model, inputs), plain)
    stats = offloader.stats()
    assert stats["offloaded_bytes_per_step"] == 0 and stats["host_pool_allocations"] == 0


def test_pool_cap_keeps_tensors_on_the_device():
    inputs = batch()
    plain = step_grads(tiny_llama(), inputs)
    model = tiny_llama()
    offloader = cpu_offloader(max_host_bytes=2 << 20)  # two 1 MiB blocks for three inputs
    apply_checkpointing(model, offloader=offloader)
    assert_bitwise(step_grads(model, inputs), plain)
    stats = offloader.stats()
    assert stats["offloaded_bytes_per_step"] == 2 * INPUT_BYTES
    assert stats["kept_on_device_bytes_per_step"] == INPUT_BYTES
    assert stats["host_pool_bytes"] == 2 << 20


def test_forward_without_backward_returns_blocks():
    model = tiny_llama()
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader)
    loss = model(**batch()).loss
    assert offloader.pool.in_use_bytes == (LAYERS - 1) << 20
    del loss
    gc.collect()
    assert offloader.pool.in_use_bytes == 0
    step_grads(model, batch())  # and the next step reuses them
    assert offloader.pool.allocations == LAYERS - 1


def test_second_backward_through_offloaded_graph_raises():
    model = tiny_llama()
    apply_checkpointing(model, offloader=cpu_offloader())
    loss = model(**batch()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="unpacked twice"):
        loss.backward()


def test_pool_best_fit_and_pinning_fallback():
    pool = HostBufferPool(max_bytes=None, pin=False)
    big, small = pool.acquire((3 << 20) + 5), pool.acquire(5)
    assert (big.numel(), small.numel()) == ((3 << 20) + (1 << 18), 1 << 20)  # size classes, >= 1 MiB
    pool.release(big)
    pool.release(small)
    assert pool.acquire(1000) is small and pool.allocations == 2
    # No CUDA here, so pinning fails: the pool warns once and goes on with pageable memory.
    pinned = HostBufferPool(max_bytes=None, pin=True)
    with pytest.warns(UserWarning, match="pinning .* failed"):
        block = pinned.acquire(10)
    assert block is not None and not pinned.pin and not block.is_pinned()


@pytest.mark.parametrize("nbytes", [1, (1 << 20) + 1, 3 << 20, (9 << 20) + 1, 1_140_850_688, (1 << 31) - 1])
def test_block_size_classes_waste_at_most_an_eighth(nbytes):
    size = offload._block_bytes(nbytes)
    assert size >= max(nbytes, 1 << 20)
    if nbytes > 1 << 20:
        assert size <= nbytes * 9 / 8  # not the power of two above (a 1.06 GiB input: 1.125 GiB, not 2)
    octave = [offload._block_bytes(n) for n in range(nbytes, 2 * nbytes, max(1, nbytes // 64))]
    assert len(set(octave)) <= 9  # few distinct sizes per doubling: blocks get reused


def test_pool_frees_idle_blocks_that_no_longer_fit_at_its_cap():
    pool = HostBufferPool(max_bytes=4 << 20, pin=False)
    old = pool.acquire(1 << 20)
    pool.release(old)
    grown = pool.acquire(7 << 19)  # 3.5 MiB: only fits under the cap once the idle 1 MiB block goes
    assert grown is not None and grown.numel() == 7 << 19
    assert pool.capacity_bytes == 7 << 19 and pool.allocations == 2
    assert pool.acquire(1 << 20) is None  # the 3.5 MiB block is in use: nothing to free
    pool.release(grown)
    with pytest.raises(RuntimeError, match="still in use"):
        busy = HostBufferPool(max_bytes=None, pin=False)
        busy.acquire(10)
        busy.close()
    pool.close()
    assert pool.capacity_bytes == 0 and pool.acquire(10) is not None


# ------------------------------------------------------------------------------- memory budget
def test_memory_budget_measures_then_plans():
    model = tiny_llama(attention_dropout=0.5)  # random ops: the measuring pass must not shift RNG
    inputs = batch()
    reference = tiny_llama(attention_dropout=0.5)
    apply_checkpointing(reference)
    torch.manual_seed(7)
    want = step_grads(reference, inputs)

    calls = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    offloader = cpu_offloader()
    budget = 10**9
    ckpt = apply_checkpointing(model, offloader=offloader, memory_budget=budget)
    assert ckpt.plan == ["offload"] * (LAYERS - 1) + ["recompute"]  # until measured
    torch.manual_seed(7)
    assert_bitwise(step_grads(model, inputs), want)
    assert calls[0] == 3  # measure + forward + recompute
    assert ckpt.input_bytes == [INPUT_BYTES] * LAYERS
    assert all(a > 5 * INPUT_BYTES for a in ckpt.activation_bytes)
    assert ckpt.plan == ["keep"] * LAYERS and ckpt.budget_bytes == budget
    step_grads(model, inputs)
    assert calls[0] == 4  # kept layers are neither measured again nor recomputed

    act, inp = ckpt.activation_bytes, ckpt.input_bytes
    tight = plan_peak_bytes(["offload"] * (LAYERS - 1) + ["recompute"], act, inp)
    lean = ckpt.replan(tight)
    assert lean[:2] == ["offload", "offload"] and plan_peak_bytes(lean, act, inp) <= tight
    assert offloader.activation_bytes_hint == max(act)
    with pytest.warns(UserWarning, match="over the 0-byte budget"):
        ckpt.replan(0)


def _live_tensor_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor:  # not parameters, nor fake tensors other tests left behind
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


def test_measuring_pass_leaves_nothing_behind():
    """The measuring forward's graph (whose saved outputs reference their own nodes) must be freed."""
    inputs = batch()
    live = {}
    for budget in (None, 1):  # 1 byte: measured, then the leanest plan, like no budget
        model = add_lora(tiny_llama())
        apply_checkpointing(model, offloader=cpu_offloader(), memory_budget=budget)
        for _ in range(2):
            step_grads(model, inputs)
        live[budget] = _live_tensor_bytes()
        del model
    assert live[1] - live[None] < INPUT_BYTES, live


# ---------------------------------------------------------------------------- API and errors
def test_policies_and_validation():
    assert not ActivationOffloader("auto", device="cpu").enabled  # auto is off on CPU
    assert not ActivationOffloader("off", device="cpu").enabled
    with pytest.raises(ValueError, match="offload policy must be one of"):
        ActivationOffloader("always", device="cpu")
    model = tiny_llama()
    with pytest.raises(ValueError, match="plan has 2 entries for 4 decoder layers"):
        apply_checkpointing(model, plan=["keep", "keep"])
    with pytest.raises(ValueError, match="no enabled ActivationOffloader"):
        apply_checkpointing(
            model, offloader=ActivationOffloader("off", device="cpu"), plan=["offload"] + ["keep"] * 3
        )
    with pytest.raises(ValueError, match="last layer's input"):
        apply_checkpointing(model, offloader=cpu_offloader(), plan=["recompute"] * 3 + ["offload"])
    with pytest.raises(ValueError, match="unknown layer modes"):
        apply_checkpointing(model, plan=["keep"] * 3 + ["swap"])
    with pytest.raises(ValueError, match="a plan or a memory_budget"):
        apply_checkpointing(model, plan=["keep"] * 4, memory_budget=1)


def test_find_decoder_layers_plain_peft_and_errors():
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    assert find_decoder_layers(model) is model.model.layers
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert find_decoder_layers(wrapped) is model.model.layers
    with pytest.raises(TypeError, match="no nn.ModuleList of transformers GradientCheckpointingLayer"):
        find_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    ckpt = apply_checkpointing(model)
    ckpt.remove()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


def test_stats_callback_logs_every_n_steps():
    model = tiny_llama()
    offloader = cpu_offloader()
    apply_checkpointing(model, offloader=offloader)
    step_grads(model, batch())
    logged = []
    module = SimpleNamespace(log_dict=lambda values, **kwargs: logged.append(values))
    callback = OffloadStatsCallback()
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(offloader=offloader), global_step=3, log_every_n_steps=2
    )
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert logged == []
    trainer.global_step = 4
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert logged[0]["offload/offloaded_bytes_per_step"] == (LAYERS - 1) * INPUT_BYTES
    assert offloader.stats()["steps"] == 0  # the callback reset the window
    callback.on_train_batch_end(trainer, module, None, None, 1)  # next micro-batch, same step
    assert len(logged) == 1


def test_offloader_pickles_to_a_fresh_copy():
    model = tiny_llama()
    offloader = cpu_offloader(double_buffer=False, max_host_bytes=64 << 20)
    apply_checkpointing(model, offloader=offloader)
    step_grads(model, batch())
    copy = pickle.loads(pickle.dumps(offloader))  # what a spawned DDP worker receives
    assert (copy.policy, copy.device_type, copy.double_buffer, copy.min_offload_bytes) == (
        "on",
        "cpu",
        False,
        1,
    )
    assert copy.pool.max_bytes == 64 << 20 and copy.pool.allocations == 0 and copy.stats()["steps"] == 0


def test_two_process_ddp_with_offload_matches_plain_checkpointing():
    """Two gloo processes, each its own data: offloading changes no bit of the trained weights."""
    import _ddp

    _ddp.assert_offload_changes_nothing(_ddp.run("cpu"))
