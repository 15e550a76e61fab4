"""The benchmark's workload: model shapes, seeded samples, and the batches each kind of system trains on.

Every system trains the same model shape (random weights, seeded), the same samples and the same
token budget per optimizer step. A step's batches come as ``(micro_batches, real_tokens,
sum_sq_lengths, target_tokens)``: padded micro-batches of consecutive samples for the padded
baseline (:func:`hf_padded_batches`), one best-fit-decreasing packed row for everything else
(:func:`packed_batches`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "llama_3_2_1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "llama_3_1_8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    # Qwen3-30B-A3B's layer shape at 8 of its 48 layers (LoRA on attention and experts).
    "qwen3_30b_a3b_8l": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        vocab_size=151936,
        rope_theta=1000000.0,
    ),
    # Qwen3-30B-A3B at full depth: 48 layers, 128 experts of 768 (top 8); ~61 GB of bf16 weights,
    # which no single card holds with training state (fsdp_bench builds it per shard).
    "qwen3_30b_a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        vocab_size=151936,
        rope_theta=1000000.0,
    ),
    # A tiny Qwen3-MoE for CPU smoke runs of the multi-GPU benchmark (a small vocabulary: the CPU's
    # bf16 output projection is slow).
    "tiny_moe": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # GPT-OSS-20B's layer shape (GptOssConfig's defaults: hidden 2880, 64/8 heads of 64, experts of
    # 2880, alternating 128-token sliding-window and full attention, sinks) at 8 of its 24 layers.
    "gpt_oss_20b_8l": dict(
        num_hidden_layers=8, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088
    ),
    "qwen3_0_6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # Llama-3.1-70B (its llama3 rope scaling left out: it changes no shape or FLOP): QLoRA across GPUs.
    "llama_3_1_70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "qwen3_14b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}


MOE_LORA = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}  # fmt: skip


# transformers model type of a shape; shapes not listed are Llamas.
SHAPE_FAMILIES = {
    "qwen3_0_6b": "qwen3",
    "qwen3_14b": "qwen3",
    "qwen3_30b_a3b_8l": "qwen3_moe",
    "qwen3_30b_a3b": "qwen3_moe",
    "tiny_moe": "qwen3_moe",
    "gpt_oss_20b_8l": "gpt_oss",
}


MOE_FAMILIES = (
    "qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "glm4_moe", "deepseek_v3",
    "llama4_text",
)  # fmt: skip

# A scenario's own LoRA targets (its ``lora:`` entry), for shapes whose projections have other names
# (DeepSeek-V3's MLA, Qwen3.5's linear-attention layers): ``{"target_modules", "target_parameters"}``.
SHAPE_LORA: dict[str, dict] = {}


def bench_device() -> torch.device:
    """Where the benchmark trains: the GPU when there is one, else the CPU (tests, tiny shapes)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Workload:
    """Seeded synthetic samples with lognormal lengths, grouped into steps of a token budget."""

    shape: str = "llama_3_2_1b"
    tokens_per_step: int = 16384
    median_len: int = 250
    sigma: float = 0.8
    min_len: int = 16
    max_len: int = 2048
    prompt_fraction: float = 0.25
    lora_r: int = 16
    micro_batch_size: int = 8
    warmup_steps: int = 3
    timed_steps: int = 20
    seed: int = 0
    init_dtype: str = "float32"  # the dtype random weights are drawn in (bfloat16 where float32 won't fit)

    def lengths(self, count: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed)
        raw = torch.empty(count).log_normal_(math.log(self.median_len), self.sigma, generator=gen)
        return raw.round().clamp(self.min_len, self.max_len).long().tolist()

    def samples(self, vocab: int) -> list[tuple[list[int], list[int]]]:
        steps = self.warmup_steps + self.timed_steps
        count = int(steps * self.tokens_per_step / self.median_len * 1.6) + 8
        gen = torch.Generator().manual_seed(self.seed + 1)
        out = []
        for n in self.lengths(count):
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            cut = max(1, int(n * self.prompt_fraction))
            out.append((ids, [-100] * cut + ids[cut:]))
        return out


