"""Models built on the meta device and sharded over four CPU processes (gloo), each rank making
only its own shards: equal to one process on the global batch (float32), 4-bit shards quantised per
rank bit for bit those of the whole weight, and no rank holding more than its share."""

import math

import _fsdp
import _fsdp_meta
import pytest
import torch

from lightning_sloth import CausalLMModule
from lightning_sloth.data import build_char_tokenizer
from lightning_sloth.quant import quantize_model
from lightning_sloth.quant.loading import RandomWeights, checkpoint_name, quantize_rows

PREFIX = "model.base_model.model."  # CausalLMModule.model (PEFT) -> the transformers model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _fsdp.run(_fsdp_meta.meta_runs, tmp_path_factory.mktemp("fsdp_meta"), world=_fsdp_meta.WORLD)


def _assert_one_process(runs, case, quantize=None):
    records = [runs[rank][case] for rank in range(_fsdp_meta.WORLD)]
    steps = [r["steps"][0] for r in records]
    firsts = [s["batches"][0].input_ids for s in steps]  # each rank packed its own rows
    assert not any(torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
    loss, grads, _ = _fsdp.reference_step(
        "qwen3_moe", True, *steps, hidden=_fsdp_meta.HIDDEN, quantize=quantize
    )
    torch.testing.assert_close(_fsdp.global_loss(*records, step=0), float(loss), rtol=1e-5, atol=0)
    assert grads and grads.keys() == steps[0]["grads"].keys() and all("lora_" in n for n in grads)
    assert sum("experts" in n for n in grads) == 8  # A and B of both expert weights, two layers
    for name, grad in grads.items():
        atol = 1e-5 * float(grad.abs().max())  # float32 sums in another order
        torch.testing.assert_close(steps[0]["grads"][name], grad, rtol=1e-5, atol=atol, msg=name)


def test_a_meta_moe_with_expert_lora_trains_as_one_process_from_seeded_shards(runs):
    """Qwen3-MoE, LoRA on attention and the 3-D experts, built on the meta device; each of four
    ranks draws its shards of every parameter (experts included) from RandomWeights: the gathered
    model is the one RandomWeights gives one process, and its step is one process's."""
    record = runs[0]["moe_random"]
    assert record["report"][-1] == "shards made per rank (RandomWeights)"
    params = record["steps"][0]["params"]
    assert any(n.endswith("experts.base_layer.base_layer.gate_up_proj") for n in params)
    for name, value in params.items():
        key = checkpoint_name(name.removeprefix(PREFIX))
        expected = _fsdp_meta.RANDOM.values(key, tuple(value.shape), value.dtype, 0, value.numel(), "cpu")
        assert torch.equal(value.reshape(-1), expected), name
    _assert_one_process(runs, "moe_random")


def test_nf4_shards_quantised_per_rank_from_a_checkpoint_equal_the_whole_models(runs):
    """NF4 projections and experts made on each rank from the rows of a checkpoint it reads (the
    experts assembled from their per-expert keys): gathered, codes and block scales are bit for bit
    those of quantising the whole model in one process, and the step is one process's."""
    record = runs[0]["moe_nf4_checkpoint"]
    assert record["report"][-1] == "shards made per rank (CheckpointWeights)"
    sharded, total = record["codes_sharded"]
    assert total == 12 and sharded == total
    reference = CausalLMModule(
        _fsdp.tiny_model("qwen3_moe", len(build_char_tokenizer()), hidden=_fsdp_meta.HIDDEN),
        lora=_fsdp.lora_settings("qwen3_moe", True),
    )
    quantize_model(reference, "nf4")
    state = reference.state_dict()
    params = record["steps"][0]["params"]
    four_bit = [n for n, p in params.items() if p.dtype in (torch.uint8, torch.int32)]
    assert len(four_bit) == 24  # codes and block scales (parameters, so sharded too)
    for name in four_bit:
        assert torch.equal(params[name], state[name]), name
    for name, value in params.items():  # the dense base weights are the checkpoint's
        if "lora_" not in name and name not in four_bit:
            torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
    _assert_one_process(runs, "moe_nf4_checkpoint", quantize="nf4")


def test_each_rank_holds_and_quantises_only_its_share_of_the_4bit_weights(runs):
    stats = [runs[rank]["moe_nf4_checkpoint"]["stats"] for rank in range(_fsdp_meta.WORLD)]
    total = stats[0].total_4bit_bytes
    assert sum(s.local_4bit_bytes for s in stats) == total
    for s in stats:
        assert s.weights_4bit == 12
        assert s.local_4bit_bytes <= total / _fsdp_meta.WORLD * 1.1
    # The largest weight (an expert stack, 4 x 48 x 48 elements) is never quantised whole on a
    # rank: each quantises its quarter (block-aligned).
    largest = 4 * _fsdp_meta.HIDDEN * _fsdp_meta.HIDDEN
    assert max(s.largest_quantized for s in stats) == largest // _fsdp_meta.WORLD


@pytest.mark.parametrize("numel,world", [(1152, 4), (4096, 3), (130, 4), (64 * 7, 2)])
def test_quantize_rows_of_any_split_are_the_whole_weights_rows(numel, world):
    """Rows of codes and scales split as FSDP2 splits them (chunks of ceil(rows / world)), each made
    from just the elements it covers, put back together are the whole weight's storage."""
    from lightning_sloth.ops.nf4_formats import quantize_4bit

    weight = torch.randn(numel)
    whole = quantize_4bit(weight, "nf4")
    packed_rows, blocks = math.ceil(numel / 2), math.ceil(numel / 64)
    seen, parts = [], []
    for rank in range(world):
        a = min(rank * -(-packed_rows // world), packed_rows)
        c = min(rank * -(-blocks // world), blocks)
        b, d = min(a - (-packed_rows // world), packed_rows), min(c - (-blocks // world), blocks)

        def values(start, stop):
            seen.append(stop - start)
            return weight[start:stop]

        parts.append(quantize_rows(values, numel, "nf4", (a, b), (c, d)))
    assert torch.equal(torch.cat([p for p, _ in parts]), whole.packed)
    assert torch.equal(torch.cat([s for _, s in parts]), whole.absmax)
    assert max(seen) < numel or world == 1


def test_random_weights_are_the_same_for_any_split():
    source = RandomWeights(seed=5, chunk=100)
    whole = source.values("model.layers.0.mlp.down_proj.weight", (30, 20), torch.float32, 0, 600, "cpu")
    pieces = [(0, 7), (7, 250), (250, 251), (251, 600)]
    split = torch.cat([source.values("model.layers.0.mlp.down_proj.weight", (30, 20), torch.float32, a, b, "cpu")
                       for a, b in pieces])  # fmt: skip
    assert torch.equal(whole, split) and 0.015 < float(whole.std()) < 0.025
    other = source.values("model.layers.0.mlp.up_proj.weight", (30, 20), torch.float32, 0, 600, "cpu")
    assert not torch.equal(whole, other)
    assert source.values("x.lora_B.default.weight", (8, 4), torch.float32, 0, 32, "cpu").abs().sum() == 0
    lora_a = source.values("x.lora_A.default.weight", (4, 16), torch.float32, 0, 64, "cpu")
    assert float(lora_a.abs().max()) <= 0.25 and float(lora_a.abs().max()) > 0.1
    assert torch.equal(source.values("model.norm.weight", (16,), torch.float32, 0, 16, "cpu"), torch.ones(16))
    with pytest.raises(NotImplementedError, match="nf4-dq"):
        quantize_rows(lambda a, b: torch.zeros(b - a), 128, "nf4-dq", (0, 64), (0, 2))
