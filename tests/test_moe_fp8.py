"""FP8 MoE expert weights on CPU: the grouped op against the per-expert FP8 emulation of the linear
layers (forward and every gradient, each input-gradient format), opcheck, the storage (layout, scales,
state dict, dequantisation), ``fp8_base_model`` on a MoE model, and whole models against the eager
experts + PEFT on the dequantised weights."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_moe import EXPERT_LORA, FAMILIES, VOCAB, tiny_moe
from torch import nn

from lightning_sloth.moe import group_by_expert
from lightning_sloth.moe.fp8 import (
    FP8Experts,
    dequantize_experts_fp8,
    expert_fp8_storage,
    has_fp8_experts,
    lora_grouped_mm_fp8,
    quantize_experts_fp8,
)
from lightning_sloth.moe.switch import fused_permutation_setting, set_fused_permutation
from lightning_sloth.ops.fp8_formats import (
    FP8_DTYPES,
    dequantize_rows,
    fp8_linear_grad_reference,
    fp8_linear_reference,
    quantize_rows,
)
from lightning_sloth.patching import apply_experts
from lightning_sloth.quant import dequantize_model
from lightning_sloth.quant.fp8 import FP8_EXPERTS_MIN_WIDTH, fp8_base_model

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
E4M3 = FP8_DTYPES["e4m3"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _storage(weight_nk: torch.Tensor, grad_format: str = "e4m3") -> FP8Experts:
    e, n, k = weight_nk.shape
    codes, scale = quantize_rows(weight_nk.reshape(e * n, k), "e4m3")
    codes = codes.view(torch.uint8).view(e, n, k)
    return FP8Experts(codes, codes.transpose(-2, -1).contiguous(), scale.view(e, n), grad_format)


def _inputs(rank: int, bias: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    experts, n_in, n_out = 4, 32, 48
    storage = _storage(torch.randn(experts, n_out, n_in, generator=gen) * 0.1)
    index = torch.randint(0, experts, (9, 2), generator=gen)
    index[0] = torch.tensor([0, 1])
    index[:, 0].clamp_(max=2)  # expert 3 may go without rows
    grouping = group_by_expert(index, experts)
    x = torch.randn(18, n_in, generator=gen, dtype=dtype).requires_grad_()
    a = (torch.randn(experts, rank, n_in, generator=gen, dtype=dtype) * 0.3).requires_grad_()
    b = (torch.randn(experts, n_out, rank, generator=gen, dtype=dtype) * 0.3).requires_grad_()
    bias_t = torch.randn(experts, n_out, generator=gen, dtype=dtype).requires_grad_() if bias else None
    return storage, grouping, x, a, b, bias_t


def _reference(storage, grouping, x, a, b, bias, scale, grad, grad_format):
    """Per expert group: the linear layers' FP8 emulation for the base product and its input
    gradient, the LoRA and bias terms by autograd in float64."""
    codes = storage.codes.view(E4M3)
    ends = grouping.ends.tolist()
    ids = grouping.expert_ids
    x64 = x.detach().double().requires_grad_()
    lora = [t.detach().double().requires_grad_() for t in (a, b)]
    bias64 = bias.detach().double().requires_grad_() if bias is not None else None
    base, dx_base, extra = [], [], []
    start = 0
    for e, end in enumerate(ends):
        rows = slice(start, end)
        w, s = codes[e], storage.scale[e][:, None]
        base.append(fp8_linear_reference(x.detach()[rows], w, s).double())
        dx_base.append(fp8_linear_grad_reference(grad[rows], w, s, grad_format).double())
        term = scale * (x64[rows] @ lora[0][e].t()) @ lora[1][e].t()
        if bias64 is not None:
            term = term + bias64[e]
        extra.append(term)
        start = end
    extra = torch.cat(extra)
    leaves = [x64, *lora] + ([bias64] if bias64 is not None else [])
    grads = torch.autograd.grad(extra, leaves, grad.double(), allow_unused=True)
    out = torch.cat(base) + extra.detach()
    dx = torch.cat(dx_base) + grads[0]
    assert ids.shape[0] == x.shape[0]
    return out, [dx, *grads[1:]]


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize(("rank", "bias"), [(4, False), (2, True), (0, False)])
def test_op_matches_the_per_expert_fp8_emulation(rank, bias, grad_format):
    storage, grouping, x, a, b, bias_t = _inputs(rank, bias)
    storage = FP8Experts(storage.codes, storage.codes_t, storage.scale, grad_format)
    lora = (a, b) if rank else (None, None)
    y = lora_grouped_mm_fp8(
        x, storage, *lora, 1.5, grouping.ends, bias=bias_t, expert_ids=grouping.expert_ids
    )
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    leaves = [x, *((a, b) if rank else ())] + ([bias_t] if bias else [])
    got = torch.autograd.grad(y, leaves, grad)
    want_y, want = _reference(storage, grouping, x, a, b, bias_t, 1.5, grad, grad_format)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    want = [w for w in want if w is not None]
    if not rank:
        want = [want[0]] + want[3:]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_the_product_quantises_the_rows_and_the_weight_per_channel():
    storage, grouping, x, a, b, _ = _inputs(0, False)
    y = lora_grouped_mm_fp8(x, storage, None, None, 0.0, grouping.ends, expert_ids=grouping.expert_ids)
    qx, sx = quantize_rows(x.detach(), "e4m3")
    weight = storage.dequantized()
    exact = torch.cat(
        [dequantize_rows(qx, sx)[rows] @ weight[e].t() for e, rows in enumerate(_row_slices(grouping.ends))]
    )
    torch.testing.assert_close(y, exact, rtol=1e-6, atol=1e-6)
    # e4m3's rounding: a few percent from the unquantised product, never more
    dense = torch.cat([x.detach()[rows] @ weight[e].t() for e, rows in enumerate(_row_slices(grouping.ends))])
    assert 1e-3 < _rel(y, dense) < 0.06


def _row_slices(ends: torch.Tensor) -> list[slice]:
    out, start = [], 0
    for end in ends.tolist():
        out.append(slice(start, end))
        start = end
    return out


def test_opcheck():
    from lightning_sloth.moe.fp8 import _backward_op, _op

    storage, grouping, x, a, b, bias_t = _inputs(2, True)
    args = (
        x, storage.codes, storage.codes_t, storage.scale, bias_t, a, b, 0.5, grouping.ends,
        grouping.expert_ids, "e4m3",
    )  # fmt: skip
    torch.library.opcheck(_op, args)
    y, xa = _op(*args)
    back = (torch.randn_like(y), x.detach(), xa, storage.codes_t, storage.scale, a.detach(), b.detach(), 0.5,
            grouping.ends, grouping.expert_ids, "e4m3", True, True, True)  # fmt: skip
    torch.library.opcheck(_backward_op, back)


def test_bad_shapes_and_dtypes_are_clear_errors():
    storage, grouping, x, a, b, _ = _inputs(2, False)
    with pytest.raises(ValueError, match="do not fit"):
        lora_grouped_mm_fp8(x[:, :16], storage, a, b, 1.0, grouping.ends, expert_ids=grouping.expert_ids)
    with pytest.raises(ValueError, match="expert_ids"):
        lora_grouped_mm_fp8(x, storage, a, b, 1.0, grouping.ends)
    with pytest.raises(TypeError, match="floating-point"):
        lora_grouped_mm_fp8(x.int(), storage, None, None, 1.0, grouping.ends, expert_ids=grouping.expert_ids)


# ------------------------------------------------------------------------------------ storage
def _experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m for n, m in model.named_modules() if hasattr(m, "is_transposed") and hasattr(m, "num_experts")
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_storage_keeps_the_layout_and_round_trips(family):
    model = tiny_moe(family, experts=4)
    experts = next(iter(_experts_modules(model).values()))
    dense = {w: getattr(experts, w).detach().clone() for w in ("gate_up_proj", "down_proj")}
    assert quantize_experts_fp8(experts) == ["gate_up_proj", "down_proj"]
    assert quantize_experts_fp8(experts) == []  # idempotent
    assert has_fp8_experts(experts)
    for name, weight in dense.items():
        param = getattr(experts, name)
        assert param.dtype == torch.uint8 and param.shape == weight.shape and not param.requires_grad
        storage = expert_fp8_storage(experts, name)
        nk = weight.transpose(-2, -1) if experts.is_transposed else weight
        assert storage.codes.shape == nk.shape and storage.codes_t.shape == nk.transpose(-2, -1).shape
        assert torch.equal(storage.codes_t, storage.codes.transpose(-2, -1))
        # one scale per output channel of each expert: the channel's largest magnitude on e4m3's max
        want = nk.abs().amax(-1) / torch.finfo(E4M3).max
        torch.testing.assert_close(storage.scale, want, rtol=1e-6, atol=0)
        assert 0 < _rel(storage.dequantized(), nk) < 0.05
    state = {k: v.clone() for k, v in experts.state_dict().items()}
    assert not any(k.endswith("_transposed") for k in state)  # remade on load, never saved
    assert state["gate_up_proj_scale"].dtype == torch.int32  # a dtype cast of the model keeps it
    fresh = tiny_moe(family, experts=4, seed=1)
    other = next(iter(_experts_modules(fresh).values()))
    quantize_experts_fp8(other)
    other.load_state_dict(state)
    for name in dense:
        a, b = expert_fp8_storage(other, name), expert_fp8_storage(experts, name)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.codes_t, b.codes_t)
    assert dequantize_experts_fp8(experts, torch.float32) == ["gate_up_proj", "down_proj"]
    assert not has_fp8_experts(experts) and "gate_up_proj_scale" not in experts.state_dict()
    assert experts.gate_up_proj.shape == dense["gate_up_proj"].shape
    assert _rel(experts.gate_up_proj, dense["gate_up_proj"]) < 0.05


def _peft(family: str, top_k: int = 2) -> nn.Module:
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_LORA, init_lora_weights=False
    )
    return get_peft_model(tiny_moe(family, experts=4, top_k=top_k), config).train()


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("grad_format", ["e4m3", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_with_fp8_experts_follows_eager_peft_on_the_dequantised_weights(family, grad_format):
    """Same loss and gradients up to the activations' e4m3 rounding; the expert LoRA factors all get
    gradients; the fused switch does not change an FP8 model (it takes the separate passes)."""
    ours = _peft(family, top_k=4)
    reference = copy.deepcopy(ours)
    ref_experts = _experts_modules(reference)
    for name, experts in _experts_modules(ours).items():
        assert quantize_experts_fp8(experts, grad_format) == ["gate_up_proj", "down_proj"]
        with torch.no_grad():
            for weight in ("gate_up_proj", "down_proj"):
                nk = expert_fp8_storage(experts, weight).dequantized()
                getattr(ref_experts[name], weight).copy_(
                    nk.transpose(-2, -1) if experts.is_transposed else nk
                )
    reference.base_model.model.set_experts_implementation("eager")
    assert len(apply_experts(ours).lora) == 2
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    loss_ref, grads_ref = _run(reference, ids)
    saved = fused_permutation_setting()
    try:
        set_fused_permutation(False)
        loss, grads = _run(ours, ids)
        set_fused_permutation(True)
        loss_fused, grads_fused = _run(ours, ids)
    finally:
        set_fused_permutation(saved)
    assert _rel(loss, loss_ref) <= 1e-2
    assert grads.keys() == grads_ref.keys()
    assert sum("experts" in n for n in grads) == 8
    # All gradients as one vector: the activations' e4m3 rounding (and with an e4m3 input gradient
    # the gradient's) moves it by 5-7% in these 2-layer random models, where every token goes to
    # every expert (top_k = E: no routing flips); a wrong scale, layout or expert is O(1). The
    # op's exact emulation is checked above.
    flat = torch.cat([grads[n].flatten() for n in grads_ref])
    flat_ref = torch.cat([g.flatten() for g in grads_ref.values()])
    assert _rel(flat, flat_ref) <= 0.1
    assert torch.equal(loss_fused, loss)
    for name, grad in grads.items():
        assert torch.equal(grads_fused[name], grad), name


def test_fp8_base_model_converts_wide_experts_or_as_told_and_skip_keeps_them():
    narrow = _peft("qwen3_moe")  # experts 24 wide: under FP8_EXPERTS_MIN_WIDTH, kept in bf16 by default
    apply_experts(narrow)
    assert not any("experts" in n for n in fp8_base_model(narrow))
    wide = tiny_moe("gpt_oss", experts=2)
    for experts in _experts_modules(wide).values():  # GPT-OSS layout: [E, H, 2I] and [E, I, H]
        width, hidden = FP8_EXPERTS_MIN_WIDTH, experts.down_proj.shape[2]
        experts.gate_up_proj = nn.Parameter(torch.randn(2, hidden, 2 * width) * 0.02)
        experts.down_proj = nn.Parameter(torch.randn(2, width, hidden) * 0.02)
    assert sum("experts" in n for n in fp8_base_model(wide)) == 4
    with pytest.raises(TypeError, match="experts"):
        fp8_base_model(tiny_moe("qwen3_moe"), experts="yes")
    model = _peft("qwen3_moe")
    apply_experts(model)
    converted = fp8_base_model(model, experts=True)
    assert sum(n.endswith(".gate_up_proj") and "experts" in n for n in converted) == 2
    assert all(has_fp8_experts(m) for m in _experts_modules(model).values())
    assert any(n.endswith("o_proj") for n in converted)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    _run(model, ids)
    assert dequantize_model(model)  # merge and export see dense weights again
    assert not any(has_fp8_experts(m) for m in _experts_modules(model).values())
    kept = _peft("gpt_oss")
    apply_experts(kept)
    converted = fp8_base_model(kept, skip=("lm_head", "experts"), experts=True)
    assert converted and not any("experts" in n for n in converted)
    assert not any(has_fp8_experts(m) for m in _experts_modules(kept).values())
    assert not any("experts" in n for n in fp8_base_model(_peft("gpt_oss"), experts=False))


def test_other_experts_implementation_is_a_clear_error():
    model = tiny_moe("qwen3_moe", experts=4)
    for experts in _experts_modules(model).values():
        quantize_experts_fp8(experts)
    model.set_experts_implementation("eager")
    with pytest.raises(RuntimeError, match="FP8"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_trainer_trains_fp8_experts_and_leaves_the_codes_untouched():
    """``SlothPrecision("32-true", base_dtype="fp8")`` through ``Trainer``: the experts and the linear
    layers go to FP8 (the emulation on CPU), the codes never move, the LoRA factors learn."""
    from test_quant_moe import train_recording_experts

    from lightning_sloth import SlothPrecision

    precision = SlothPrecision("32-true", base_dtype="fp8", fp8_experts=True)
    module, snapshot, losses = train_recording_experts(precision)
    experts = _experts_modules(module)
    assert len(snapshot) == 2 and all(has_fp8_experts(m) for m in experts.values())
    for name, state in snapshot.items():
        assert experts[name].gate_up_proj.dtype == torch.uint8 and "gate_up_proj_scale" in state
        for key, value in state.items():
            assert torch.equal(experts[name].state_dict()[key], value), (name, key)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
