"""What a step holds: the loss's tensors, the shared dequantisation buffer, the memory plan's
workspace on 4-bit bases (counted by tensor sizes and fake budgets, never by time)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import add_lora, packed_batch, random_documents, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_sloth.offload import apply_checkpointing, plan_layers, plan_peak_bytes
from lightning_sloth.offload.transient import backward_transient_bytes
from lightning_sloth.ops import nf4
from lightning_sloth.ops.linear_cross_entropy import (
    _chunked_linear_cross_entropy,
    _cross_entropy_rows_reference_,
    chunk_size_for_bytes,
    linear_cross_entropy,
)
from lightning_sloth.quant import Linear4bit, quantize_model
from lightning_sloth.transform import transform_model


class _Outputs(TorchDispatchMode):
    """Every tensor an op makes: ``(op name, shape, dtype)``."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [
            (str(func), tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
        ]
        return out


# ------------------------------------------------------------------------------------------ loss
N, H, V, CHUNK = 150, 24, 97, 32


def test_loss_writes_hidden_gradient_into_one_buffer_and_no_full_vocab_float32():
    """Frozen lm head (LoRA): no tensor of a chunk's logits above CHUNK rows, no ``[V, H]`` float32
    accumulator, no concatenation of hidden's gradient (one ``[N, H]`` tensor made, not two)."""
    torch.manual_seed(0)
    hidden = torch.randn(N, H, dtype=torch.float32)
    weight = torch.randn(V, H, dtype=torch.float32)
    targets = torch.randint(0, V, (N,))
    with _Outputs() as outputs:
        loss, d_hidden, d_weight, _, scale = _chunked_linear_cross_entropy(
            hidden, weight, None, targets, None, -100, None, "mean", CHUNK,
            True, False, False, _cross_entropy_rows_reference_,
        )  # fmt: skip
    shapes = [shape for _, shape, _ in outputs.made]
    assert max(s[0] * s[1] for s in shapes if len(s) == 2 and s[1] == V) <= CHUNK * V
    assert (V, H) not in shapes and d_weight.numel() == 0
    assert shapes.count((N, H)) == 1 and not any(op.startswith("aten.cat") for op, _, _ in outputs.made)
    hidden.requires_grad_()
    want = F.cross_entropy(hidden @ weight.t(), targets)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(d_hidden * scale, hidden.grad)


def test_loss_backward_makes_one_hidden_gradient_and_no_zeros():
    """The backward of the fused loss makes hidden's gradient once ([N, H]), scaled a float32 slice at
    a time, and no zero gradients for its non-differentiable outputs (one of them is [N, H])."""
    n, h, v = 20000, 8, 40
    torch.manual_seed(0)
    hidden = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.bfloat16)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, v, (n,)), chunk_size=4096)
    with _Outputs() as outputs:
        loss.backward()
    big = [(op, shape, dtype) for op, shape, dtype in outputs.made if shape and shape[0] >= 8192]
    made = [entry for entry in big if not entry[0].startswith(("aten.slice", "aten.view", "aten.detach"))]
    assert not any(op.startswith(("aten.zeros", "aten.zero_", "aten.fill")) for op, _, _ in made), made
    assert sum(shape == (n, h) for _, shape, _ in made) == 1, made
    assert all(shape[0] <= 8192 for _, shape, dtype in made if dtype == torch.float32), made


