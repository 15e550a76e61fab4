"""SlothFSDPStrategy (FSDP2) on two CPU processes (gloo): parity with one process, resume, errors.

One worker pair (started like torchrun starts processes) runs every training case of this file;
the tests below read its records. The reference is one process on the same global batch: the
sum of token losses over both ranks' micro-batches divided by all their target tokens.
"""

import _fsdp
import pytest
import torch
from hydra import compose, initialize_config_module
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_sloth import SlothDDPStrategy, SlothFSDPStrategy, build
from lightning_sloth.config import Sharding
from lightning_sloth.plugins import sharding
from lightning_sloth.plugins.sharding import (
    ShardingError,
    mixed_precision_policy,
    shard_model,
    shardable_layers,
)
from lightning_sloth.plugins.strategy import _ShardedSpawnLauncher


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _fsdp.run(_fsdp.parity_and_resume, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("family,lora,kernels", _fsdp.PARITY_CASES)
def test_loss_and_gradients_equal_one_process_on_the_global_batch(runs, family, lora, kernels):
    record = runs[0][(family, lora)]
    other = runs[1][(family, lora)]
    assert any("fully_shard" in step for step in record["report"])
    assert ("kernels" in record["report"]) == kernels
    assert len(record["steps"]) == 2
    assert len(record["steps"][0]["batches"]) == _fsdp.ACCUMULATE
    for index, (step0, step1) in enumerate(zip(record["steps"], other["steps"])):
        # An epoch's last window may be shorter; the normalisation stays exact there too.
        assert len(step0["batches"]) == len(step1["batches"])
        # Each rank packed its own share: different batches, different target counts.
        assert not torch.equal(step0["batches"][0].input_ids, step1["batches"][0].input_ids)
        loss, grads, norm = _fsdp.reference_step(family, lora, step0, step1)
        torch.testing.assert_close(
            _fsdp.global_loss(record, other, step=index), float(loss), rtol=1e-5, atol=0
        )
        assert grads.keys() == step0["grads"].keys()
        assert all(("lora_" in n) == lora for n in grads) or not lora
        for name, grad in grads.items():
            atol = 1e-5 * float(grad.abs().max())  # float32 sums in another order
            torch.testing.assert_close(step0["grads"][name], grad, rtol=1e-5, atol=atol, msg=name)
    # GradientFlowGuard's norm over the sharded gradients (last step) is the global norm.
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("family,lora,kernels", _fsdp.PARITY_CASES)
def test_export_holds_the_trained_weights_gathered_from_the_shards(runs, family, lora, kernels):
    export = runs[0][(family, lora)]["export"]  # adapter (PEFT format) or the full model
    assert export["saved"] > 0 and export["matched"] == export["saved"]
    assert export["max_diff"] == 0.0


def test_kernel_ops_see_local_tensors_under_fsdp(runs):
    ops = runs[0]["ops"]
    assert ops["rms_norm"] > 0 and ops["linear_cross_entropy"] > 0 and ops["fused_lora_forward"] > 0
    assert ops["dtensor_args"] == 0


def test_resume_from_a_sharded_checkpoint_continues_the_same_loss_curve(runs):
    for rank in (0, 1):
        resume = runs[rank]["resume"]
        assert resume["checkpoint_is_dir"] and ".metadata" in resume["checkpoint_files"]
        full, resumed = resume["full"], resume["resumed"]
        assert len(full) == 2 * len(resumed) and len(resumed) >= 2
        torch.testing.assert_close(resumed, full[len(resumed) :], rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory):
    return _fsdp.run(_fsdp.ddp_moe_nf4_offload, tmp_path_factory.mktemp("fsdp_more"))


def _assert_step_matches_one_process(record, other, family, lora, quantize=None):
    step0, step1 = record["steps"][0], other["steps"][0]
    assert not torch.equal(step0["batches"][0].input_ids, step1["batches"][0].input_ids)
    loss, grads, _ = _fsdp.reference_step(family, lora, step0, step1, quantize=quantize)
    torch.testing.assert_close(_fsdp.global_loss(record, other, step=0), float(loss), rtol=1e-5, atol=0)
    assert grads and grads.keys() == step0["grads"].keys()
    for name, grad in grads.items():
        atol = 1e-5 * float(grad.abs().max())  # float32 sums in another order
        torch.testing.assert_close(step0["grads"][name], grad, rtol=1e-5, atol=atol, msg=name)
    return grads


def test_fp8_bases_and_experts_under_fsdp_match_one_process(more_runs):
    """``SlothPrecision(base_dtype="fp8", fp8_experts=True)`` under FSDP2: the e4m3 codes of the
    linear layers and the experts are sharded like any frozen parameter, gathered bit for bit (they
    equal one process's codes of the same weights), and the step equals one process on the global
    batch up to e4m3 code flips (float32 sums in another order can move a value across a rounding
    boundary, as in ``tests/test_fp8.py``)."""
    record, other = more_runs[0]["fp8"], more_runs[1]["fp8"]
    assert any("fully_shard" in a for a in record["report"])
    sharded, codes = record["codes_sharded"]
    assert codes == 8 and sharded == codes  # q/o per layer and the experts' two weights, two layers
    step0, step1 = record["steps"][0], other["steps"][0]
    loss, grads, _ = _fsdp.reference_step("qwen3_moe", True, step0, step1, base_dtype="fp8")
    torch.testing.assert_close(_fsdp.global_loss(record, other, step=0), float(loss), rtol=1e-4, atol=0)
    assert grads and grads.keys() == step0["grads"].keys()
    assert sum("experts" in n and "lora_B" in n for n in grads) == 4
    for name, grad in grads.items():
        error = (step0["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < 2**-6, (name, float(error))


def test_ddp_normalises_by_the_global_target_tokens(more_runs):
    """sloth_ddp: gradients of one process on the global batch, not a mean of per-rank means."""
    record, other = more_runs[0]["ddp"], more_runs[1]["ddp"]
    assert not any("fully_shard" in step for step in record["report"])
    assert len(record["steps"][0]["batches"]) == _fsdp.ACCUMULATE
    counts = [b.num_target_tokens for r in (record, other) for b in r["steps"][0]["batches"]]
    assert len(set(counts)) > 1  # a per-micro-batch mean would weight their tokens differently
    _assert_step_matches_one_process(record, other, "llama", False)


def test_moe_with_expert_lora_under_fsdp_matches_one_process(more_runs):
    record, other = more_runs[0]["moe"], more_runs[1]["moe"]
    assert any(a.startswith("moe experts") for a in record["report"])
    assert any("fully_shard" in a for a in record["report"])
    grads = _assert_step_matches_one_process(record, other, "qwen3_moe", True)
    # B starts at zero, so A's gradient does too; B's is what the experts' LoRA path produced.
    experts = [n for n in grads if "experts" in n and "lora_B" in n]
    assert len(experts) == 4 and all(float(grads[n].abs().max()) > 0 for n in experts)


def test_nf4_base_weights_are_sharded_and_match_one_process(more_runs):
    """A Qwen3-MoE in NF4 (projections and 3-D experts) with LoRA on both: FSDP2 shards the packed
    codes, gathers them back bit for bit (checked in reference_step), the step is one process's,
    the exported adapter holds the trained weights, and a run resumed from a sharded checkpoint
    continues the same loss curve."""
    record, other = more_runs[0]["nf4"], more_runs[1]["nf4"]
    assert any(a.startswith("4-bit base weights") for a in record["report"])
    sharded, total = record["codes_sharded"]
    assert total > 0 and sharded == total  # every 4-bit weight is a DTensor shard between steps
    packed = [n for n, p in record["steps"][0]["params"].items() if p.dtype == torch.uint8]
    assert any(n.endswith("q_proj.base_layer.weight") for n in packed)
    assert any("experts" in n and n.endswith(".gate_up_proj") for n in packed)
    grads = _assert_step_matches_one_process(record, other, "qwen3_moe", True, quantize="nf4")
    assert all("lora_" in n for n in grads)
    export = record["export"]  # the adapter, gathered from the shards
    assert export["saved"] > 0 and export["matched"] == export["saved"] and export["max_diff"] == 0.0
    for rank in (0, 1):  # resumed from the first epoch's sharded checkpoint: the same second epoch
        full, resumed = more_runs[rank]["nf4"]["losses"], more_runs[rank]["nf4"]["resumed"]
        assert len(full) == 2 * len(resumed) and len(resumed) >= 2
        torch.testing.assert_close(resumed, full[len(resumed) :], rtol=1e-6, atol=0)


def test_nf4_under_bf16_mixed_trains_the_same_with_torch_2_11s_fsdp2_dtype_rule(more_runs):
    """torch 2.11's FSDP2 casts integer parameters to the mixed-precision dtype (the packed codes
    reached the LoRA op as bf16 values on two H200s); with the strategy's back-port a run under
    that rule is bit for bit the run under torch 2.13's."""
    for rank in (0, 1):
        a, b = more_runs[rank]["nf4_bf16_torch_2_11"], more_runs[rank]["nf4_bf16"]
        assert a["codes_sharded"] == b["codes_sharded"] and a["codes_sharded"][0] > 0
        assert a["losses"] == b["losses"]
    a, b = more_runs[0]["nf4_bf16_torch_2_11"]["steps"][0], more_runs[0]["nf4_bf16"]["steps"][0]
    assert a["grads"].keys() == b["grads"].keys() and a["grads"]
    for name, grad in b["grads"].items():
        assert torch.equal(a["grads"][name], grad), name


def test_offload_under_fsdp_offloads_every_checkpointed_layer_input(more_runs):
    """The offloader's hooks see the checkpoint inputs on both ranks (2 layers: the first is
    offloaded, the last recomputed), and the step's gradients are one process's."""
    for rank in (0, 1):
        run = more_runs[rank]["offload"]
        assert "activation offload (on)" in run["report"]
        stats = run["offload"]
        batches = run["steps"][0]["batches"]
        assert stats["steps"] == len(batches)  # one forward per micro-batch
        layer_inputs = sum(b.input_ids.numel() * 64 * 4 for b in batches)  # [1, T, 64] float32
        assert stats["offloaded_bytes_per_step"] * stats["steps"] == layer_inputs
        assert stats["prefetched"] + stats["fetched_on_demand"] == len(batches)
    _assert_step_matches_one_process(more_runs[0]["offload"], more_runs[1]["offload"], "llama", True)


def test_a_lora_base_kept_whole_on_every_rank_trains_like_one_process(more_runs):
    """shard_frozen=False: the frozen base stays a plain tensor on both ranks (no DTensor reaches
    the ops), only the adapters are sharded, and the step equals one process on the global batch."""
    for rank in (0, 1):
        run = more_runs[rank]["replicated_base"]
        assert any("frozen tensors kept whole on every rank" in applied for applied in run["report"])
        # no unit per layer: the root's unit holds every adapter
        assert any("their adapters in the root's unit" in applied for applied in run["report"])
    _assert_step_matches_one_process(
        more_runs[0]["replicated_base"], more_runs[1]["replicated_base"], "llama", True
    )


def test_a_4bit_base_kept_whole_keeps_its_scales_whole_and_trains_like_one_process(more_runs):
    """QLoRA under shard_frozen=False (what the default picks on a GPU with room): the packed codes and
    their block scales stay whole on every rank (no DTensor), the adapters sit in the root's unit, the
    step equals one process on the global batch, the exported adapter holds the trained weights, and
    a run resumed from the first epoch's sharded checkpoint continues the same loss curve."""
    record, other = more_runs[0]["nf4_whole_base"], more_runs[1]["nf4_whole_base"]
    assert any("their adapters in the root's unit" in applied for applied in record["report"])
    sharded, total = record["codes_sharded"]
    assert total > 0 and sharded == 0
    grads = _assert_step_matches_one_process(record, other, "qwen3_moe", True, quantize="nf4")
    assert grads and all("lora_" in n for n in grads)
    export = record["export"]
    assert export["saved"] > 0 and export["matched"] == export["saved"] and export["max_diff"] == 0.0
    for rank in (0, 1):
        full, resumed = (
            more_runs[rank]["nf4_whole_base"]["losses"],
            more_runs[rank]["nf4_whole_base"]["resumed"],
        )
        assert len(full) == 2 * len(resumed) and len(resumed) >= 2
        torch.testing.assert_close(resumed, full[len(resumed) :], rtol=1e-6, atol=0)


def test_frozen_weights_are_replicated_by_rule():
    model = _fsdp.tiny_model("llama", 64, hidden=32)
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    frozen = {p for p in model.parameters() if not p.requires_grad}
    cpu = torch.device("cpu")
    assert sharding.frozen_to_replicate(model, cpu, False) == frozen
    assert sharding.frozen_to_replicate(model, cpu, True) == set()
    assert sharding.frozen_to_replicate(model, cpu, "auto") == set()  # "auto" replicates on GPUs only
    with pytest.raises(ShardingError, match="shard_frozen takes"):
        sharding.frozen_to_replicate(model, cpu, "yes")
    meta = _fsdp.tiny_model("llama", 64, hidden=32, meta=True).requires_grad_(False)
    with pytest.raises(ShardingError, match="meta device"):
        sharding.frozen_to_replicate(meta, cpu, False)
    assert sharding.frozen_to_replicate(meta, torch.device("cuda", 0), "auto") == set()


def test_replicated_weights_are_stored_in_the_policys_compute_dtype():
    """Under bf16-mixed FSDP2 casts its units' inputs to bfloat16: a replicated frozen weight is
    stored in bfloat16 too (integer 4-bit codes untouched); without a param dtype nothing changes."""
    weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    codes = nn.Parameter(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    sharding.cast_replicated({weight}, mixed_precision_policy("32-true"))
    assert weight.dtype == torch.float32
    expected = weight.detach().to(torch.bfloat16)
    sharding.cast_replicated({weight, codes}, mixed_precision_policy("bf16-mixed"))
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, expected) and codes.dtype == torch.uint8


def test_one_device_is_refused_with_a_clear_error():
    with pytest.raises(ShardingError, match="one device; use strategy='sloth'"):
        Trainer(accelerator="cpu", devices=1, strategy="sloth_fsdp", logger=False)


@pytest.mark.parametrize("node,torchs", [("node_offload", "offload"), ("node_full", "full")])
def test_node_checkpoint_under_fsdp_equals_torchs_bit_for_bit_with_as_many_all_gathers(
    more_runs, node, torchs
):
    """checkpoint_impl='node' under FSDP2 (LoRA with offload, full fine-tuning): the same losses
    and gradients as torch's checkpoint, bit for bit, hence one process's on the global batch; the
    same number of all-gathers (each layer once in the forward, once in the backward: FSDP2 does
    not reshard inside a backward); the offloader sees the same layer inputs."""
    for rank in (0, 1):
        a, b = more_runs[rank][node], more_runs[rank][torchs]
        assert a["losses"] == b["losses"]
        assert a["all_gathers"] == b["all_gathers"] > 0
        assert a["offload"] == b["offload"]
        micro_batches = len(more_runs[rank][node]["steps"][0]["batches"])
        assert (a["node_forwards"], b["node_forwards"]) == (2 * micro_batches, 0)  # 2 layers
    a, b = more_runs[0][node]["steps"][0], more_runs[0][torchs]["steps"][0]
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        assert torch.equal(a["grads"][name], grad), name
    lora = node == "node_offload"
    _assert_step_matches_one_process(more_runs[0][node], more_runs[1][node], "llama", lora)


def test_gathered_weights_kept_for_the_backward_train_bit_for_bit_with_fewer_all_gathers(more_runs):
    """reshard_after_forward=False with the node checkpoint (LoRA with offload; what the default
    picks for LoRA on a GPU with room for the gathered model): losses and gradients bit for bit
    those of resharding after each forward (hence one process's on the global batch), with fewer
    all-gathers (the backward finds its weights still gathered); the offloader sees the same
    layer inputs."""
    for rank in (0, 1):
        a, b = more_runs[rank]["node_gathered"], more_runs[rank]["node_offload"]
        assert (
            "fully_shard (2 decoder layers, gathered from forward to backward, then the root)" in a["report"]
        )
        assert "fully_shard (2 decoder layers, then the root)" in b["report"]
        assert a["losses"] == b["losses"]
        assert 0 < a["all_gathers"] < b["all_gathers"]
        assert a["offload"] == b["offload"]
    a, b = more_runs[0]["node_gathered"]["steps"][0], more_runs[0]["node_offload"]["steps"][0]
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        assert torch.equal(a["grads"][name], grad), name


def test_node_with_grouped_units_and_gathered_weights_trains_bit_for_bit(more_runs):
    """The one-node checkpoint with both (tiny) layers in one FSDP2 unit, allowed where the weights
    stay gathered from forward to backward: losses and gradients bit for bit those of one layer per
    unit (hence one process's on the global batch), the offloader seeing the same inputs."""
    for rank in (0, 1):
        a, b = more_runs[rank]["node_unit2_gathered"], more_runs[rank]["node_gathered"]
        assert (
            "fully_shard (2 decoder layers, 2 per unit, gathered from forward to backward, then the root)"
            in a["report"]
        )
        assert a["losses"] == b["losses"]
        assert 0 < a["all_gathers"] <= b["all_gathers"]
        assert a["offload"] == b["offload"]
    a, b = more_runs[0]["node_unit2_gathered"]["steps"][0], more_runs[0]["node_gathered"]["steps"][0]
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        assert torch.equal(a["grads"][name], grad), name


def _lora_model(hidden: int = 64):
    from peft import LoraConfig, get_peft_model

    model = _fsdp.tiny_model("llama", 50, hidden=hidden)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_automatic_resharding_keeps_a_lora_models_weights_gathered_where_they_fit():
    from lightning_sloth.plugins.sharding import KEEP_GATHERED_SHARE, resolve_reshard_after_forward

    lora = _lora_model()
    fp32 = sum(p.numel() * 4 for p in lora.parameters())
    bf16 = mixed_precision_policy("bf16-mixed")
    # gathered in bf16 the model takes half its float32 bytes
    assert resolve_reshard_after_forward(lora, None, int(fp32 / 2 / KEEP_GATHERED_SHARE) + 1, bf16) is False
    assert resolve_reshard_after_forward(lora, None, int(fp32 / KEEP_GATHERED_SHARE) + 1, None) is False
    assert resolve_reshard_after_forward(lora, None, int(fp32 / KEEP_GATHERED_SHARE) - 8, None) is True
    assert resolve_reshard_after_forward(lora, None, None, bf16) is True  # off CUDA
    for given in (True, False):  # as given, whatever the memory
        assert resolve_reshard_after_forward(lora, given, 10**15, bf16) is given
    full = _fsdp.tiny_model("llama", 50)  # full fine-tuning: every weight trains
    assert resolve_reshard_after_forward(full, None, 10**15, bf16) is True
    with torch.device("meta"):
        meta = _lora_model()  # built shard by shard: no card holds it
    assert resolve_reshard_after_forward(meta, None, 10**15, bf16) is True
    with pytest.raises(ShardingError, match="reshard_after_forward takes True, False or None"):
        resolve_reshard_after_forward(lora, "auto", 10**15, bf16)
    with pytest.raises(ShardingError, match="reshard_after_forward takes True, False or None"):
        SlothFSDPStrategy(reshard_after_forward=1)


@pytest.mark.parametrize(
    "given,memory,expected",
    [
        (dict(), 10**12, (False, "node", 1)),  # room: gathered, with the node
        (dict(), 10**3, (True, "torch", None)),  # no room: resharded, torch's checkpoint
        (dict(layers_per_unit=2), 10**12, (False, "torch", 2)),  # grouped layers: torch's
        (dict(checkpoint_impl="torch"), 10**12, (False, "torch", None)),
        (dict(reshard_after_forward=True), 10**12, (True, "torch", None)),
        (dict(reshard_after_forward=False, checkpoint_impl="node"), 10**3, (False, "node", 1)),
        (dict(cpu_offload=True), 10**12, (True, "torch", None)),  # weights kept on the host
    ],
)
def test_the_strategy_pairs_the_node_with_gathered_weights(monkeypatch, given, memory, expected):
    import types

    strategy = SlothFSDPStrategy(**given)
    strategy.parallel_devices = [torch.device("cuda", 0)]
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=memory)
    )
    strategy._choose_resharding(_lora_model(), mixed_precision_policy("bf16-mixed"))
    got = (
        strategy.reshard_after_forward,
        strategy.sloth_settings["checkpoint_impl"],
        strategy.layers_per_unit,
    )
    assert got == expected


@pytest.mark.parametrize("grouped,per_layer", [("unit2_offload", "offload"), ("unit2_full", "full")])
def test_layers_grouped_in_one_unit_train_bit_for_bit_with_fewer_all_gathers(more_runs, grouped, per_layer):
    """Both decoder layers in one FSDP2 unit (LoRA with offload: the automatic grouping of small
    layers; full fine-tuning: layers_per_unit=2): losses and gradients bit for bit those of one
    unit per layer, with fewer all-gathers; the offloader sees the same layer inputs."""
    for rank in (0, 1):
        a, b = more_runs[rank][grouped], more_runs[rank][per_layer]
        assert "fully_shard (2 decoder layers, 2 per unit, then the root)" in a["report"]
        assert a["losses"] == b["losses"]
        assert 0 < a["all_gathers"] < b["all_gathers"]
        assert a["offload"] == b["offload"]
        assert "fully_shard (2 decoder layers, then the root)" in b["report"]
    a, b = more_runs[0][grouped]["steps"][0], more_runs[0][per_layer]["steps"][0]
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        assert torch.equal(a["grads"][name], grad), name


def test_regional_compile_under_fsdp_trains_like_eager(more_runs):
    """compile=True under sloth_fsdp (LoRA with offload): each layer compiled before sharding, its
    graphs built, losses and gradients those of the eager run (float32, another kernel order)."""
    for rank in (0, 1):
        a, b = more_runs[rank]["compile"], more_runs[rank]["offload"]
        assert a["report"] == b["report"][:3] + ["regional compile"] + b["report"][3:]
        assert a["compiled_graphs"] > 0 and b["compiled_graphs"] == 0
        torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-5, atol=0)
        assert a["offload"] == b["offload"]
    a, b = more_runs[0]["compile"]["steps"][0], more_runs[0]["offload"]["steps"][0]
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        torch.testing.assert_close(
            a["grads"][name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name
        )


def test_layers_per_unit_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ShardingError, match="layers_per_unit must be a positive integer"):
            SlothFSDPStrategy(layers_per_unit=bad)


