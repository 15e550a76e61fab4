"""Benchmark harness: real tokens/s, peak memory and MFU of one fine-tuning workload, per system.

Every system trains the same model shape (random weights), the same seeded samples, the same
LoRA and the same token budget per optimizer step; warm-up (compilation included) is excluded,
``torch.cuda.synchronize`` brackets every timed step, and the step time reported is the median::

    python -m lightning_sloth.bench --shape llama_3_2_1b --systems hf_padded,sloth --out results.json

Systems (all with LoRA r=16 on the 7 projections and gradient checkpointing):
    hf_padded              transformers + PEFT, SDPA, padded micro-batches of 8 samples
                           accumulated to the step's token budget (the baseline).
    hf_packed_sdpa         transformers + PEFT on our packed rows with its own SDPA (packing alone,
                           transformers detects the documents from position_ids).
    hf_packed_flex         the same with transformers' FlexAttention (the packed baseline for
                           GPT-OSS, which has no SDPA path).
    sloth                  packed rows + packed attention (``SlothStrategy()``).
    sloth_kernels          + Triton kernels (``SlothStrategy(kernels=True)``).
    sloth_kernels_compile  + regional compile.
    sloth_kernels_offload  + activation offload (``offload="on"``).
    sloth_kernels_planned  + offload "auto" and ``memory_budget="auto"``: the per-layer
                           keep/recompute/offload plan for what the device has free.
    sloth_kernels_no_checkpointing
                           kernels without gradient checkpointing (every activation kept).
    sloth_kernels_graphs   + CUDA graphs of each layer's forward and recompute + backward
                           (``cuda_graphs=True``; rows padded to the budget, ``cu_seqlens`` to a
                           power-of-two length). ``sloth_kernels_offload_graphs``: with offload.
    sloth_kernels_offload_budget_<N>gib
                           + offload "on" and a memory plan for ``N`` GiB of layer activations.
    sloth_kernels_without_<op>
                           every kernel but one (ablation; op from KERNEL_OPS).

The suite over these and the peers (Hydra configs under ``conf/bench/``, one JSON per run,
README tables and plots generated from them) is :mod:`lightning_sloth.bench_suite`::

    python -m lightning_sloth.bench scenario=llama_3_2_1b systems=headline
    python -m lightning_sloth.bench report

Each system runs in its own fresh process (``--same-process`` turns that off), so no system's
memory or allocator state leaks into the next one's peak.

MFU counts model FLOPs as ``6 · N · tokens + 6 · layers · heads · head_dim · Σ len²`` (``N``: all
parameters but the input embedding; the second term is causal attention), real tokens only,
over the device's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightning_sloth.module import flop_parameters
from lightning_sloth.patching import OPS

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
    "gpt_oss_20b_8l": "gpt_oss",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


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


def _hf_padded_batches(
    workload: Workload, samples, pad_id: int
) -> Iterator[tuple[list[dict], int, int, int]]:
    """Steps of consecutive samples, as padded micro-batches of ``micro_batch_size`` rows."""
    for idx in group_consecutive([len(s[0]) for s in samples], workload.tokens_per_step):
        group = [samples[i] for i in idx]
        size = workload.micro_batch_size
        micro = [padded_batch(group[i : i + size], pad_id) for i in range(0, len(group), size)]
        yield micro, sum(len(s[0]) for s in group), sum(len(s[0]) ** 2 for s in group), _targets(group)


def _packed_batches(
    workload: Workload, samples, pad_id: int, static: bool = False
) -> Iterator[tuple[list[dict], int, int, int]]:
    """Steps of best-fit-decreasing bins, one packed row each. ``static``: every row padded to the
    budget and ``cu_seqlens`` to a power-of-two length, the few static shapes CUDA graphs of the
    layers replay (:func:`_static_packed_batches`)."""
    from lightning_sloth.data import PackedCollator, pack_best_fit_decreasing

    shapes = dict(pad_to="max_tokens", segments_bucket="pow2") if static else {}
    collate = PackedCollator(max_tokens=workload.tokens_per_step, pad_token_id=pad_id, **shapes)
    for idx in pack_best_fit_decreasing([len(s[0]) for s in samples], workload.tokens_per_step):
        batch = collate([samples[i] for i in idx])
        inputs = batch.model_inputs() | {"labels": batch.labels}
        yield [inputs], batch.num_tokens, batch.sum_sq_seqlens, batch.num_target_tokens


def _static_packed_batches(
    workload: Workload, samples, pad_id: int
) -> Iterator[tuple[list[dict], int, int, int]]:
    """:func:`_packed_batches` in static shapes (``static=True``)."""
    return _packed_batches(workload, samples, pad_id, static=True)


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
        return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def build_model(workload: Workload, attn: str, checkpointing: bool = True, base=None):
    """A random-weight model of the workload's shape in bf16, with PEFT LoRA on all projections (a MoE
    shape: attention and experts); ``base`` (e.g. a 4-bit model) instead of a fresh bf16 one."""
    from peft import LoraConfig, get_peft_model

    model = build_base_model(workload, attn) if base is None else base
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    moe = SHAPE_FAMILIES.get(workload.shape) in MOE_FAMILIES
    lora = LoraConfig(
        r=workload.lora_r,
        lora_alpha=2 * workload.lora_r,
        **(MOE_LORA if moe else {"target_modules": projections}),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _sloth(**settings) -> Callable:
    """A system that builds the model and applies what ``SlothStrategy(**settings)`` applies."""

    def setup(workload: Workload):
        from lightning_sloth.plugins.strategy import transform_model

        # The packed attention replaces whatever is built with; GPT-OSS has no SDPA path to build with.
        attn = "eager" if SHAPE_FAMILIES.get(workload.shape) == "gpt_oss" else "sdpa"
        model = build_model(workload, attn, checkpointing=False)
        model._sloth_report = transform_model(model, **settings)
        return model

    return setup


SYSTEMS: dict[str, tuple[Callable, Callable]] = {
    "hf_padded": (lambda w: build_model(w, "sdpa"), _hf_padded_batches),
    "hf_packed_sdpa": (lambda w: build_model(w, "sdpa"), _packed_batches),
    # transformers' FlexAttention on the packed rows (documents found from position_ids): the packed
    # baseline for families without SDPA (GPT-OSS's attention sinks).
    "hf_packed_flex": (lambda w: build_model(w, "flex_attention"), _packed_batches),
    "sloth": (_sloth(), _packed_batches),
    "sloth_kernels": (_sloth(kernels=True), _packed_batches),
    "sloth_kernels_compile": (_sloth(kernels=True, compile=True), _packed_batches),
    "sloth_kernels_offload": (_sloth(kernels=True, offload="on"), _packed_batches),
    "sloth_kernels_planned": (_sloth(kernels=True, offload="auto", memory_budget="auto"), _packed_batches),
    "sloth_kernels_no_checkpointing": (_sloth(kernels=True, gradient_checkpointing=False), _packed_batches),
    "sloth_kernels_graphs": (_sloth(kernels=True, cuda_graphs=True), _static_packed_batches),
    "sloth_kernels_offload_graphs": (
        _sloth(kernels=True, offload="on", cuda_graphs=True),
        _static_packed_batches,
    ),
}


KERNEL_OPS = OPS  # the ops apply_kernels can install, each switched off in an ablation


def resolve_system(name: str) -> tuple[Callable, Callable]:
    """A system by name: one of :data:`SYSTEMS`, ``sloth_kernels_without_<op>`` (ablation) or
    ``sloth_kernels_offload_budget_<N>gib`` (offload with a memory plan for N GiB of activations)."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    ablation, budget = "sloth_kernels_without_", "sloth_kernels_offload_budget_"
    if name.startswith(ablation) and name[len(ablation) :] in KERNEL_OPS:
        op = name[len(ablation) :]
        # Without the RMSNorm kernel the fused add + norm (the same kernel) goes too.
        off = {op, "add_rms_norm"} if op == "rms_norm" else {op}
        return _sloth(kernels={o: o not in off for o in KERNEL_OPS}), _packed_batches
    gib = name[len(budget) : -len("gib")] if name.startswith(budget) and name.endswith("gib") else ""
    try:
        budget_bytes = int(float(gib) * 2**30)
    except ValueError:
        budget_bytes = -1
    if budget_bytes >= 0:
        return _sloth(kernels=True, offload="on", memory_budget=budget_bytes), _packed_batches
    known = sorted(SYSTEMS) + [ablation + o for o in KERNEL_OPS] + [budget + "<N>gib"]
    raise SystemExit(f"unknown system {name!r}; choose from {known}")


