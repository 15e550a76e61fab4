"""How one system is measured: its training steps timed, its memory peaks, FLOPs and gradient health.

A *loop* system (a model and its batches) is trained here with fused AdamW (:func:`run_loop_system`);
lightning_sloth's user path runs through Lightning's ``Trainer`` with a timing callback
(:func:`run_trainer_system`). ``torch.cuda.synchronize`` brackets every timed step; warm-up steps
(compilation included) are excluded, and so is the memory they peaked at.

Every step's one-time work is counted too (:class:`~lightning_sloth.plugins.compile_cache.CompileCounter`:
Triton JIT compilations with their seconds, ``torch.compile`` graphs): ``compiles_per_step`` and
``kernels_compiled_in_timed_steps`` show whether a compilation landed inside the timed steps.

MFU counts model FLOPs as ``6 · N · tokens + 6 · width · Σ len²`` (``N``: all
parameters but the input embedding, and for MoE only the experts a token uses; the second term is
causal attention), real tokens only.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable

import lightning
import torch
import transformers
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_sloth.attention import attention_width
from lightning_sloth.bench.workload import (
    MOE_FAMILIES,
    MOE_LORA,
    SHAPE_FAMILIES,
    Workload,
    bench_device,
    build_base_model,
    packed_batch_list,
    vocab_size,
)
from lightning_sloth.data import inputs_to_device
from lightning_sloth.module import CausalLMModule, LoraSettings, OptimizerSettings, flop_parameters
from lightning_sloth.offload import plan_peak_bytes
from lightning_sloth.patching import takes_target_count
from lightning_sloth.plugins import SlothPrecision, SlothStrategy
from lightning_sloth.plugins.compile_cache import CompileCounter


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peaks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


def _reset_peaks(device: torch.device) -> int | None:
    """Reset the peak counters; returns the peak so far (bytes) on CUDA."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return peak


def lora_grad_stats(model: torch.nn.Module) -> dict:
    """Gradient norms of the trainable parameters: all, LoRA A and LoRA B matrices separately.

    Returns ``grad_norm``, ``lora_A_grad_norm``, ``lora_B_grad_norm`` (None where no such
    parameter exists) and ``trainable_without_grad`` (trainable parameters whose grad is None).
    """
    groups: dict[str, list[torch.Tensor]] = {"A": [], "B": [], "other": []}
    missing = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            missing += 1
            continue
        key = "A" if "lora_A" in name else "B" if "lora_B" in name else "other"
        groups[key].append(p.grad.detach().float().norm())

    def norm(tensors: list[torch.Tensor]) -> float | None:
        return float(torch.stack(tensors).norm()) if tensors else None

    return {
        "grad_norm": norm(groups["A"] + groups["B"] + groups["other"]),
        "lora_A_grad_norm": norm(groups["A"]),
        "lora_B_grad_norm": norm(groups["B"]),
        "trainable_without_grad": missing,
    }


def guard(result: dict) -> str | None:
    """Why a measured system must be reported as failed, or None when it trained.

    Failed: a loss that is not finite, or trainable gradients (at the last timed step) that are
    missing, all zero or not finite.
    """
    bad = [loss for loss in result.get("losses", []) if not math.isfinite(loss)]
    if bad:
        return f"loss not finite ({bad[0]})"
    norm = result.get("grad_norm")
    if norm is None:
        return "no trainable parameter received a gradient"
    if not math.isfinite(norm):
        return f"trainable gradients not finite (norm {norm})"
    if norm == 0.0:
        return "trainable gradients are all zero"
    return None


def summarize(times: list[float], tokens: list[int], flops: list[float], losses: list[float]) -> dict:
    """Throughput figures of the timed steps (tokens/s per step: median, min, max)."""
    per_step = [t / s for t, s in zip(tokens, times)]
    return {
        "tokens_per_s": sum(tokens) / sum(times),
        "tokens_per_s_median": statistics.median(per_step),
        "tokens_per_s_min": min(per_step),
        "tokens_per_s_max": max(per_step),
        "tokens_per_s_steps": [round(x, 1) for x in per_step],
        "median_step_s": statistics.median(times),
        "median_tokens_per_step": statistics.median(tokens),
        "model_tflops_per_s": sum(flops) / sum(times) / 1e12,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "timed_steps": len(times),
    }