def test_the_node_checkpoint_takes_one_layer_per_unit():
    assert SlothFSDPStrategy(checkpoint_impl="node").layers_per_unit == 1
    assert SlothFSDPStrategy(checkpoint_impl="node", layers_per_unit=1).layers_per_unit == 1
    assert SlothFSDPStrategy().layers_per_unit is None  # automatic
    with pytest.raises(ShardingError, match="checkpoint_impl='node' takes one decoder layer per FSDP2 unit"):
        SlothFSDPStrategy(checkpoint_impl="node", layers_per_unit=2)
    with pytest.raises(ShardingError, match="keep the weights gathered"):
        SlothFSDPStrategy(checkpoint_impl="node", layers_per_unit=2, reshard_after_forward=True)
    grouped = SlothFSDPStrategy(checkpoint_impl="node", layers_per_unit=2, reshard_after_forward=False)
    assert grouped.layers_per_unit == 2
    assert SlothFSDPStrategy(checkpoint_impl="node", reshard_after_forward=False).layers_per_unit == 1


def test_the_node_refuses_grouped_units_where_torch_reshards_a_unit_after_one_layers_backward(monkeypatch):
    """torch 2.11's FSDP2 reshards a unit of several layers after the first layer recomputed in the
    backward (found on four H200s): there the node with grouped units is refused, naming torch."""
    from lightning_sloth.plugins import strategy

    monkeypatch.setattr(strategy, "grouped_units_take_partial_forwards", lambda: False)
    with pytest.raises(ShardingError, match=r"layers_per_unit=2 needs torch >= 2.13.*one layer per unit"):
        SlothFSDPStrategy(checkpoint_impl="node", layers_per_unit=2, reshard_after_forward=False)
    assert SlothFSDPStrategy(checkpoint_impl="node", reshard_after_forward=False).layers_per_unit == 1
    assert SlothFSDPStrategy(layers_per_unit=2, reshard_after_forward=False).layers_per_unit == 2  # torch's