def _to_cuda(inputs: dict) -> dict:
    return {k: v.to("cuda", non_blocking=True) if torch.is_tensor(v) else v for k, v in inputs.items()}


def make_optimizer(model) -> torch.optim.Optimizer:
    """The fused AdamW every system trains with, over the trainable parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)


def stage_batch(micro_batches: list[dict], targets: int) -> tuple[list[dict], torch.Tensor]:
    """One step's micro-batches on the GPU, and its target-token count as the loss denominator."""
    return [_to_cuda(m) for m in micro_batches], torch.tensor(targets, device="cuda")


def loss_kwargs(model, micro_batches: list[dict], targets: int | None) -> dict:
    """``num_target_tokens`` for lightning_sloth's fused loss on a one-row step (its target count is
    the step's; the fused loss then computes logits only for target rows); nothing for the others."""
    from lightning_sloth.patching._forwards import takes_target_count

    if targets is None or len(micro_batches) != 1 or getattr(model, "_sloth_loss_all_rows", False):
        return {}
    if not takes_target_count(model):
        return {}
    return {"num_target_tokens": int(targets)}


def forward_backward(
    model, micro_batches: list[dict], num_items: torch.Tensor, targets: int | None = None
) -> torch.Tensor:
    """Forward and backward of every micro-batch under bf16 autocast; the summed loss, detached.
    ``targets``: the step's target count (host int), for :func:`loss_kwargs`."""
    loss = torch.zeros((), device="cuda")
    extra = loss_kwargs(model, micro_batches, targets)
    for inputs in micro_batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            micro_loss = model(**inputs, num_items_in_batch=num_items, **extra).loss
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss


