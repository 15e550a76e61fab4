"""The benchmark harness's host-side pieces (the timed runs need a GPU)."""

import pytest
import torch

from lightning_sloth.bench.systems import resolve_system
from lightning_sloth.bench.workload import Workload, group_consecutive, padded_batch


def test_workload_lengths_are_seeded_and_clipped():
    workload = Workload(median_len=250, min_len=16, max_len=2048)
    lengths = workload.lengths(2000)
    assert lengths == workload.lengths(2000)
    assert min(lengths) >= 16 and max(lengths) <= 2048
    assert 200 <= sorted(lengths)[1000] <= 300


def test_baseline_steps_respect_the_token_budget():
    lengths = [100, 300, 50, 600, 20, 900]
    steps = group_consecutive(lengths, budget=1000)
    assert [i for step in steps for i in step] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in step) <= 1000 for step in steps)


def test_padded_batch_masks_padding():
    batch = padded_batch([([5, 6, 7], [-100, 6, 7]), ([8], [8])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].sum() == 4 and batch["attention_mask"].dtype == torch.long


def test_ablation_systems_resolve_and_unknown_names_are_named():
    resolve_system("sloth_kernels_without_rope")
    with pytest.raises(SystemExit, match="unknown system 'fast'"):
        resolve_system("fast")


def test_the_harness_takes_the_suites_loop_systems():
    from lightning_sloth.bench.systems import SUITE_SYSTEMS

    fp8 = SUITE_SYSTEMS["sloth_fp8"]
    assert resolve_system("sloth_fp8") == (fp8.setup, fp8.batches)
    with pytest.raises(SystemExit, match="sloth_fp8"):  # listed among the known names
        resolve_system("fast")


def test_budget_systems_parse_their_size_and_reject_bad_ones():
    resolve_system("sloth_kernels_offload_budget_4gib")
    resolve_system("sloth_kernels_offload_budget_0.5gib")
    resolve_system("sloth_kernels_planned")
    for bad in (
        "sloth_kernels_offload_budget_gib",
        "sloth_kernels_offload_budget_-1gib",
        "sloth_kernels_without_x",
    ):
        with pytest.raises(SystemExit, match="unknown system"):
            resolve_system(bad)


def test_gpu_busy_time_is_the_union_of_kernel_intervals():
    from types import SimpleNamespace

    from lightning_sloth.bench.measure import gpu_busy_ms

    def event(start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event(0, 1000),
        event(500, 1500),
        event(3000, 3500),
        event(0, 9000, torch.autograd.DeviceType.CPU),
    ]
    assert gpu_busy_ms(events) == 2.0


def test_the_kernel_table_sums_each_kernels_gpu_time_and_calls():
    from types import SimpleNamespace

    from lightning_sloth.bench.measure import gpu_kernel_table

    def event(name, start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [
        event("gemm", 0, 1000),
        event("gemm", 2000, 4000),
        event("norm", 500, 1000),
        event("x" * 300, 0, 100),
        event("cpu_op", 0, 9000, torch.autograd.DeviceType.CPU),
    ]
    table = gpu_kernel_table(events)
    assert table[:2] == [{"name": "gemm", "ms": 3.0, "calls": 2}, {"name": "norm", "ms": 0.5, "calls": 1}]
    assert len(table) == 3 and len(table[2]["name"]) == 120
    assert gpu_kernel_table(events, top=1) == table[:1]


def test_the_copy_table_names_the_operators_around_each_device_copy():
    from types import SimpleNamespace

    from lightning_sloth.bench.measure import copy_launchers

    cpu = torch.autograd.DeviceType.CPU
    outer = SimpleNamespace(name="sloth::op", cpu_parent=None, input_shapes=[], device_type=cpu)
    inner = SimpleNamespace(
        name="aten::copy_", cpu_parent=outer, input_shapes=[[4, 8], [4, 8]], device_type=cpu
    )
    events = [
        SimpleNamespace(name="cudaMemcpyAsync", cpu_parent=inner, device_type=cpu),
        SimpleNamespace(name="cudaMemcpyAsync", cpu_parent=inner, device_type=cpu),
        SimpleNamespace(name="cudaMemcpyAsync", cpu_parent=None, device_type=cpu),
        SimpleNamespace(name="cudaLaunchKernel", cpu_parent=inner, device_type=cpu),
        SimpleNamespace(name="cudaMemcpyAsync", cpu_parent=None, device_type=torch.autograd.DeviceType.CUDA),
    ]
    assert copy_launchers(events) == [
        {"chain": "sloth::op > aten::copy_ [[4, 8], [4, 8]]", "calls": 2},
        {"chain": "(no operator)", "calls": 1},
    ]


def test_micro_batched_peer_steps_hold_the_packed_steps_documents_and_train_alike():
    """``hf_packed_varlen_microN``: the same documents per optimizer step as the one-row step, split
    into N packed rows whose accumulated loss and gradients equal the one row's (float32, CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_sloth.attention import enable_packed_attention
    from lightning_sloth.bench.systems import SUITE_SYSTEMS
    from lightning_sloth.bench.workload import packed_batches, packed_micro_batches, split_documents

    assert split_documents([5, 1, 4, 3], 2) == [[0, 1], [2, 3]]
    assert split_documents([7], 4) == [[0]]
    with pytest.raises(ValueError, match="parts"):
        split_documents([1], 0)
    assert SUITE_SYSTEMS["hf_packed_varlen_micro4"].batches.keywords == {"parts": 4}

    workload = Workload(tokens_per_step=256, median_len=40, min_len=8, max_len=128)
    samples = workload.samples(vocab=97)[:24]
    whole = list(packed_batches(workload, samples, 0))
    split = list(packed_micro_batches(workload, samples, 0, parts=3))
    assert len(whole) == len(split)
    for (rows, *counts), (micro, *micro_counts) in zip(whole, split):
        assert counts == micro_counts and 1 <= len(micro) <= 3  # tokens, sum of squares, targets
        tokens = sorted(t for m in micro for t in m["input_ids"][0].tolist() if t != 0)  # 0: padding
        assert tokens == sorted(t for t in rows[0]["input_ids"][0].tolist() if t != 0)
    assert max(len(micro) for micro, *_ in split) == 3

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    enable_packed_attention(model)
    (rows, _, _, targets), (micro, *_) = whole[0], split[0]
    num_items = torch.tensor(targets)
    results = []
    for batches in (rows, micro):
        model.zero_grad()
        loss = sum(model(**inputs, num_items_in_batch=num_items).loss for inputs in batches)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for one, accumulated in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(accumulated, one, rtol=1e-4, atol=1e-6)


def test_the_plan_for_the_whole_card_runs_with_expandable_segments(monkeypatch):
    """``sloth_kernels_planned``'s fresh process sets the allocator's expandable segments before CUDA
    starts (a user's own setting kept)."""
    import os

    from lightning_sloth.bench.systems import SUITE_SYSTEMS

    preamble = SUITE_SYSTEMS["sloth_kernels_planned"].preamble
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    exec(preamble, {})
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    exec(preamble, {})
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"


def test_every_system_and_unsloth_train_the_same_lora_targets(monkeypatch, tmp_path):
    """Unsloth beside the others adapts the same layers (and a MoE shape's expert parameters): the
    targets come from one place, ``workload.lora_targets``."""
    import sys
    import types

    from lightning_sloth.bench import peers
    from lightning_sloth.bench.workload import MOE_LORA, lora_targets

    seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_targets(Workload(shape="tiny")) == {"target_modules": seven}
    assert lora_targets(Workload(shape="tiny_moe")) == {k: list(v) for k, v in MOE_LORA.items()}
    seen = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(path, **kwargs):
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(path), None

        @staticmethod
        def get_peft_model(model, **kwargs):
            seen.update(kwargs)
            return model

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    monkeypatch.setattr(peers.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    for shape in ("tiny", "tiny_moe"):
        seen.clear()
        workload = Workload(shape=shape, tokens_per_step=256, median_len=40, min_len=8, max_len=128)
        peers.unsloth(workload)
        assert {k: seen[k] for k in lora_targets(workload)} == lora_targets(workload)
        assert seen["use_gradient_checkpointing"] == "unsloth"


def test_the_fused_moe_systems_switch_the_permutation_on_in_their_process(monkeypatch):
    """``sloth_kernels_fused`` builds the MoE model with the fused-permutation ops switched on (its
    own process keeps the setting); the step then dispatches the fused grouped GEMMs;
    ``sloth_kernels_separate`` the separate gather and combine passes."""
    from test_quant_training import _OpNames

    from lightning_sloth.bench.systems import SUITE_SYSTEMS
    from lightning_sloth.moe import fused, switch

    monkeypatch.setattr(switch, "_ENABLED", [False])
    assert (
        SUITE_SYSTEMS["sloth_kernels_planned_fused"].preamble
        == SUITE_SYSTEMS["sloth_kernels_planned"].preamble
    )
    workload = Workload(shape="tiny_moe", tokens_per_step=256, median_len=40, min_len=8, max_len=128)
    system = SUITE_SYSTEMS["sloth_kernels_fused"]
    model = system.setup(workload)
    assert fused.fused_permutation_enabled()
    samples = workload.samples(vocab=model.config.vocab_size)[:24]
    (micro, *_), *_ = list(system.batches(workload, samples, 0))
    with _OpNames() as names:
        model(**micro[0]).loss.backward()
    assert "sloth.moe_gather_lora_grouped_mm.default" in names
    assert "sloth.moe_gather_lora_grouped_mm_backward.default" in names
    separate = SUITE_SYSTEMS["sloth_kernels_separate"]  # the separate passes, whatever the default
    model = separate.setup(workload)
    assert not fused.fused_permutation_enabled(None, "cuda")
    with _OpNames() as names:
        model(**micro[0]).loss.backward()
    assert "sloth.moe_gather_lora_grouped_mm.default" not in names
    assert any(name.startswith("sloth.moe_gather") for name in names)