@pytest.mark.parametrize("shape,per_unit", [("llama_3_2_1b", 4), ("llama_3_1_8b", 1), ("qwen3_14b", 1)])
def test_automatic_units_hold_at_most_250m_parameters(shape, per_unit):
    from lightning_sloth.bench.workload import shape_config
    from lightning_sloth.plugins.sharding import AUTO_UNIT_PARAMETERS, auto_layers_per_unit

    config = shape_config(shape, "sdpa")
    config.num_hidden_layers = 2
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = shardable_layers(model)
    assert auto_layers_per_unit(layers) == per_unit
    layer_params = sum(p.numel() for p in layers[0].parameters())
    assert per_unit == 1 or per_unit * layer_params <= AUTO_UNIT_PARAMETERS < (per_unit + 1) * layer_params


def test_checkpoint_impl_defaults_node_and_chosen_at_setup_under_fsdp():
    from lightning_sloth.plugins import SlothDDPStrategy, SlothFSDPStrategy, SlothStrategy

    assert SlothFSDPStrategy().sloth_settings["checkpoint_impl"] is None  # chosen at setup
    assert SlothFSDPStrategy(checkpoint_impl="torch").sloth_settings["checkpoint_impl"] == "torch"
    assert SlothFSDPStrategy(checkpoint_impl="node").sloth_settings["checkpoint_impl"] == "node"
    assert SlothStrategy().sloth_settings["checkpoint_impl"] == "node"
    assert SlothDDPStrategy().sloth_settings["checkpoint_impl"] == "node"
    assert SlothStrategy(checkpoint_impl="torch").sloth_settings["checkpoint_impl"] == "torch"