def compile_record(per_step: list[dict], warmup_steps: int) -> dict:
    """The compile counts of every step (warm-up included) and what the timed steps compiled."""
    timed = per_step[warmup_steps:]
    return {
        "compiles_per_step": [s["triton_compiles"] for s in per_step],
        "triton_compile_s_per_step": [s["triton_compile_s"] for s in per_step],
        "dynamo_graphs_per_step": [s["dynamo_graphs"] for s in per_step],
        "compiles_in_timed_steps": sum(s["triton_compiles"] + s["dynamo_graphs"] for s in timed),
        "compile_s_in_timed_steps": round(sum(s["triton_compile_s"] for s in timed), 4),
        "kernels_compiled_in_timed_steps": sorted({k for s in timed for k in s["triton_kernels"]}),
    }


def step_flops(n_params: int, config, real_tokens: int, sum_sq: int) -> float:
    """Model FLOPs of one step: ``6·N·tokens + 6·width·Σ len²`` (causal attention; ``width``: heads ×
    head dim summed over the softmax-attention layers, :func:`~lightning_sloth.attention.attention_width`)."""
    attention = 6 * attention_width(config) * sum_sq
    return 6 * n_params * real_tokens + attention


def make_optimizer(model) -> torch.optim.Optimizer:
    """The fused AdamW every system trains with, over the trainable parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)


def stage_batch(micro_batches: list[dict], targets: int) -> tuple[list[dict], torch.Tensor]:
    """One step's micro-batches on the GPU, and its target-token count as the loss denominator."""
    cuda = torch.device("cuda")
    return [inputs_to_device(m, cuda) for m in micro_batches], torch.tensor(targets, device=cuda)


def loss_kwargs(model, micro_batches: list[dict], targets: int | None) -> dict:
    """``num_target_tokens`` for lightning_sloth's fused loss on a one-row step (its target count is
    the step's; the fused loss then computes logits only for target rows); nothing for the others."""
    if targets is None or len(micro_batches) != 1 or getattr(model, "_sloth_loss_all_rows", False):
        return {}
    if not takes_target_count(model):
        return {}
    return {"num_target_tokens": int(targets)}


def forward_backward(
    model, micro_batches: list[dict], num_items: torch.Tensor, targets: int | None = None
) -> torch.Tensor:
    """Forward and backward of every micro-batch under bf16 autocast on ``num_items``' device; the
    summed loss, detached. ``targets``: the step's target count (host int), for :func:`loss_kwargs`."""
    loss = torch.zeros((), device=num_items.device)
    extra = loss_kwargs(model, micro_batches, targets)
    for inputs in micro_batches:
        with torch.autocast(num_items.device.type, dtype=torch.bfloat16):
            micro_loss = model(**inputs, num_items_in_batch=num_items, **extra).loss
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss


def inactive_expert_parameters(model) -> int:
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


def gpu_kernel_table(events, top: int = 25) -> list[dict]:
    """The ``top`` GPU kernels and copies of a profiled step by total time: ``{"name", "ms",
    "calls"}`` each, names cut to 120 characters (where a step's time goes, kept in the record)."""
    totals: dict[str, list] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            entry = totals.setdefault(e.name[:120], [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / 1e3
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [{"name": name, "ms": round(ms, 3), "calls": calls} for name, (ms, calls) in ranked]


def copy_launchers(events, top: int = 15) -> list[dict]:
    """Who issued a profiled step's device copies: for every ``cudaMemcpyAsync`` call, the chain of
    operators around it (outermost first, up to four, with the innermost one's input shapes),
    counted: ``{"chain", "calls"}`` each, most calls first (a ``Memcpy DtoD`` in the kernel table
    names no operator)."""
    counts: dict[str, int] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.name != "cudaMemcpyAsync":
            continue
        chain, parent = [], getattr(e, "cpu_parent", None)
        while parent is not None:
            chain.append(parent)
            parent = getattr(parent, "cpu_parent", None)
        if not chain:
            key = "(no operator)"
        else:
            shapes = getattr(chain[0], "input_shapes", None)
            names = [p.name for p in reversed(chain[:4])]
            key = " > ".join(names) + (f" {shapes}" if shapes else "")
        counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])[:top]
    return [{"chain": chain, "calls": calls} for chain, calls in ranked]