def run_system(
    name: str, workload: Workload, samples, peak_flops: float, profile_to: str | None = None
) -> dict:
    """Train ``warmup_steps + timed_steps`` steps of one system and measure the timed ones.

    With ``profile_to``, one extra step after the timed ones runs under ``torch.profiler`` and
    its per-kernel CUDA time table is written there (not part of the timings).
    """
    setup, batches = resolve_system(name)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = setup(workload)
    model.train()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_params = flop_parameters(model) - _inactive_expert_parameters(model)
    optimizer = make_optimizer(model)
    times, tokens, flops, losses = [], [], [], []
    grad_norm = float("nan")
    warmup_peak = 0
    steps = workload.warmup_steps + workload.timed_steps
    profiler = None
    for step, (micro_batches, real_tokens, sum_sq, targets) in enumerate(batches(workload, samples, 0)):
        if step == steps + (profile_to is not None):
            break
        if step == steps:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        micro_batches, num_items = stage_batch(micro_batches, targets)
        torch.cuda.synchronize()
        if step == workload.warmup_steps:  # the timed steps' own peak, warm-up (and planning) excluded
            warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = forward_backward(model, micro_batches, num_items, targets)
        if step == steps - 1:
            grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
            grad_norm = float(torch.stack(grads).norm())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.__exit__(None, None, None)
            busy_ms = gpu_busy_ms(profiler.events())
            with open(profile_to, "w") as fh:
                fh.write(
                    f"{name}: step {elapsed * 1e3:.1f} ms (profiled), GPU busy {busy_ms:.1f} ms "
                    f"({busy_ms / (elapsed * 1e3):.0%}): the rest the GPU waited for the host\n\n"
                )
                fh.write(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40))
            break
        losses.append(float(loss))
        if step >= workload.warmup_steps:
            times.append(elapsed)
            tokens.append(real_tokens)
            flops.append(
                6 * n_params * real_tokens
                + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * sum_sq
            )
    if len(times) < workload.timed_steps:
        raise RuntimeError(f"{name}: only {len(times)} timed steps; raise the sample count")
    result = {
        "system": name,
        "tokens_per_s": sum(tokens) / sum(times),
        "median_step_s": statistics.median(times),
        "median_tokens_per_step": statistics.median(tokens),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "warmup_peak_allocated_gib": warmup_peak / 2**30,
        "mfu": sum(flops) / sum(times) / peak_flops,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "trainable_grad_norm": grad_norm,
        "timed_steps": len(times),
    }
    result |= _memory_plan(getattr(model, "_sloth_report", None))
    del model, optimizer, loss, micro_batches
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _inactive_expert_parameters(model) -> int:
    """Expert parameters a token does not use (MoE: all but ``top_k`` of each layer's ``E`` experts)."""
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if top_k is None:
        return 0
    inactive = 0
    for name, param in model.named_parameters():
        if ".experts." in name and "lora_" not in name and param.dim() >= 2:
            inactive += param.numel() * (param.shape[0] - top_k) // param.shape[0]
    return inactive