def test_sharding_without_a_process_group_is_refused():
    model = _fsdp.tiny_model("llama", 50)
    with pytest.raises(ShardingError, match="initialised torch.distributed process group"):
        shard_model(model, model, None, mixed_precision_policy("32-true"))


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ShardingError, match="no stack of decoder layers"):
        shardable_layers(nn.Sequential(nn.Linear(4, 4)))


def test_fp16_loss_scaling_is_refused():
    with pytest.raises(ShardingError, match="bf16-mixed, bf16-true or 32-true"):
        mixed_precision_policy("16-mixed")
    assert mixed_precision_policy("bf16-mixed").param_dtype == torch.bfloat16
    assert mixed_precision_policy("bf16-mixed").reduce_dtype == torch.float32
    assert mixed_precision_policy("32-true").param_dtype is None


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        yield


@pytest.mark.parametrize("multirun", [False, True])
def test_hydra_trainer_fsdp_builds_the_fsdp_strategy(hydra_conf, tmp_path, multirun):
    cfg = compose("train", overrides=["trainer=fsdp", "trainer.accelerator=cpu"])
    default = compose("train").trainer
    assert cfg.trainer.sharding is Sharding.fsdp and cfg.trainer.devices == 2
    assert cfg.trainer.max_steps == default.max_steps  # the rest comes from trainer/default.yaml
    trainer = build.build_trainer(cfg, tmp_path, multirun=multirun, callbacks=[], loggers=False)
    strategy = trainer.strategy
    assert type(strategy) is SlothFSDPStrategy and strategy.global_token_loss
    if multirun:
        # `-m` must not re-run sys.argv (the whole sweep) in the extra processes: spawn them.
        assert isinstance(strategy.launcher, _ShardedSpawnLauncher)
        assert strategy.launcher._start_method == "spawn"
    else:
        assert isinstance(strategy.launcher, _SubprocessScriptLauncher)