def register_scenario(scenario: dict) -> Workload:
    """The :class:`Workload` of a scenario config; a scenario's inline ``model`` becomes its shape.

    Args:
        scenario: ``{"name", "shape" (a key of :data:`SHAPES`, or None), "model" (None, or a
            transformers config as a dict with ``model_type``), "workload": {Workload fields}}``.
    """
    shape = scenario.get("shape") or scenario["name"]
    model = scenario.get("model")
    if model:
        model = dict(model)
        SHAPE_FAMILIES[shape] = model.pop("model_type", "llama")
        SHAPES[shape] = model
    if scenario.get("lora"):
        lora = {key: list(value) for key, value in dict(scenario["lora"]).items()}
        unknown = set(lora) - {"target_modules", "target_parameters"}
        if unknown:
            raise ValueError(f"scenario {scenario['name']!r}: unknown lora keys {sorted(unknown)}")
        SHAPE_LORA[shape] = lora
    if shape not in SHAPES:
        raise ValueError(f"scenario {scenario['name']!r}: unknown shape {shape!r} and no model given")
    known = {f.name for f in fields(Workload)}
    extra = set(scenario.get("workload", {})) - known
    if extra:
        raise ValueError(f"scenario {scenario['name']!r}: unknown workload keys {sorted(extra)}")
    return Workload(shape=shape, **scenario.get("workload", {}))


def vocab_size(workload: Workload) -> int:
    """The vocabulary of the workload's shape (32,000 where the shape names none)."""
    return SHAPES[workload.shape].get("vocab_size", 32000)


def group_consecutive(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive samples per step while their real tokens fit the budget (the padded baseline)."""
    steps, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            steps.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        steps.append(current)
    return steps


def padded_batch(samples, pad_id: int) -> dict:
    """``[B, L]`` right-padded batch with attention mask (the ordinary transformers recipe)."""
    longest = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), longest), pad_id)
    labels = torch.full((len(samples), longest), -100)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, (ids, lab) in enumerate(samples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def _targets(samples) -> int:
    return sum(sum(1 for t in lab[1:] if t != -100) for _, lab in samples)


def hf_padded_batches(workload: Workload, samples, pad_id: int) -> Iterator[tuple[list[dict], int, int, int]]:
    """Steps of consecutive samples, as padded micro-batches of ``micro_batch_size`` rows."""
    for idx in group_consecutive([len(s[0]) for s in samples], workload.tokens_per_step):
        group = [samples[i] for i in idx]
        size = workload.micro_batch_size
        micro = [padded_batch(group[i : i + size], pad_id) for i in range(0, len(group), size)]
        yield micro, sum(len(s[0]) for s in group), sum(len(s[0]) ** 2 for s in group), _targets(group)


def packed_batches(
    workload: Workload, samples, pad_id: int, static: bool = False
) -> Iterator[tuple[list[dict], int, int, int]]:
    """Steps of best-fit-decreasing bins, one packed row each. ``static``: every row padded to the
    budget and ``cu_seqlens`` to a power-of-two length, the few static shapes CUDA graphs of the
    layers replay (:func:`static_packed_batches`)."""
    from lightning_sloth.data import PackedCollator, pack_best_fit_decreasing

    shapes = dict(pad_to="max_tokens", segments_bucket="pow2") if static else {}
    collate = PackedCollator(max_tokens=workload.tokens_per_step, pad_token_id=pad_id, **shapes)
    for idx in pack_best_fit_decreasing([len(s[0]) for s in samples], workload.tokens_per_step):
        batch = collate([samples[i] for i in idx])
        inputs = batch.model_inputs() | {"labels": batch.labels}
        yield [inputs], batch.num_tokens, batch.sum_sq_seqlens, batch.num_target_tokens


def split_documents(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups of nearly equal token counts (each document to the
    lightest group, longest first); groups keep their documents in the original order."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    groups: list[list[int]] = [[] for _ in range(min(parts, len(lengths)))]
    loads = [0] * len(groups)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lightest = loads.index(min(loads))
        groups[lightest].append(i)
        loads[lightest] += lengths[i]
    return [sorted(g) for g in groups if g]


def packed_micro_batches(
    workload: Workload, samples, pad_id: int, parts: int = 4
) -> Iterator[tuple[list[dict], int, int, int]]:
    """:func:`packed_batches`' steps (the same documents per optimizer step), each as ``parts``
    packed rows run one after the other with the gradients accumulated: what a user of a model
    whose one 16k-token row does not fit runs."""
    from lightning_sloth.data import PackedCollator, pack_best_fit_decreasing

    collate = PackedCollator(max_tokens=workload.tokens_per_step, pad_token_id=pad_id)
    for idx in pack_best_fit_decreasing([len(s[0]) for s in samples], workload.tokens_per_step):
        step = [samples[i] for i in idx]
        micro, tokens, sum_sq, targets = [], 0, 0, 0
        for group in split_documents([len(s[0]) for s in step], parts):
            batch = collate([step[i] for i in group])
            micro.append(batch.model_inputs() | {"labels": batch.labels})
            tokens += batch.num_tokens
            sum_sq += batch.sum_sq_seqlens
            targets += batch.num_target_tokens
        yield micro, tokens, sum_sq, targets


def static_packed_batches(
    workload: Workload, samples, pad_id: int
) -> Iterator[tuple[list[dict], int, int, int]]:
    """:func:`packed_batches` in static shapes (``static=True``)."""
    return packed_batches(workload, samples, pad_id, static=True)


def packed_batch_list(workload: Workload, samples, pad_id: int = 0) -> list:
    """The packed steps as :class:`~lightning_sloth.data.PackedBatch` objects, as a DataLoader yields them."""
    from lightning_sloth.data import PackedCollator, pack_best_fit_decreasing

    collate = PackedCollator(max_tokens=workload.tokens_per_step, pad_token_id=pad_id)
    bins = pack_best_fit_decreasing([len(s[0]) for s in samples], workload.tokens_per_step)
    return [collate([samples[i] for i in idx]) for idx in bins]


def shape_config(shape: str, attn: str = "sdpa"):
    """The transformers config of a :data:`SHAPES` entry (family from :data:`SHAPE_FAMILIES`)."""
    from transformers import AutoConfig

    family = SHAPE_FAMILIES.get(shape, "llama")
    return AutoConfig.for_model(family, **SHAPES[shape], attn_implementation=attn, use_cache=False)


def build_base_model(workload: Workload, attn: str):
    """The random-weight model of the workload's shape (family from :data:`SHAPE_FAMILIES`), bf16,
    on :func:`bench_device`; seeded, so every system starts from the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(workload.seed)
    config = shape_config(workload.shape, attn)
    with torch.device(bench_device()):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, workload.init_dtype)).to(
            torch.bfloat16
        )


