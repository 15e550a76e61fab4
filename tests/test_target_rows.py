"""The fused loss with ``num_target_tokens``: logits only for the rows that carry a target, the
same loss and gradients; a count below the true one is refused, never a silently smaller loss."""

from __future__ import annotations

import pytest
import torch
from _models import add_lora, random_documents, tiny_llama, tiny_qwen3

from lightning_sloth import CausalLMModule, LoraSettings
from lightning_sloth.data import PackedCollator
from lightning_sloth.patching import _forwards, takes_target_count
from lightning_sloth.patching._forwards import target_rows
from lightning_sloth.transform import transform_model


def _batch():
    docs = random_documents([7, 3, 12, 5, 9], seed=1)
    # Prompts masked in the labels, as instruction data has them.
    samples = [(d, [-100] * (len(d) // 2) + d[len(d) // 2 :]) for d in docs]
    return PackedCollator(64, 0, pad_to="max_tokens")(samples)


def _step(make, **kwargs):
    model = add_lora(make(seed=0)).train()
    transform_model(model, kernels=True)
    batch = _batch()
    loss = model(**batch.model_inputs(), labels=batch.labels, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_target_rows_give_the_same_loss_and_gradients_from_fewer_logits(make, monkeypatch):
    batch = _batch()
    rows_seen = []
    fused = _forwards.linear_cross_entropy

    def spy(hidden, *args, **kwargs):
        rows_seen.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return fused(hidden, *args, **kwargs)

    monkeypatch.setattr(_forwards, "linear_cross_entropy", spy)
    want_loss, want = _step(make)
    loss, got = _step(make, num_target_tokens=batch.num_target_tokens)
    assert rows_seen == [64, batch.num_target_tokens] and batch.num_target_tokens < 40
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_target_rows_keep_position_order_and_refuse_a_short_count():
    hidden = torch.arange(12.0).reshape(1, 6, 2)
    targets = torch.tensor([[-100, 4, -100, 7, 9, -100]])
    rows, kept = target_rows(hidden, targets, 3)
    assert kept.tolist() == [4, 7, 9] and rows[:, 0].tolist() == [2.0, 6.0, 8.0]
    same, whole = target_rows(hidden, targets, 6)  # a count of every row: nothing selected
    assert same is hidden and whole is targets
    rows, kept = target_rows(hidden, targets, 4)  # above the true count: one ignored row more
    assert kept.tolist()[:3] == [4, 7, 9] and kept.tolist()[3] == -100
    with pytest.raises(RuntimeError, match="num_target_tokens is below"):
        target_rows(hidden, targets, 2)
    with pytest.raises(TypeError, match="non-negative Python int"):
        target_rows(hidden, targets, torch.tensor(3))


def test_the_module_passes_the_count_only_to_the_fused_loss():
    patched = CausalLMModule(tiny_llama(seed=0), lora=LoraSettings(r=4))
    transform_model(patched.model, kernels=True)
    assert takes_target_count(patched.model) and patched._fused_loss()
    plain = CausalLMModule(tiny_llama(seed=0), lora=LoraSettings(r=4))
    assert not takes_target_count(plain.model) and not plain._fused_loss()
    batch = _batch()
    loss = plain.training_step(batch, 0)  # the stock forward never sees the keyword
    assert torch.isfinite(loss)
    assert torch.isfinite(patched.training_step(batch, 0))
    assert patched.state_dict().keys() == plain.state_dict().keys()  # the cache adds no entry


def test_the_bench_passes_the_count_to_one_row_steps_of_the_fused_loss():
    from lightning_sloth.bench.measure import loss_kwargs
    from lightning_sloth.bench.systems import SUITE_SYSTEMS

    patched = add_lora(tiny_llama(seed=0))
    transform_model(patched, kernels=True)
    one = [{"input_ids": None}]
    assert loss_kwargs(patched, one, 37) == {"num_target_tokens": 37}
    assert loss_kwargs(patched, one * 2, 37) == {}  # the count is the step's, not a row's
    assert loss_kwargs(patched, one, None) == {}
    assert loss_kwargs(add_lora(tiny_llama(seed=0)), one, 37) == {}  # transformers' own loss
    patched._sloth_loss_all_rows = True  # the ablation system's switch
    assert loss_kwargs(patched, one, 37) == {}
    assert {"sloth_kernels_loss_all_rows", "sloth_kernels_full_recompute"} <= set(SUITE_SYSTEMS)
