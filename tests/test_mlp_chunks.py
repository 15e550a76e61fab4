"""Token-chunked gated MLPs (lightning_sloth.patching.mlp_chunks): the same loss and every gradient
as the unchunked model, and no ``[tokens, intermediate]`` tensor while chunked."""

import pytest
import torch
from _models import add_lora, packed_batch, random_documents, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_sloth.attention import enable_packed_attention
from lightning_sloth.offload import ActivationOffloader, apply_checkpointing
from lightning_sloth.patching import KernelSettings, apply_kernels, chunk_mlps
from lightning_sloth.patching.mlp_chunks import (
    MLP_CHUNK_BYTES,
    chunk_size_for,
    chunked_rows,
    mlp_chunk_tokens,
    set_mlp_chunk_tokens,
)
from lightning_sloth.quant import quantize_model

INTERMEDIATE = 96  # apart from every other width of the tiny model (hidden 64, vocab 128)
CHUNK = 7
LENGTHS = [19, 1, 30, 11]  # 61 tokens: nine chunks, the last one short


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(base: str, chunk: int | None, mode: str):
    model = add_lora(tiny_llama(intermediate_size=INTERMEDIATE), r=4)
    if base == "nf4":
        quantize_model(model, "nf4")
    apply_kernels(model, KernelSettings())
    enable_packed_attention(model)
    assert chunk_mlps(model, chunk) == 2
    if mode != "keep":
        offloader = (
            ActivationOffloader("on", device="cpu", min_offload_bytes=1) if mode == "offload" else None
        )
        ckpt = apply_checkpointing(
            model, offloader=offloader, checkpoint_impl=mode if mode == "torch" else "node"
        )
        if mode == "offload":
            assert ckpt.plan[0] == "offload"
    return model.train()


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch.model_inputs(), labels=batch.labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


class _Widths(TorchDispatchMode):
    """The largest row count of any tensor an op makes whose last dim is the MLP's intermediate."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # down_proj's weight ([hidden, I]) and its gradient are weights, not rows
            if (
                isinstance(t, torch.Tensor)
                and t.shape[-1:] == (INTERMEDIATE,)
                and t.shape != (64, INTERMEDIATE)
            ):
                self.rows = max(self.rows, t.numel() // INTERMEDIATE)
        return out


@pytest.mark.parametrize("base", ["float32", "nf4"])
@pytest.mark.parametrize("mode", ["node", "offload", "torch", "keep"])
def test_chunked_mlp_gives_the_same_loss_and_gradients(base, mode):
    """Packed rows, LoRA on the seven projections: equal loss and every gradient (float32), with
    the layer checkpoint as a node, with offload, with torch's checkpoint and without a checkpoint;
    no MLP tensor ever holds more than one chunk's rows."""
    batch = packed_batch(random_documents(LENGTHS))
    want_loss, want = _step(_model(base, None, mode), batch)
    model = _model(base, CHUNK, mode)
    with _Widths() as widths:
        loss, got = _step(model, batch)
    assert widths.rows == CHUNK
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    assert got.keys() == want.keys() and any("mlp.gate_proj.lora_A" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_unchunked_run_makes_whole_mlp_tensors():
    """The counter sees the whole ``[tokens, intermediate]`` tensors when nothing chunks (so the
    test above measures what it claims)."""
    batch = packed_batch(random_documents(LENGTHS))
    with _Widths() as widths:
        _step(_model("float32", None, "node"), batch)
    assert widths.rows == sum(LENGTHS)


def test_chunked_rows_op_level_gradients_and_frozen_input():
    """chunked_rows alone: a non-contiguous input, parameters that train while x needs no
    gradient (the anchor keeps the node in the graph), and under no_grad."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3).double()
    x = torch.randn(2, 11, 9, dtype=torch.float64)[..., 2:7]  # [2, 11, 5], strided
    for needs_x in (True, False):
        xs = x.clone().requires_grad_(needs_x)
        lin.zero_grad()
        (lin(xs).sin().sum()).backward()
        want = [p.grad.clone() for p in lin.parameters()], xs.grad
        xs = x.clone().requires_grad_(needs_x)
        lin.zero_grad()
        out = chunked_rows(lambda r: lin(r).sin(), xs, 4)
        assert out.shape == (2, 11, 3)
        out.sum().backward()
        for g, w in zip([p.grad for p in lin.parameters()], want[0]):
            torch.testing.assert_close(g, w)
        if needs_x:
            torch.testing.assert_close(xs.grad, want[1])
        else:
            assert xs.grad is None
    with torch.no_grad():
        torch.testing.assert_close(chunked_rows(lin, x, 3), lin(x))
    with pytest.raises(ValueError, match="chunk size"):
        chunked_rows(lin, x, 0)


def test_auto_chunk_size_follows_the_intermediate_and_dtype():
    mlp = torch.nn.Module()
    mlp.down_proj = torch.nn.Linear(14336, 8, bias=False, device="meta")
    set_mlp_chunk_tokens([mlp], "auto")
    long = torch.zeros((), dtype=torch.bfloat16).expand(1, 100_000, 4096)  # no memory behind it
    size = chunk_size_for(mlp, long)
    assert size == MLP_CHUNK_BYTES // (3 * 14336 * 2) // 1024 * 1024 == 24576
    assert chunk_size_for(mlp, long[:, :size]) is None  # one chunk's worth runs whole
    assert chunk_size_for(mlp, long.float()) == 12288
    set_mlp_chunk_tokens([mlp], None)
    assert chunk_size_for(mlp, long) is None
    for bad in (0, -3, "big", True):
        with pytest.raises(ValueError, match="mlp_chunk_tokens"):
            set_mlp_chunk_tokens([mlp], bad)


def test_transform_model_sets_the_chunking():
    from lightning_sloth.transform import transform_model

    model = add_lora(tiny_llama(intermediate_size=INTERMEDIATE), r=4)
    report = transform_model(model, kernels=True, mlp_chunk_tokens=CHUNK)
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    assert [mlp_chunk_tokens(m) for m in mlps] == [CHUNK, CHUNK]
    assert any("token-chunked" in step for step in report.applied)
    model = add_lora(tiny_llama(intermediate_size=INTERMEDIATE), r=4)
    transform_model(model, kernels=True)
    assert [mlp_chunk_tokens(m) for n, m in model.named_modules() if n.endswith(".mlp")] == ["auto"] * 2


def test_memory_plan_counts_one_chunk_of_mlp_intermediates():
    """The measured activations of a chunked MLP are its input; its backward's chunk of
    intermediates (three ``[chunk, I]``) is the plan's workspace."""
    model = add_lora(tiny_llama(intermediate_size=INTERMEDIATE), r=4)
    apply_kernels(model, KernelSettings())
    enable_packed_attention(model)
    chunk_mlps(model, CHUNK)
    ckpt = apply_checkpointing(model, memory_budget=1 << 40)
    batch = packed_batch(random_documents(LENGTHS))
    model.train()(**batch.model_inputs(), labels=batch.labels).loss.backward()
    assert ckpt.workspace_bytes == 3 * CHUNK * INTERMEDIATE * 4
