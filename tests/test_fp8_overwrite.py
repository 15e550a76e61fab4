"""``overwrite_input`` over FP8 bases (``sloth::lora_linear_fp8``) and over 4-bit storage with FP8
compute (``sloth::lora_linear_4bit_fp8``): the backward writes x's gradient into x's memory, bit for
bit the gradient the plain backward allocates, as the 16-bit and 4-bit ops do; the MLP's down
projection asks for it in a model, through the plain op and through the checkpoint's unread sum."""

from __future__ import annotations

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama
from test_quant_training import _OpNames  # the ops dispatched in a block

from lightning_sloth.data import PackedCollator
from lightning_sloth.ops.fp8_formats import quantize_rows
from lightning_sloth.ops.fp8_lora import lora_linear_fp8
from lightning_sloth.ops.fp8_qlora import lora_linear_4bit_fp8
from lightning_sloth.quant import lora as quant_lora
from lightning_sloth.quant import quantize_4bit, quantize_model
from lightning_sloth.quant.fp8 import fp8_base_model, fp8_compute_4bit
from lightning_sloth.transform import transform_model


def _bases(seed: int = 3):
    """The same 48 x 64 weight as e4m3 codes and as NF4 storage: ``(name, product)`` pairs, each
    product ``f(x, A, B, scale, grad_format, unread_sum_with=, overwrite_input=)``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 64, generator=gen) * 0.1
    codes, scale = quantize_rows(w, "e4m3")
    q = quantize_4bit(w, "nf4")
    four = (q.packed, q.block_absmax(), q.code, q.blocksize)
    return [
        ("fp8", lambda x, a, b, s, fmt, **kw: lora_linear_fp8(x, codes, scale, a, b, s, fmt, **kw)),
        ("4bit_fp8", lambda x, a, b, s, fmt, **kw: lora_linear_4bit_fp8(x, *four, a, b, s, fmt, **kw)),
    ]


@pytest.mark.parametrize("unread", [False, True], ids=["op", "unread_sum"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
def test_overwrite_input_gives_the_same_gradients_in_the_inputs_memory(grad_format, layout, unread):
    gen = torch.Generator().manual_seed(11)
    leaf = torch.randn(9, 64, generator=gen) if layout == "contiguous" else torch.randn(64, 9, generator=gen)
    leaf.requires_grad_()
    a0, b0 = torch.randn(4, 64, generator=gen), torch.randn(48, 4, generator=gen)
    residual0 = torch.randn(9, 48, generator=gen)
    grad_y = torch.randn(9, 48, generator=gen)

    def fresh():  # a fresh intermediate, as the activation's output is
        return leaf * 1 if layout == "contiguous" else (leaf * 1).t()

    for name, product in _bases():
        results = []
        for overwrite in (False, True):
            a, b, residual = (t.clone().requires_grad_() for t in (a0, b0, residual0))
            x = fresh()
            seen = []
            x.register_hook(lambda grad, seen=seen: seen.append(grad))
            kw = {"unread_sum_with": residual} if unread else {}
            y = product(x, a, b, 0.5, grad_format, overwrite_input=overwrite, **kw)
            x_ptr = x.data_ptr()
            grads = torch.autograd.grad(y, (leaf, a, b, *((residual,) if unread else ())), grad_y)
            results.append(grads)
            (dx,) = seen
            # contiguous x: the product lands in x's memory; transposed: the op's own row copy of x
            if overwrite and layout == "contiguous":
                assert dx.data_ptr() == x_ptr, name
            elif not overwrite:
                assert dx.data_ptr() != x_ptr, name
        for got, want in zip(*results):
            assert torch.equal(got, want), (name, grad_format)


def test_the_in_place_backward_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen) * 0.1
    codes, scale = quantize_rows(w, "e4m3")
    q = quantize_4bit(w, "nf4")
    x, a, b = (
        torch.randn(7, 64, generator=gen),
        torch.randn(4, 64, generator=gen),
        torch.randn(48, 4, generator=gen),
    )
    dy, xa = torch.randn(7, 48, generator=gen), x @ a.t()
    fp8 = (codes.view(torch.uint8), scale)
    four = (q.packed, q.block_absmax(), q.code, q.blocksize)
    for needs in ((True, True), (False, True), (True, False)):
        for fmt in ("e4m3", "bf16"):
            torch.library.opcheck(
                torch.ops.sloth.lora_linear_fp8_backward_.default,
                (dy, x.clone(), xa, *fp8, a, b, 0.5, fmt, *needs),
            )
            torch.library.opcheck(
                torch.ops.sloth.lora_linear_4bit_fp8_backward_.default,
                (dy, x.clone(), xa, *four, a, b, 0.5, fmt, *needs),
            )
    xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
    torch.library.opcheck(torch.ops.sloth.lora_linear_fp8.default, (xs, *fp8, as_, bs, 0.5, "e4m3", True))
    torch.library.opcheck(
        torch.ops.sloth.lora_linear_4bit_fp8.default, (xs, *four, as_, bs, 0.5, "e4m3", True)
    )


@pytest.mark.parametrize("base", ["fp8", "nf4_fp8"])
@pytest.mark.parametrize("skip_unread", [True, False], ids=["unread_sum", "full_recompute"])
def test_the_down_projection_writes_its_inputs_gradient_in_place_in_a_model(base, skip_unread):
    """Each layer's ``down_proj`` over an FP8 base (or NF4 storage with FP8 compute) runs the
    in-place backward; the loss and every gradient equal those with the in-place backward off."""
    docs = random_documents([7, 3, 12, 5, 9], seed=1)
    batch = PackedCollator(64, 0, pad_to="max_tokens")([(d, d) for d in docs])
    op = "lora_linear_fp8" if base == "fp8" else "lora_linear_4bit_fp8"
    results = []
    for in_place in (True, False):
        model = add_lora(tiny_llama(seed=0)).train()
        if base == "nf4_fp8":
            quantize_model(model, "nf4")
            fp8_compute_4bit(model, "bf16")
        else:
            fp8_base_model(model, grad_format="bf16")
        report = transform_model(model, kernels=True)
        report.checkpointing.skip_unread_output = skip_unread
        mp = pytest.MonkeyPatch()
        if not in_place:  # the same run with every FP8 backward allocating x's gradient
            for name in ("lora_fp8_forward", "lora_4bit_fp8_storage"):
                plain = getattr(quant_lora, name)
                mp.setattr(quant_lora, name, lambda *a, _f=plain: _f(*a[:-1], False))
        with _OpNames() as names:
            loss = model(**batch.model_inputs(), labels=batch.labels).loss
            loss.backward()
        mp.undo()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        count = names.count(f"sloth.{op}_backward_.default")
        assert count == (len(model.base_model.model.model.layers) if in_place else 0), count
    (loss, grads), (want_loss, want_grads) = results
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in want_grads.items():
        assert torch.equal(grads[name], grad), name


def test_the_4bit_input_gradient_lets_the_row_major_codes_go_before_quantising_dy(monkeypatch):
    """On the FP8 tensor cores (faked here: ``_scaled_mm`` as its float32 product, the byte transpose
    as torch's), the 4-bit input gradient transposes the decoded weight's codes and drops the
    row-major ones before dy is quantised, and gives what the FP8-base product gives over the same
    codes, into ``out`` too."""
    import types
    import weakref

    from lightning_sloth.ops import fp8

    alive = []

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False, out=None):
        y = ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)
        return y if out is None else out.copy_(y)

    made = []
    real_from_4bit, real_quantize = fp8.fp8_from_4bit, fp8.quantize_activation

    def tracking_from_4bit(*args):
        codes, scale = real_from_4bit(*args)
        made.append(weakref.ref(codes))
        return codes, scale

    def tracking_quantize(t, fmt, col_scale=None):
        if col_scale is not None:  # dy's quantisation (W's scales folded in), not the weight's
            alive.append([ref() is not None for ref in made])
        return real_quantize(t, fmt, col_scale)

    monkeypatch.setattr(fp8, "_grad_runs_scaled_mm", lambda dy, w, fmt: fmt != "bf16")
    monkeypatch.setattr(
        fp8, "_kernels", types.SimpleNamespace(transpose_bytes=lambda w: w.t().contiguous()), raising=False
    )
    monkeypatch.setattr(fp8, "fp8_from_4bit", tracking_from_4bit)
    monkeypatch.setattr(fp8, "quantize_activation", tracking_quantize)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    gen = torch.Generator().manual_seed(2)
    q = quantize_4bit(torch.randn(48, 64, generator=gen) * 0.1, "nf4")
    four = (q.packed, q.block_absmax(), q.code, q.blocksize)
    dy = torch.randn(9, 48, generator=gen)
    got = fp8.fp8_grad_product_4bit(dy, *four, 64, "e4m3")
    assert alive == [[False]]  # dy quantised once, the row-major codes already gone
    codes, scale = real_from_4bit(*four, (48, 64))
    assert torch.equal(got, fp8.fp8_grad_product(dy, codes, scale, "e4m3"))
    out = torch.empty(9, 64)
    assert fp8.fp8_grad_product_4bit(dy, *four, 64, "e4m3", out) is out and torch.equal(out, got)


def test_a_block_over_fp8_bases_compiles_to_one_graph_with_the_in_place_backward():
    """A patched decoder block over FP8 bases under ``torch.compile`` (fullgraph, aot_eager): no graph
    break, the FP8 LoRA op in the graph, the down projection's in-place backward run, and the
    output and every gradient equal to eager's."""
    check_block_compiles(None, "sloth.lora_linear_fp8", "sloth.lora_linear_fp8_backward_")


def check_block_compiles(settings, forward_op: str, backward_op: str) -> None:
    """The first decoder block of a tiny Llama with LoRA over FP8 bases, patched with ``settings``,
    under ``torch.compile`` (fullgraph): no graph break, ``forward_op`` in the graph, ``backward_op``
    once in the backward graph, and the output and every gradient equal to eager's."""
    import test_patching as tp
    from test_compile import forward_backward
    from torch._dynamo.backends.common import aot_autograd

    from lightning_sloth.patching import apply_kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    try:
        model = tp.lora(tp.tiny_model("llama"))
        fp8_base_model(model, grad_format="e4m3")
        apply_kernels(model, settings)
        base = model.get_base_model()
        gen = torch.Generator().manual_seed(2)
        hidden = torch.randn(2, 12, 64, generator=gen)
        positions = torch.arange(12).expand(2, -1)
        kwargs = dict(
            attention_mask=None,
            position_ids=positions,
            position_embeddings=base.model.rotary_emb(hidden, positions),
        )
        block = base.model.layers[0]
        explained = torch._dynamo.explain(block)(hidden, **kwargs)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        assert forward_op in explained.graphs[0].code
        grad_out = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
        expected = forward_backward(block, hidden, kwargs, grad_out)
        torch._dynamo.reset()
        backward_graphs = []

        def keep_backward(graph, _inputs):
            backward_graphs.append(graph.code)
            return graph

        backend = aot_autograd(fw_compiler=lambda graph, _inputs: graph, bw_compiler=keep_backward)
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        actual = forward_backward(block, hidden, kwargs, grad_out, call=compiled)
        (code,) = backward_graphs  # one backward graph: the block
        assert code.count(backward_op) == 1, code
        torch.testing.assert_close(actual[:2], expected[:2], rtol=0, atol=0)
        assert actual[2].keys() == expected[2].keys() and actual[2]
        for name, grad in expected[2].items():
            torch.testing.assert_close(actual[2][name], grad, rtol=0, atol=0, msg=name)
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