def test_hydra_fsdp_options_reach_the_strategy(hydra_conf, tmp_path):
    overrides = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.fsdp_layers_per_unit=4"]
    overrides += ["trainer.fsdp_reshard_after_forward=false", "trainer.fsdp_shard_frozen=false"]
    strategy = build.build_trainer(
        compose("train", overrides=overrides), tmp_path, callbacks=[], loggers=False
    ).strategy
    assert (strategy.layers_per_unit, strategy.reshard_after_forward, strategy.shard_frozen) == (
        4,
        False,
        False,
    )
    default = compose("train", overrides=["trainer=fsdp", "trainer.accelerator=cpu"])
    assert build.build_trainer(default, tmp_path, callbacks=[], loggers=False).strategy.shard_frozen == "auto"
    bad = compose(
        "train", overrides=["trainer=fsdp", "trainer.accelerator=cpu", "trainer.fsdp_layers_per_unit=0"]
    )
    with pytest.raises(ShardingError, match=r"layers_per_unit must be a positive integer.*got 0"):
        build.build_trainer(bad, tmp_path, callbacks=[], loggers=False)


def test_hydra_ddp_uses_the_global_token_loss(hydra_conf, tmp_path):
    cfg = compose("train", overrides=["trainer.devices=2", "trainer.accelerator=cpu"])
    strategy = build.build_trainer(cfg, tmp_path, callbacks=[], loggers=False).strategy
    assert type(strategy) is SlothDDPStrategy and strategy.global_token_loss
    assert not SlothDDPStrategy(global_token_loss=False).global_token_loss