def gpu_busy_ms(events) -> float:
    """Milliseconds in which at least one GPU kernel or copy ran (union of their intervals)."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e3


def _memory_plan(report) -> dict:
    """The layer plan and offload counters of a sloth system, for the result record."""
    out: dict = {}
    layers = getattr(report, "checkpointing", None)
    if layers is not None and layers.memory_budget is not None:
        from lightning_sloth.offload import plan_peak_bytes

        out["layer_plan"] = {mode: layers.plan.count(mode) for mode in ("keep", "recompute", "offload")}
        out["plan_budget_gib"] = None if layers.budget_bytes is None else layers.budget_bytes / 2**30
        if layers.activation_bytes is not None:
            out["measured_layer_activation_mib"] = max(layers.activation_bytes) / 2**20
            out["measured_layer_input_mib"] = max(layers.input_bytes) / 2**20
            peak = plan_peak_bytes(layers.plan, layers.activation_bytes, layers.input_bytes)
            out["plan_estimated_activation_gib"] = peak / 2**30
    offloader = getattr(report, "offloader", None)
    if offloader is not None and offloader.enabled:
        out["offload"] = offloader.stats()
    return out


def run_isolated(
    name: str, workload: Workload, samples, peak_flops: float, profile_to: str | None = None
) -> dict:
    """:func:`run_system` in a fresh spawned process: a clean CUDA context and allocator per system."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_system, name, workload, samples, peak_flops, profile_to).result()


def environment() -> dict:
    """Device and library versions recorded with every result."""
    import lightning
    import transformers

    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="lightning_sloth fine-tuning benchmark (CUDA)")
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--systems", default="hf_padded,sloth")
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--profile", default=None, help="a system to profile one extra step of")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    parser.add_argument(
        "--same-process", action="store_true", help="run every system in this process (default: one each)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    for name in systems:
        resolve_system(name)  # unknown names fail before any model is built
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU")
    workload = Workload(
        shape=args.shape,
        tokens_per_step=args.tokens_per_step,
        timed_steps=args.timed_steps,
        warmup_steps=args.warmup_steps,
    )
    samples = workload.samples(SHAPES[args.shape].get("vocab_size", 32000))
    profile_to = str(Path(args.out).with_suffix("")) + "_profile.txt"
    run = run_system if args.same_process else run_isolated
    results = []
    for name in systems:
        profile = profile_to if name == args.profile else None
        try:
            result = run(name, workload, samples, args.peak_tflops * 1e12, profile)
        except Exception as err:  # an out-of-memory system is a result, not the end of the run
            if "out of memory" not in str(err).lower():
                raise
            result = {"system": name, "oom": True, "error": str(err).splitlines()[0][:300]}
            print(f"{name}: out of memory", flush=True)
        else:
            print(
                f"{name}: {result['tokens_per_s']:.0f} tok/s, {result['peak_allocated_gib']:.2f} GiB",
                flush=True,
            )
        results.append(result)
    report = {"environment": environment(), "workload": asdict(workload), "results": results}
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"{'system':<34} {'tok/s':>9} {'step s':>7} {'peak GiB':>9} {'MFU':>6} {'loss first→last':>18}")
    for r in results:
        if r.get("oom"):
            print(f"{r['system']:<34} {'OOM':>9}")
            continue
        print(
            f"{r['system']:<34} {r['tokens_per_s']:>9.0f} {r['median_step_s']:>7.3f} "
            f"{r['peak_allocated_gib']:>9.2f} {r['mfu']:>6.1%} {r['first_loss']:>8.3f}→{r['last_loss']:.3f}"
        )
        if "layer_plan" in r:
            print(
                f"    plan {r['layer_plan']} for {r['plan_budget_gib']} GiB; measured per layer "
                f"{r.get('measured_layer_activation_mib', float('nan')):.0f} MiB saved, "
                f"{r.get('measured_layer_input_mib', float('nan')):.0f} MiB input; "
                f"estimated activation peak {r.get('plan_estimated_activation_gib', float('nan')):.2f} GiB"
            )
    return report


if __name__ == "__main__":
    import sys

    from lightning_sloth.bench_suite import cli

    cli(sys.argv[1:], legacy=main)
