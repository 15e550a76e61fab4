"""sloth::linear_cross_entropy on CPU: float64 references, transformers parity, opcheck, compile, Triton."""

import os
import sys
import textwrap

import _processes
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers.loss.loss_utils import ForCausalLMLoss

from lightning_sloth.ops.linear_cross_entropy import (
    LOGITS_CHUNK_ELEMENTS,
    _chunked_linear_cross_entropy,
    _cross_entropy_rows_reference_,
    default_chunk_size,
    linear_cross_entropy,
    shift_labels,
)

N, H, V = 37, 48, 1003


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def _inputs(dtype=torch.float32, bias=False, ignore_every=5, n=N):
    hidden = torch.randn(n, H, dtype=dtype)
    weight = (torch.randn(V, H) / H**0.5).to(dtype)
    targets = torch.randint(0, V, (n,))
    if ignore_every:
        targets[::ignore_every] = -100
    b = torch.randn(V, dtype=dtype) if bias else None
    return hidden, weight, b, targets


def _reference(hidden, weight, bias, targets, softcap=None, reduction="mean", num_items=None):
    """float64 loss and gradients of the unfused computation (full logits)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    logits = h @ w.t() + (b if b is not None else 0)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if num_items is not None:
        loss = F.cross_entropy(logits, targets, reduction="sum") / num_items
    else:
        loss = F.cross_entropy(logits, targets, reduction=reduction)
    return loss, leaves


def _close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("softcap", "bias", "chunk_size"),
    [(None, False, 8), (3.0, True, 8), (3.0, False, None), (None, True, None)],
)
def test_forward_backward_match_float64(softcap, bias, chunk_size):
    hidden, weight, b, targets = _inputs(bias=bias)
    hidden.requires_grad_()
    weight.requires_grad_()
    if b is not None:
        b.requires_grad_()
    grad_out = 2.7
    loss = linear_cross_entropy(hidden, weight, targets, bias=b, softcap=softcap, chunk_size=chunk_size)
    (loss * grad_out).backward()

    ref, (h, w, rb) = _reference(hidden, weight, b, targets, softcap=softcap)
    (ref * grad_out).backward()
    assert loss.dtype == torch.float32
    _close(loss, ref)
    _close(hidden.grad, h.grad)
    _close(weight.grad, w.grad)
    if b is not None:
        _close(b.grad, rb.grad)


def test_three_dim_noncontiguous_hidden():
    hidden = torch.randn(H, 3, 11).permute(1, 2, 0).requires_grad_()  # [3, 11, H], not contiguous
    weight = torch.randn(V, H) / H**0.5
    targets = torch.randint(0, V, (3, 11))
    targets[:, 0] = -100
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=5)
    loss.backward()
    ref, (h, _, _) = _reference(hidden.reshape(-1, H), weight, None, targets.reshape(-1))
    ref.backward()
    _close(loss, ref)
    _close(hidden.grad.reshape(-1, H), h.grad)


def test_sum_reduction_and_num_items_in_batch():
    hidden, weight, _, targets = _inputs()
    for kwargs, ref_kwargs in [
        ({"reduction": "sum"}, {"reduction": "sum"}),
        ({"num_items_in_batch": 91}, {"num_items": 91}),
        ({"num_items_in_batch": torch.tensor(91)}, {"num_items": 91}),
    ]:
        h = hidden.clone().requires_grad_()
        loss = linear_cross_entropy(h, weight, targets, chunk_size=16, **kwargs)
        loss.backward(torch.tensor(0.3))
        ref, (rh, _, _) = _reference(hidden, weight, None, targets, **ref_kwargs)
        ref.backward(torch.tensor(0.3, dtype=torch.float64))
        _close(loss, ref)
        _close(h.grad, rh.grad)


def test_float16_gradients_stay_in_range_under_loss_scaling():
    # A mean over many tokens makes each d logit tiny (p / count); normalising only in the backward,
    # after the loss scale, keeps float16 gradients out of the subnormal range.
    hidden, weight, _, targets = _inputs(n=300)
    hidden = hidden.half().requires_grad_()
    loss = linear_cross_entropy(hidden, weight.half(), targets, chunk_size=64)
    (loss * 4096).backward()
    ref, (h, _, _) = _reference(hidden, weight.half(), None, targets)
    (ref * 4096).backward()
    assert (hidden.grad.double() - h.grad).norm() < 2e-3 * h.grad.norm()


def test_weight_gradient_only_when_hidden_frozen():
    hidden, weight, _, targets = _inputs()
    weight.requires_grad_()
    linear_cross_entropy(hidden, weight, targets, chunk_size=10).backward()
    ref, (_, w, _) = _reference(hidden, weight, None, targets)
    ref.backward()
    _close(weight.grad, w.grad)


def test_all_ignored_matches_f_cross_entropy():
    hidden, weight, _, targets = _inputs()
    targets[:] = -100
    hidden.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    loss.backward()
    logits = (hidden.detach() @ weight.t()).requires_grad_()
    ref = F.cross_entropy(logits, targets)
    ref.backward()
    assert torch.isnan(loss) and torch.isnan(ref)  # 0 / 0, as F.cross_entropy
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and not logits.grad.any()
    assert linear_cross_entropy(hidden, weight, targets, reduction="sum").item() == 0.0


def test_matches_transformers_for_causal_lm_loss():
    hidden, weight, _, _ = _inputs(ignore_every=0)
    labels = torch.randint(0, V, (1, N))
    labels[0, :4] = -100  # a prompt
    labels[0, 20] = -100  # a document's first position in a packed row
    logits = hidden @ weight.t()
    targets = shift_labels(labels)
    assert targets.shape == labels.shape and targets[0, -1] == -100
    for num_items in (None, torch.tensor(50)):
        expected = ForCausalLMLoss(logits.unsqueeze(0), labels, V, num_items_in_batch=num_items)
        got = linear_cross_entropy(hidden.unsqueeze(0), weight, targets, num_items_in_batch=num_items)
        _close(got, expected)


def test_no_grad_and_frozen_inputs_skip_gradient_work():
    hidden, weight, _, targets = _inputs()
    hidden.requires_grad_()

    class RecordFlags(TorchDispatchMode):
        flags = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.sloth.linear_cross_entropy.default:
                self.flags.append(args[-3:])
            return func(*args, **(kwargs or {}))

    with RecordFlags() as mode, torch.no_grad():
        linear_cross_entropy(hidden, weight, targets)
    with mode:
        linear_cross_entropy(hidden.detach(), weight, targets)
        linear_cross_entropy(hidden, weight, targets)
    assert mode.flags == [(False, False, False), (False, False, False), (True, False, False)]

    loss, d_hidden, d_weight, d_bias, _ = torch.ops.sloth.linear_cross_entropy(
        hidden.detach(), weight, None, targets, None, -100, None, "mean", 16, False, False, False
    )
    assert d_hidden.numel() == d_weight.numel() == d_bias.numel() == 0
    _close(loss, _reference(hidden, weight, None, targets)[0])


def test_chunks_never_hold_full_logits():
    assert default_chunk_size(128256) == 1024
    assert default_chunk_size(128256) * 128256 <= LOGITS_CHUNK_ELEMENTS
    assert default_chunk_size(10**9) == 1
    assert default_chunk_size(1000, max_elements=5000) == 5

    hidden, weight, _, targets = _inputs(n=200)
    hidden.requires_grad_()
    weight.requires_grad_()
    largest = []

    class LargestOutput(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest.extend(
                t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            )
            return out

    with LargestOutput():
        _chunked_linear_cross_entropy(
            hidden.detach(), weight.detach(), None, targets, None, -100, 2.0, "mean", 32,
            True, True, False, _cross_entropy_rows_reference_,
        )  # fmt: skip
    assert max(largest) <= max(32 * V, V * H) < 200 * V


def test_bad_inputs_raise_clear_errors():
    hidden, weight, _, targets = _inputs()
    with pytest.raises(TypeError, match="hidden must be a floating-point"):
        linear_cross_entropy(hidden.long(), weight, targets)
    with pytest.raises(ValueError, match="weight must have shape"):
        linear_cross_entropy(hidden, weight[:, :-1], targets)
    with pytest.raises(TypeError, match="share a dtype"):
        linear_cross_entropy(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(TypeError, match="targets must be an integer"):
        linear_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        linear_cross_entropy(hidden, weight, targets, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(hidden, weight, targets, softcap=0.0)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear_cross_entropy(hidden, weight, targets, bias=torch.zeros(V - 1))


def test_autocast_casts_like_lm_head():
    hidden, weight, _, targets = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
    expected = F.cross_entropy((hidden.bfloat16() @ weight.bfloat16().t()).float(), targets)
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, False, False)])
def test_opcheck(flags):
    hidden, weight, b, targets = _inputs(n=13, bias=True)
    args = (
        hidden.requires_grad_(flags[0]),
        weight.requires_grad_(flags[1]),
        b.requires_grad_(flags[2]),
        targets,
        torch.tensor(9),
        -100,
        2.5,
        "mean",
        4,
        *flags,
    )
    torch.library.opcheck(torch.ops.sloth.linear_cross_entropy.default, args)


def test_flop_count():
    hidden, weight, _, targets = _inputs()
    hidden.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(hidden, weight, targets).backward()
    assert counter.get_total_flops() == 2 * 2 * N * H * V


def test_compile_fullgraph_matches_eager():
    hidden, weight, _, targets = _inputs()

    def loss_fn(h, w):
        return linear_cross_entropy(h, w, targets, softcap=4.0, chunk_size=16)

    h_eager, w_eager = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_comp, w_comp = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = loss_fn(h_eager, w_eager)
    # The on-disk compile caches key on a graph that holds only a call to the op, so an entry compiled
    # before an edit of the op's backward would be reused: compile afresh.
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        got = torch.compile(loss_fn, fullgraph=True)(h_comp, w_comp)
    (expected * 1.5).backward()
    (got * 1.5).backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(h_comp.grad, h_eager.grad)
    torch.testing.assert_close(w_comp.grad, w_eager.grad)


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from lightning_sloth.kernels.cross_entropy import cross_entropy_rows_
    from lightning_sloth.ops.linear_cross_entropy import (
        _chunked_linear_cross_entropy, _cross_entropy_rows_reference_,
    )

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for softcap in (None, 2.5):
            rows, vocab = 6, 77
            logits = (3 * torch.randn(rows, vocab)).to(dtype)
            targets = torch.randint(0, vocab, (rows,))
            targets[1] = -100
            ref_logits, got_logits = logits.clone(), logits.clone()
            ref = _cross_entropy_rows_reference_(ref_logits, targets, -100, softcap, True)
            got = cross_entropy_rows_(got_logits, targets, -100, softcap, True)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_logits, ref_logits, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-3)
            no_grad_logits = logits.clone()
            got = cross_entropy_rows_(no_grad_logits, targets, -100, softcap, False)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(no_grad_logits, logits)

    # The whole chunk loop with the kernel; then an all-ignored batch (nan loss, zero gradients).
    hidden, weight = torch.randn(11, 16), torch.randn(77, 16) / 4
    targets = torch.randint(0, 77, (11,))
    targets[:4] = -100
    args = (hidden, weight, None, targets, None, -100, 3.0, "mean", 4, True, True, False)
    got = _chunked_linear_cross_entropy(*args, cross_entropy_rows_)
    ref = _chunked_linear_cross_entropy(*args, _cross_entropy_rows_reference_)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    targets[:] = -100
    got = _chunked_linear_cross_entropy(hidden, weight, None, targets, None, -100, None, "mean", 4, True, False, False, cross_entropy_rows_)
    assert torch.isnan(got[0]) and not got[1].any() and got[4] == 0
    print("ok")
    """
)


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = _processes.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