def test_hydra_trainer_fsdp_on_one_device_is_refused(hydra_conf, tmp_path):
    cfg = compose("train", overrides=["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1"])
    with pytest.raises(ShardingError, match="strategy='sloth'"):
        build.build_trainer(cfg, tmp_path, callbacks=[], loggers=False)


def test_resume_auto_finds_a_sharded_checkpoint_directory(tmp_path):
    (tmp_path / "checkpoints" / "last.ckpt").mkdir(parents=True)
    assert build.resolve_resume("auto", tmp_path) == str(tmp_path / "checkpoints" / "last.ckpt")


def test_under_slurm_lightning_does_not_launch_processes(hydra_conf, tmp_path, monkeypatch):
    """A SLURM job of num_nodes x devices tasks: every task is one rank, nothing is re-launched
    (also under ``-m``, where the submitit launcher runs the job inside each task)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    slurm = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NAME="lightning-sloth")
    slurm |= dict(
        SLURM_NODELIST="node1", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_JOB_ID="7"
    )
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    # Building the Trainer sets process-wide state that later in-process runs would inherit: the
    # rank that rank_zero_only reads, and SLURMEnvironment's MASTER_ADDR/MASTER_PORT.
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    cfg = compose("train", overrides=["trainer=fsdp", "trainer.accelerator=cpu"])
    trainer = build.build_trainer(cfg, tmp_path, multirun=True, callbacks=[], loggers=False)
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    assert trainer.strategy.launcher is None
    assert trainer.global_rank == 1 and trainer.world_size == 2


def test_fsdp2_of_older_torch_shards_frozen_integer_parameters(monkeypatch):
    """torch 2.11's FSDP2 (seen on two H200s) builds a sharded parameter as ``nn.Parameter(dtensor)``
    and sets ``requires_grad`` afterwards, which raises for the packed NF4 codes (uint8), and casts
    every parameter, integer ones too, to the mixed-precision ``param_dtype``. The shim gives its
    modules a ``Parameter`` that builds integer data frozen and keeps integer parameters uncast;
    here it is applied over a stand-in with torch 2.11's casting."""
    import types

    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fsdp_param

    from lightning_sloth.plugins import sharding

    FSDPParam = _fsdp_param.FSDPParam
    for module in (_fsdp_param, _fsdp_init):
        monkeypatch.setattr(module, "nn", module.nn)
    monkeypatch.setattr(FSDPParam, "init_dtype_attrs", _fsdp.init_dtype_attrs_torch_2_11)
    assert sharding.allow_integer_parameters_in_fsdp2() == ["Parameter", "init_dtype_attrs"]
    assert sharding.allow_integer_parameters_in_fsdp2() == []  # once

    codes = torch.randint(0, 256, (8,), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="floating point"):
        nn.Parameter(codes)  # what torch 2.11's FSDPParam does
    frozen = _fsdp_param.nn.Parameter(codes)
    assert type(frozen) is nn.Parameter and not frozen.requires_grad and torch.equal(frozen, codes)
    weight = _fsdp_param.nn.Parameter(torch.randn(4))
    assert type(weight) is nn.Parameter and weight.requires_grad
    assert _fsdp_init.nn.Parameter is _fsdp_param.nn.Parameter and _fsdp_param.nn.Module is nn.Module
    assert nn.Parameter is torch.nn.parameter.Parameter  # torch.nn itself untouched

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for dtype, cast_to in ((torch.uint8, None), (torch.float32, torch.bfloat16)):
        param = types.SimpleNamespace(sharded_param=torch.zeros(2, dtype=dtype))
        FSDPParam.init_dtype_attrs(param, policy)
        assert param.param_dtype is cast_to, dtype