def test_loss_chunk_bytes_bounds_one_chunk():
    assert chunk_size_for_bytes(128256, 2**28, torch.bfloat16) == 1024
    assert chunk_size_for_bytes(128256, 2**28, torch.float32) == 512
    assert chunk_size_for_bytes(V, 10 * V * 4, torch.float32) == 10
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_size_for_bytes(V, 0, torch.float32)
    torch.manual_seed(1)
    hidden = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64)
    targets = torch.randint(0, V, (N,))
    got = linear_cross_entropy(hidden, weight, targets, chunk_bytes=7 * V * 8)  # 7 rows a chunk
    (grad,) = torch.autograd.grad(got, hidden)
    want = F.cross_entropy(hidden @ weight.t(), targets)
    (want_grad,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
    with pytest.raises(ValueError, match="not both"):
        linear_cross_entropy(hidden, weight, targets, chunk_bytes=100, chunk_size=3)


# ------------------------------------------------------------------------- dequantisation buffer
def test_every_4bit_shape_shares_one_buffer_the_size_of_the_largest():
    """q/k/v/o, gate/up and down of a 4-bit model decode into views of one flat buffer."""
    nf4.release_scratch()
    model = add_lora(tiny_llama(intermediate_size=96), r=4)
    quantize_model(model, "nf4")
    batch = packed_batch(random_documents([9, 14]))
    model.train()
    model(**batch.model_inputs(), labels=batch.labels).loss.backward()
    largest = max(m.out_features * m.in_features for m in model.modules() if isinstance(m, Linear4bit))
    assert nf4.scratch_bytes() == largest * 4  # float32 compute here
    a = nf4._scratch(3, 5, torch.float32, torch.device("cpu"))
    b = nf4._scratch(64, 96, torch.float32, torch.device("cpu"))
    assert a.data_ptr() == b.data_ptr() and b.shape == (64, 96)
    nf4.release_scratch()
    assert nf4.scratch_bytes() == 0


def test_probing_a_4bit_layer_decodes_nothing():
    """``transform_model`` probes each LoRA layer with zero rows (in float32 for a 4-bit base): no
    weight is decoded and no buffer made, so a bfloat16 model keeps no float32 buffer beside its own."""
    nf4.release_scratch()
    model = add_lora(tiny_llama(intermediate_size=96), r=4).to(torch.bfloat16)
    quantize_model(model, "nf4")
    transform_model(model, kernels=True)
    assert nf4.scratch_bytes() == 0
    batch = packed_batch(random_documents([9, 14]))
    model.train()
    model(**batch.model_inputs(), labels=batch.labels).loss.backward()
    assert {dtype for dtype, _ in nf4._SCRATCH} == {torch.bfloat16}
    nf4.release_scratch()


# ---------------------------------------------------------------------------------- memory plan
def test_plan_counts_the_workspace_once():
    act, inp, n = 100, 10, 6
    leanest = ["offload"] * 5 + ["recompute"]
    assert plan_peak_bytes(leanest, [act] * n, [inp] * n, workspace_bytes=50) == 110 + 50
    # With the workspace, the budget that kept the last layer and recomputed layer 4 now does not.
    assert plan_layers(n, act, inp, 110) == ["offload"] * 4 + ["recompute", "keep"]
    assert plan_layers(n, act, inp, 110, workspace_bytes=50) == leanest
    assert plan_layers(n, act, inp, 160, workspace_bytes=50) == ["offload"] * 4 + ["recompute", "keep"]
    with pytest.raises(ValueError, match="workspace_bytes"):
        plan_peak_bytes(leanest, [act] * n, [inp] * n, workspace_bytes=-1)


def test_plan_counts_each_layers_backward_kept_or_not():
    """A kept layer's backward runs with the layers below holding theirs: its transient bytes sit on
    top of them. Without them the planner keeps every layer up to the budget exactly."""
    act, inp, n = 100, 10, 3
    kept = ["keep"] * n
    assert plan_peak_bytes(kept, [act] * n, [inp] * n) == 300
    assert plan_peak_bytes(kept, [act] * n, [inp] * n, backward_bytes=[0, 0, 50]) == 350
    assert plan_peak_bytes(kept, [act] * n, [inp] * n, backward_bytes=[0, 250, 0]) == 450
    # A checkpointed layer's backward adds it to its recomputed activations and the workspace.
    assert plan_peak_bytes(["recompute"] * n, [act] * n, [inp] * n, 5, backward_bytes=7) == 20 + 100 + 5 + 7
    assert plan_layers(n, act, inp, 300, offload=False) == kept
    assert plan_layers(n, act, inp, 300, offload=False, backward_bytes=50) == ["recompute", "keep", "keep"]
    assert plan_layers(n, act, inp, 350, offload=False, backward_bytes=50) == kept
    with pytest.raises(ValueError, match="backward_bytes has 2 entries for 3 layers"):
        plan_layers(n, act, inp, 300, backward_bytes=[1, 2])


def test_the_backward_measurement_reads_the_peak_and_leaves_no_gradient(monkeypatch):
    """The measurement's own logic, off CUDA: the device counters faked, the layer real. It
    returns the peak above what was allocated before the backward, and puts nothing in ``.grad``."""
    model = add_lora(tiny_llama(intermediate_size=96), r=4)
    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(1, 9, 64)
    counters = {"allocated": 1000, "peak": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: counters.update(peak=1000))
    calls = []

    def grad(*args, **kwargs):
        calls.append(kwargs)
        counters["peak"] = 1700
        return real_grad(*args, **kwargs)

    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", grad)
    positions = torch.arange(9)[None]
    rotary = model.base_model.model.model.rotary_emb(hidden, positions)
    output = layer(hidden, position_embeddings=rotary)
    assert backward_transient_bytes(output, layer, (hidden,), torch.device("cuda")) == 700
    assert len(calls) == 1 and all(p.grad is None for p in layer.parameters())
    assert backward_transient_bytes(output, layer, (hidden,), torch.device("cpu")) == 0
    with torch.no_grad():
        assert (
            backward_transient_bytes(
                layer(hidden, position_embeddings=rotary), layer, (hidden,), torch.device("cuda")
            )
            == 0
        )
    # Not in a process group of several ranks (DDP, FSDP2): their hooks would run mid-forward.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert backward_transient_bytes(output, layer, (hidden,), torch.device("cuda")) == 0
    assert len(calls) == 1


@pytest.mark.parametrize("quantize", [False, True])
def test_measured_plan_on_a_4bit_base_counts_the_dequant_buffer(quantize):
    """The controller measures the same activations for a 4-bit base, adds its largest weight in
    the compute dtype as workspace, and plans with it (a fake budget just short of keeping all)."""
    model = add_lora(tiny_llama(intermediate_size=96), r=4)
    if quantize:
        quantize_model(model, "nf4")
    ckpt = apply_checkpointing(model, memory_budget=1 << 40)
    batch = packed_batch(random_documents([20, 33]))
    model.train()
    model(**batch.model_inputs(), labels=batch.labels).loss.backward()
    want = 64 * 96 * 4 if quantize else 0
    assert ckpt.workspace_bytes == want
    assert ckpt.backward_bytes == [0, 0]  # measured on CUDA only
    assert ckpt.plan == ["keep", "keep"]
    act, inp = ckpt.activation_bytes, ckpt.input_bytes
    all_kept = plan_peak_bytes(["keep", "keep"], act, inp, want)
    plan = ckpt.replan(all_kept + want - 1 if quantize else all_kept - 1)
    assert plan_peak_bytes(plan, act, inp, want) <= all_kept + want
    if quantize:  # the same budget without the workspace keeps both layers
        assert plan_layers(2, act, inp, all_kept + want - 1, offload=False) == ["keep", "keep"]
        assert plan == plan_layers(2, act, inp, all_kept + want - 1, offload=False, workspace_bytes=want)


def test_backward_scales_a_long_gradient_in_float32_slices():
    """The mean's 1/count is applied in float32 without a float32 copy of the whole ``[N, H]``."""
    from lightning_sloth.ops.linear_cross_entropy import _SCALE_ROWS, _scaled

    n = _SCALE_ROWS * 2 + 5
    d = torch.randn(n, 3).to(torch.bfloat16)
    scale = torch.tensor(1 / 3, dtype=torch.float32)
    with _Outputs() as outputs:
        got = _scaled(d, scale, torch.bfloat16)
    assert not any(shape == (n, 3) and dtype == torch.float32 for _, shape, dtype in outputs.made)
    assert torch.equal(got, (d.float() * scale).to(torch.bfloat16))


def test_loss_keeps_every_row_when_few_are_ignored():
    """A long sequence with a handful of ignored rows: hidden itself, no ``[count, H]`` copy."""
    from lightning_sloth.patching._forwards import target_rows

    hidden = torch.randn(1, 640, 8)
    targets = torch.randint(0, 5, (1, 640))
    targets[0, ::128] = -100  # 5 ignored rows, under 640 // 64
    rows, kept = target_rows(hidden, targets, 635)
    assert rows is hidden and kept is targets
    targets[0, :20] = -100  # 24 ignored: the selection pays
    rows, kept = target_rows(hidden, targets, 616)
    assert rows.shape == (616, 8) and bool((kept != -100).all())


def test_a_plan_for_the_whole_card_warns_once_without_expandable_segments(monkeypatch):
    from lightning_sloth.offload import transient

    settings = {"text": ""}
    monkeypatch.setattr(
        torch._C, "_accelerator_getAllocatorSettings", lambda: settings["text"], raising=False
    )
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(transient, "_FRAGMENTATION_NOTED", [])
    assert not transient.expandable_segments()
    with pytest.warns(UserWarning, match="expandable_segments:True"):
        transient.note_fragmentation()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transient.note_fragmentation()  # once per process
    settings["text"] = "expandable_segments:True,max_split_size_mb:512"
    assert transient.expandable_segments()
    monkeypatch.setattr(transient, "_FRAGMENTATION_NOTED", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transient.note_fragmentation()
    settings["text"] = ""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert transient.expandable_segments()