def lora_targets(workload: Workload) -> dict:
    """The workload's LoRA targets, for every system alike: a scenario's own ``lora:`` entry where it
    has one, else a MoE shape's attention and experts, else the seven projections."""
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    moe = SHAPE_FAMILIES.get(workload.shape) in MOE_FAMILIES
    targets = SHAPE_LORA.get(workload.shape) or (MOE_LORA if moe else {"target_modules": projections})
    return {key: list(value) for key, value in targets.items()}


def build_model(workload: Workload, attn: str, checkpointing: bool = True, base=None):
    """A random-weight model of the workload's shape in bf16, with PEFT LoRA on all projections (a MoE
    shape: attention and experts; a scenario's ``lora:`` targets where it has them); ``base`` (e.g.
    a 4-bit model) instead of a fresh bf16 one."""
    from peft import LoraConfig, get_peft_model

    model = build_base_model(workload, attn) if base is None else base
    lora = LoraConfig(
        r=workload.lora_r, lora_alpha=2 * workload.lora_r, **lora_targets(workload), task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def quantized_base_model(workload: Workload, quant_type: str = "nf4"):
    """The workload's shape with random weights built directly in 4 bits (``lm_head`` kept in bf16),
    layer by layer on :func:`bench_device` (the bf16 model never exists whole)."""
    from lightning_sloth.quant import random_quantized

    return random_quantized(
        shape_config(workload.shape),
        quant_type,
        device=bench_device(),
        dtype=torch.bfloat16,
        seed=workload.seed,
    )