def test_sharded_gradients_are_clipped_on_their_local_shards_as_torch_clips_them(tmp_path):
    """``clip_sharded_grads_`` (what ``SlothPrecision`` clips FSDP2's gradients with) against
    ``torch.nn.utils.clip_grad_norm_`` on the same ``DTensor`` gradients over two processes: uneven
    and empty shards, float32 and bf16, clipped or not: the norm of float64 to 1e-6 and the gradients
    it scales (torch's to its bf16 rounding of a bf16 tensor's norm); plain tensors and replicated
    placements are left to torch (``None``)."""
    runs = _fsdp.run(_fsdp.sharded_clipping, tmp_path, world=2)
    for rank in (0, 1):
        result = runs[rank]
        for scale in (1.0, 1e-3):
            # float32 accumulation: float64's norm to 1e-6 (torch's rounds the bf16 tensor's norm first)
            assert result[(scale, "norm")] == pytest.approx(result[(scale, "float64")], rel=1e-6)
            assert result[(scale, "ours")] == result[(scale, "norm")]
            assert result[(scale, "torch")] == pytest.approx(result[(scale, "float64")], rel=1e-3)
            coefficient = min(1.0, 1.0 / (result[(scale, "float64")] + 1e-6))
            for (ours, theirs), given in zip(result[(scale, "grads")], result[(scale, "given")]):
                expected = (given.double() * coefficient).to(given.dtype)
                bf16 = given.dtype == torch.bfloat16
                torch.testing.assert_close(ours, expected, rtol=8e-3 if bf16 else 1e-6, atol=0)
                torch.testing.assert_close(theirs, expected, rtol=8e-3 if bf16 else 1e-3, atol=0)
        assert result[(1.0, "torch")] > 1.0 > result[(1e-3, "torch")]  # one clipped, one not
        assert result["declined"] == (None, None)
    assert runs[0][(1.0, "ours")] == runs[1][(1.0, "ours")]


def test_an_elementwise_optimizer_steps_the_local_shards_as_it_steps_the_dtensors(tmp_path):
    """``SlothPrecision`` steps AdamW / Adam / SGD over FSDP2's parameters on their local shards:
    three steps over two processes (uneven and empty shards, a parameter without a gradient in one
    step) give the parameters and states of the ``DTensor`` step bit for bit, the states created
    as ``DTensor``\\ s as that step creates them; other optimizers and plain tensors are declined."""
    runs = _fsdp.run(_fsdp.local_shard_steps, tmp_path, world=2)
    for rank in (0, 1):
        result = runs[rank]
        for name in ("adamw_foreach", "adamw_fused", "adam_amsgrad", "sgd_momentum"):
            assert result[name]["params"] == 0.0 and result[name]["states"] == 0.0, (name, result[name])
            assert all(ours == theirs for _, ours, theirs in result[name]["kinds"]), result[name]["kinds"]
        assert ("exp_avg", "DTensor", "DTensor") in result["adamw_fused"]["kinds"]
        assert ("momentum_buffer", "DTensor", "DTensor") in result["sgd_momentum"]["kinds"]
        assert result["applies"] == {"adamw": True, "adagrad": False, "plain": False}