def write_profile(path: str, name: str, profiler, elapsed_s: float) -> None:
    """A profiled step as text at ``path``: its GPU kernels and copies by total time, who issued
    its device copies, and its operators by input shape by the device time they launched themselves
    (copies, casts and elementwise passes show up with their shapes). A CPU-only profile writes the
    operators by their CPU time."""
    events = profiler.events()
    busy_ms = gpu_busy_ms(events)
    cuda = any(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
    with open(path, "w") as fh:
        fh.write(
            f"{name}: step {elapsed_s * 1e3:.1f} ms (profiled), GPU busy {busy_ms:.1f} ms "
            f"({busy_ms / (elapsed_s * 1e3):.0%}): the rest the GPU waited for the host\n\n"
            if cuda
            else f"{name}: step {elapsed_s * 1e3:.1f} ms (profiled, host only)\n\n"
        )
        fh.write(f"{'GPU ms':>9} {'calls':>6}  kernel or copy\n")
        for row in gpu_kernel_table(events, top=40):
            fh.write(f"{row['ms']:9.1f} {row['calls']:6d}  {row['name']}\n")
        fh.write("\nDevice copies (cudaMemcpyAsync) by the operators around them:\n")
        for row in copy_launchers(events):
            fh.write(f"{row['calls']:6d}  {row['chain']}\n")
        own = "the device time they launched themselves" if cuda else "their own CPU time"
        fh.write(f"\nOperators by input shape, by {own}:\n")
        by_shape = profiler.key_averages(group_by_input_shape=True)
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        fh.write(by_shape.table(sort_by=sort, row_limit=40, max_name_column_width=60))


def profile_step(step: Callable[[], object], device: torch.device, path: str, name: str) -> None:
    """Run ``step`` once more under ``torch.profiler`` (host and device, input shapes) and write
    :func:`write_profile`'s text to ``path``; not part of any timing."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(device)
    with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
        begin = time.perf_counter()
        step()
        synchronize(device)
        elapsed = time.perf_counter() - begin
    write_profile(path, name, profiler, elapsed)


def memory_plan_record(report) -> dict:
    """The layer plan and offload counters of a sloth system, for the result record."""
    out: dict = {}
    layers = getattr(report, "checkpointing", None)
    if layers is not None and layers.memory_budget is not None:
        out["layer_plan"] = {mode: layers.plan.count(mode) for mode in ("keep", "recompute", "offload")}
        out["plan_budget_gib"] = None if layers.budget_bytes is None else layers.budget_bytes / 2**30
        if layers.activation_bytes is not None:
            out["measured_layer_activation_mib"] = max(layers.activation_bytes) / 2**20
            out["measured_layer_input_mib"] = max(layers.input_bytes) / 2**20
            backward = layers.backward_bytes or 0
            if backward:
                out["measured_layer_backward_mib"] = max(backward) / 2**20
            peak = plan_peak_bytes(layers.plan, layers.activation_bytes, layers.input_bytes, 0, backward)
            out["plan_estimated_activation_gib"] = peak / 2**30
    offloader = getattr(report, "offloader", None)
    if offloader is not None and offloader.enabled:
        out["offload"] = offloader.stats()
    return out


def run_loop_system(system, workload: Workload, samples, profile_to: str | None = None) -> dict:
    """Train a loop system ``warmup_steps + timed_steps`` steps with fused AdamW; measure the timed ones.

    ``profile_to``: after them, the first timed step's batch once more under the profiler, its
    table written there (:func:`profile_step`)."""
    device = bench_device()
    _reset_peaks(device)
    start = time.perf_counter()
    model = system.setup(workload)
    model.train()
    setup_s = time.perf_counter() - start
    n_params = flop_parameters(model) - inactive_expert_parameters(model)  # MoE: active only
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    times, tokens, flops, losses, stats, compiles = [], [], [], [], {}, []
    warmup_peak = replay = None
    steps = workload.warmup_steps + workload.timed_steps
    counter = CompileCounter()
    with counter:
        for step, (micro, real_tokens, sum_sq, targets) in enumerate(system.batches(workload, samples, 0)):
            if step == steps:
                break
            micro = [inputs_to_device(m, device) for m in micro]  # cu_seqlens keep their host copy
            num_items = torch.tensor(targets, device=device)
            synchronize(device)
            if step == workload.warmup_steps:  # the timed steps' own peak, warm-up excluded
                warmup_peak = _reset_peaks(device)
                replay = (micro, num_items, targets)
            begin = time.perf_counter()
            loss = forward_backward(model, micro, num_items, targets)
            synchronize(device)
            elapsed = time.perf_counter() - begin
            if step == steps - 1:  # outside the timed interval
                stats = lora_grad_stats(model)
            begin = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            elapsed += time.perf_counter() - begin
            losses.append(float(loss))
            compiles.append(counter.take())
            if step >= workload.warmup_steps:
                times.append(elapsed)
                tokens.append(real_tokens)
                flops.append(step_flops(n_params, model.config, real_tokens, sum_sq))
    if len(times) < workload.timed_steps:
        raise RuntimeError(f"only {len(times)} timed steps; raise the sample count")
    result = summarize(times, tokens, flops, losses) | stats | _peaks(device) | {"setup_s": setup_s}
    result |= compile_record(compiles, workload.warmup_steps) | {"compile_hooks": counter.available}
    if warmup_peak is not None:
        result["warmup_peak_allocated_gib"] = warmup_peak / 2**30
    result |= memory_plan_record(getattr(model, "_sloth_report", None))
    # After the peaks: the profiler's memory is not the step's.
    if device.type == "cuda" and replay is not None:
        result |= gpu_busy_share(
            lambda: (forward_backward(model, *replay), optimizer.step(), optimizer.zero_grad())
        )
        # The profiler's own host work per launch stretches a host-bound step; the same batch's
        # unprofiled wall time (the first timed step) against the GPU time the profile measured
        # estimates the share of the real step.
        result["replayed_step_ms"] = times[0] * 1e3
        result["gpu_busy_share_unprofiled"] = result["gpu_busy_ms"] / result["replayed_step_ms"]
    if profile_to is not None and replay is not None:
        profile_step(
            lambda: (forward_backward(model, *replay), optimizer.step(), optimizer.zero_grad()),
            device,
            profile_to,
            system.label,
        )
        result["profile"] = profile_to
    return result


def gpu_busy_share(step: Callable[[], object]) -> dict:
    """Run one more training step under the CUDA profiler (the first timed step's batch again, after
    the timed steps) and report the share of its wall time in which the GPU ran a kernel or copy.

    The profiler adds host work of its own to every launch, so the share is a lower bound; the rest
    of the step the GPU waited for the host to queue work. The caller also relates the GPU time to
    the same batch's unprofiled step (``gpu_busy_share_unprofiled``). ``gpu_kernels``: the step's
    largest kernels (:func:`gpu_kernel_table`).
    """
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - begin) * 1e3
    events = profiler.events()
    busy_ms = gpu_busy_ms(events)
    return {
        "profiled_step_ms": wall_ms,
        "gpu_busy_ms": busy_ms,
        "gpu_busy_share": busy_ms / wall_ms,
        "gpu_kernels": gpu_kernel_table(events),
    }


def run_trainer_system(
    workload: Workload, samples=None, *, offload: str = "off", quantize: str | None = None
) -> dict:
    """lightning_sloth's user path: ``CausalLMModule`` + ``SlothStrategy(kernels=True)`` +
    ``SlothPrecision("bf16-mixed")`` in a ``Trainer``, timed by a callback around every batch.

    The model is the loop systems' (the workload's shape in bf16, LoRA on the seven projections,
    on attention and the experts for MoE shapes). ``offload``: ``SlothStrategy(offload=...)``;
    ``quantize``: ``SlothPrecision(quantize=...)`` (the QLoRA scenarios' NF4 base weights).
    """
    device = bench_device()
    samples = samples if samples is not None else workload.samples(vocab_size(workload))
    steps = workload.warmup_steps + workload.timed_steps
    batches = packed_batch_list(workload, samples)[:steps]
    if len(batches) < steps:
        raise RuntimeError(f"only {len(batches)} packed steps; raise the sample count")
    start = time.perf_counter()
    _reset_peaks(device)
    family = SHAPE_FAMILIES.get(workload.shape)
    targets = (
        {
            "target_modules": tuple(MOE_LORA["target_modules"]),
            "target_parameters": tuple(MOE_LORA["target_parameters"]),
        }
        if family in MOE_FAMILIES
        else {}
    )
    module = CausalLMModule(
        # The packed attention replaces whatever is built with; GPT-OSS has no SDPA path to build with.
        build_base_model(workload, "eager" if family == "gpt_oss" else "sdpa"),
        lora=LoraSettings(r=workload.lora_r, alpha=2 * workload.lora_r, **targets),
        optimizer=OptimizerSettings(lr=1e-4, scheduler="constant"),
    )

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times, self.tokens, self.flops, self.losses, self.stats = [], [], [], [], {}
            self.warmup_peak, self.begin, self.n_params = None, 0.0, None
            self.counter, self.compiles = CompileCounter(), []

        def on_train_start(self, trainer, pl_module) -> None:
            self.counter.__enter__()

        def on_train_end(self, trainer, pl_module) -> None:
            self.counter.__exit__(None, None, None)

        def on_exception(self, trainer, pl_module, exception) -> None:
            self.counter.__exit__(None, None, None)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            synchronize(device)
            if batch_idx == workload.warmup_steps:
                self.warmup_peak = _reset_peaks(device)
            self.begin = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == steps - 1:
                self.stats = lora_grad_stats(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            synchronize(device)
            elapsed = time.perf_counter() - self.begin
            self.losses.append(float(outputs["loss"]))
            self.compiles.append(self.counter.take())
            if batch_idx >= workload.warmup_steps:
                if self.n_params is None:
                    self.n_params = flop_parameters(pl_module.model) - inactive_expert_parameters(
                        pl_module.model
                    )
                self.times.append(elapsed)
                self.tokens.append(batch.num_tokens)
                self.flops.append(
                    step_flops(self.n_params, pl_module.model.config, batch.num_tokens, batch.sum_sq_seqlens)
                )

    timer = StepTimer()
    precision = SlothPrecision("bf16-mixed", **({"quantize": quantize} if quantize else {}))
    trainer = Trainer(
        accelerator=device.type,
        devices=1,
        strategy=SlothStrategy(kernels=True, offload=offload),
        plugins=[precision],
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    setup_s = time.perf_counter() - start
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=_identity))
    result = summarize(timer.times, timer.tokens, timer.flops, timer.losses)
    result |= timer.stats | _peaks(device) | {"setup_s": setup_s}
    result |= compile_record(timer.compiles, workload.warmup_steps) | {
        "compile_hooks": timer.counter.available
    }
    if timer.warmup_peak is not None:
        result["warmup_peak_allocated_gib"] = timer.warmup_peak / 2**30
    result |= memory_plan_record(getattr(trainer.strategy, "sloth_report", None))
    return result


def _identity(batch):
    return batch


def environment() -> dict:
    """Device and library versions recorded with every result."""
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
