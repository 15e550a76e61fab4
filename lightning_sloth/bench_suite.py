"""The benchmark suite: one scenario × its systems, from the Hydra configs under ``conf/bench/``.

    python -m lightning_sloth.bench                                   # headline scenario, all systems
    python -m lightning_sloth.bench scenario=qwen3_0_6b systems=peers # another scenario / system set
    python -m lightning_sloth.bench report                            # README tables + plots from JSON

Per run: a short bf16 matmul probe (the rate MFU is measured against), then every system in its own
fresh process (a clean CUDA context and allocator each; ``isolate=false`` runs them in this one),
then one JSON, ``<out_dir>/bench_<scenario>_<device>.json``, rewritten after every system::

    {"environment": device, driver, versions of torch/triton/transformers/peft/liger/unsloth (None
                    when absent), git commit, matmul probe TFLOP/s, datasheet TFLOP/s,
     "scenario": the composed config, "workload": the workload every system trained,
     "results": [one record per system: status, real tokens/s (median, min, max, per step), peak
                 allocated/reserved, MFU (measured and datasheet), first/last loss, LoRA gradient
                 norms (A and B), the system's wall time (process start to last step)]}

The guard: a system whose loss is not finite, or whose trainable gradients are all zero or not
finite, gets ``status: "failed"`` and a reason; the report never shows it as fast.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from lightning_sloth import bench
from lightning_sloth.bench import Workload

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, without sparsity).
DATASHEET_BF16_TFLOPS = {"H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H200": 989.0, "A100": 312.0}

OPTIONAL_PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "lightning",
    "liger-kernel",
    "unsloth",
    "unsloth_zoo",
    "bitsandbytes",
)


# ---------------------------------------------------------------------------------------------
# Scenario -> workload


def register_scenario(scenario: dict) -> Workload:
    """The :class:`Workload` of a scenario config; a scenario's inline ``model`` becomes its shape.

    Args:
        scenario: ``{"name", "shape" (a key of bench.SHAPES, or None), "model" (None, or a
            transformers config as a dict with ``model_type``), "workload": {Workload fields}}``.
    """
    shape = scenario.get("shape") or scenario["name"]
    model = scenario.get("model")
    if model:
        model = dict(model)
        bench.SHAPE_FAMILIES[shape] = model.pop("model_type", "llama")
        bench.SHAPES[shape] = model
    if shape not in bench.SHAPES:
        raise ValueError(f"scenario {scenario['name']!r}: unknown shape {shape!r} and no model given")
    known = {f.name for f in fields(Workload)}
    extra = set(scenario.get("workload", {})) - known
    if extra:
        raise ValueError(f"scenario {scenario['name']!r}: unknown workload keys {sorted(extra)}")
    return Workload(shape=shape, **scenario.get("workload", {}))


def _vocab(workload: Workload) -> int:
    return bench.SHAPES[workload.shape].get("vocab_size", 32000)


# ---------------------------------------------------------------------------------------------
# Measurement helpers


def _sync(device: torch.device) -> None:
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


def step_flops(n_params: int, config, real_tokens: int, sum_sq: int) -> float:
    """Model FLOPs of one step: ``6·N·tokens + 6·layers·heads·head_dim·Σ len²`` (causal attention)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * sum_sq
    return 6 * n_params * real_tokens + attention


def _to_device(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in inputs.items()}


# ---------------------------------------------------------------------------------------------
# Runners


def run_loop_system(system, workload: Workload, samples) -> dict:
    """Train a loop system ``warmup_steps + timed_steps`` steps with fused AdamW; measure the timed ones."""
    from lightning_sloth.module import flop_parameters

    device = bench.bench_device()
    _reset_peaks(device)
    start = time.perf_counter()
    model = system.setup(workload)
    model.train()
    setup_s = time.perf_counter() - start
    n_params = flop_parameters(model) - bench._inactive_expert_parameters(model)  # MoE: active only
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    times, tokens, flops, losses, stats = [], [], [], [], {}
    warmup_peak = replay = None
    steps = workload.warmup_steps + workload.timed_steps

    def forward_backward(micro, num_items, targets):
        loss = torch.zeros((), device=device)
        extra = bench.loss_kwargs(model, micro, targets)
        for inputs in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                micro_loss = model(**inputs, num_items_in_batch=num_items, **extra).loss
            micro_loss.backward()
            loss += micro_loss.detach()
        return loss

    for step, (micro, real_tokens, sum_sq, targets) in enumerate(system.batches(workload, samples, 0)):
        if step == steps:
            break
        micro = [_to_device(m, device) for m in micro]
        num_items = torch.tensor(targets, device=device)
        _sync(device)
        if step == workload.warmup_steps:  # the timed steps' own peak, warm-up excluded
            warmup_peak = _reset_peaks(device)
            replay = (micro, num_items, targets)
        begin = time.perf_counter()
        loss = forward_backward(micro, num_items, targets)
        _sync(device)
        elapsed = time.perf_counter() - begin
        if step == steps - 1:  # outside the timed interval
            stats = lora_grad_stats(model)
        begin = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        elapsed += time.perf_counter() - begin
        losses.append(float(loss))
        if step >= workload.warmup_steps:
            times.append(elapsed)
            tokens.append(real_tokens)
            flops.append(step_flops(n_params, model.config, real_tokens, sum_sq))
    if len(times) < workload.timed_steps:
        raise RuntimeError(f"only {len(times)} timed steps; raise the sample count")
    result = summarize(times, tokens, flops, losses) | stats | _peaks(device) | {"setup_s": setup_s}
    if warmup_peak is not None:
        result["warmup_peak_allocated_gib"] = warmup_peak / 2**30
    result |= bench._memory_plan(getattr(model, "_sloth_report", None))
    # After the peaks: the profiler's memory is not the step's.
    if device.type == "cuda" and replay is not None:
        result |= gpu_busy_share(lambda: (forward_backward(*replay), optimizer.step(), optimizer.zero_grad()))
        # The profiler's own host work per launch stretches a host-bound step; the same batch's
        # unprofiled wall time (the first timed step) against the GPU time the profile measured
        # estimates the share of the real step.
        result["replayed_step_ms"] = times[0] * 1e3
        result["gpu_busy_share_unprofiled"] = result["gpu_busy_ms"] / result["replayed_step_ms"]
    return result


def gpu_busy_share(step: Callable[[], object]) -> dict:
    """Run one more training step under the CUDA profiler (the first timed step's batch again, after
    the timed steps) and report the share of its wall time in which the GPU ran a kernel or copy.

    The profiler adds host work of its own to every launch, so the share is a lower bound; the rest
    of the step the GPU waited for the host to queue work. The caller also relates the GPU time to
    the same batch's unprofiled step (``gpu_busy_share_unprofiled``).
    """
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - begin) * 1e3
    busy_ms = bench.gpu_busy_ms(profiler.events())
    return {"profiled_step_ms": wall_ms, "gpu_busy_ms": busy_ms, "gpu_busy_share": busy_ms / wall_ms}


def run_trainer_system(workload: Workload, samples=None) -> dict:
    """lightning_sloth's user path: ``CausalLMModule`` + ``SlothStrategy(kernels=True)`` +
    ``SlothPrecision("bf16-mixed")`` in a ``Trainer``, timed by a callback around every batch."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision, SlothStrategy
    from lightning_sloth.bench_systems import packed_batch_list
    from lightning_sloth.module import flop_parameters

    device = bench.bench_device()
    samples = samples if samples is not None else workload.samples(_vocab(workload))
    steps = workload.warmup_steps + workload.timed_steps
    batches = packed_batch_list(workload, samples)[:steps]
    if len(batches) < steps:
        raise RuntimeError(f"only {len(batches)} packed steps; raise the sample count")
    start = time.perf_counter()
    _reset_peaks(device)
    module = CausalLMModule(
        bench.build_base_model(workload, "sdpa"),
        lora=LoraSettings(r=workload.lora_r, alpha=2 * workload.lora_r),
        optimizer=OptimizerSettings(lr=1e-4, scheduler="constant"),
    )

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times, self.tokens, self.flops, self.losses, self.stats = [], [], [], [], {}
            self.warmup_peak, self.begin, self.n_params = None, 0.0, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            _sync(device)
            if batch_idx == workload.warmup_steps:
                self.warmup_peak = _reset_peaks(device)
            self.begin = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == steps - 1:
                self.stats = lora_grad_stats(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            _sync(device)
            elapsed = time.perf_counter() - self.begin
            self.losses.append(float(outputs["loss"]))
            if batch_idx >= workload.warmup_steps:
                if self.n_params is None:
                    self.n_params = flop_parameters(pl_module.model)
                self.times.append(elapsed)
                self.tokens.append(batch.num_tokens)
                self.flops.append(
                    step_flops(self.n_params, pl_module.model.config, batch.num_tokens, batch.sum_sq_seqlens)
                )

    timer = StepTimer()
    trainer = Trainer(
        accelerator=device.type,
        devices=1,
        strategy=SlothStrategy(kernels=True),
        plugins=[SlothPrecision("bf16-mixed")],
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
    if timer.warmup_peak is not None:
        result["warmup_peak_allocated_gib"] = timer.warmup_peak / 2**30
    return result


def _identity(batch):
    return batch


def measure(name: str, scenario: dict) -> dict:
    """One system of one scenario, in this process: its record, guarded; errors become records."""
    from lightning_sloth.bench_systems import resolve

    workload = register_scenario(scenario)
    system = resolve(name)
    record: dict[str, Any] = {"system": name, "label": system.label}
    try:
        samples = workload.samples(_vocab(workload))
        if system.trainer is not None:
            record |= system.trainer(workload, samples)
        else:
            record |= run_loop_system(system, workload, samples)
    except Exception as err:  # a system that cannot run is a result, not the end of the suite
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        oom = "out of memory" in str(err).lower()
        return record | {"status": "oom" if oom else "error", "reason": message[:400]}
    reason = guard(record)
    record |= {"status": "failed", "reason": reason} if reason else {"status": "ok"}
    record["trainable_grad_norm"] = record.get("grad_norm")
    return record


CPU_PROBE_SIZE = 512


def matmul_probe(device: torch.device, size: int = 8192, iters: int = 20) -> float:
    """Measured dense bf16 matmul rate of the device, TFLOP/s (median of ``iters`` products).

    Off the GPU the product is capped at 512 (an 8192 one takes minutes on a CPU; MFU there only
    shows that the field is filled).
    """
    if device.type != "cuda":
        size = min(size, CPU_PROBE_SIZE)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


def package_versions() -> dict:
    """Installed versions of the benchmark's packages, None where absent (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in OPTIONAL_PACKAGES:
        try:
            out[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            out[name.replace("-", "_")] = None
    return out


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def probe_environment(probe_size: int, probe_iters: int) -> dict:
    """Device, driver, versions and the measured bf16 matmul rate (run in the probe's own process)."""
    device = bench.bench_device()
    env = package_versions() | bench.environment()  # the running versions (torch's +cu suffix) win
    if device.type == "cpu":
        import platform

        env["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    env["driver"] = _driver_version()
    env["device_count"] = torch.cuda.device_count()
    env["matmul_probe_tflops"] = matmul_probe(device, probe_size, probe_iters)
    env["matmul_probe"] = (
        f"bf16 {probe_size}x{probe_size} @ {probe_size}x{probe_size}, median of {probe_iters}"
    )
    env["datasheet_bf16_tflops"] = next(
        (v for k, v in DATASHEET_BF16_TFLOPS.items() if k in env["device"]), None
    )
    return env


# ---------------------------------------------------------------------------------------------
# Fresh processes


def worker_main(task_path: str, out_path: str) -> None:
    """Entry of a system's (or the probe's) fresh process: read the task, write the record."""
    task = json.loads(Path(task_path).read_text())
    if task["kind"] == "probe":
        out = probe_environment(task["probe_size"], task["probe_iters"])
    else:
        out = measure(task["system"], task["scenario"])
    Path(out_path).write_text(json.dumps(out))


def _worker_code(preamble: str, task_path: str, out_path: str) -> str:
    """The fresh process's program: the system's preamble (a failure is recorded), then the worker."""
    lines = ["import json", "try:"]
    lines += ["    " + line for line in (preamble.splitlines() or ["pass"])]
    lines += [
        "except Exception as err:",
        "    reason = 'preamble failed: ' + type(err).__name__ + ': ' + str(err)",
        f"    open({out_path!r}, 'w').write(json.dumps({{'status': 'error', 'reason': reason[:400]}}))",
        "    raise",
        "from lightning_sloth.bench_suite import worker_main",
        f"worker_main({task_path!r}, {out_path!r})",
    ]
    return "\n".join(lines) + "\n"


def _in_fresh_process(task: dict, preamble: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        task_path, out_path = Path(tmp) / "task.json", Path(tmp) / "out.json"
        task_path.write_text(json.dumps(task))
        code = _worker_code(preamble, str(task_path), str(out_path))
        try:
            proc = subprocess.run([sys.executable, "-c", code], timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "error", "reason": f"timed out after {timeout_s:.0f} s"}
        if not out_path.exists():
            return {"status": "error", "reason": f"process exited with code {proc.returncode}"}
        return json.loads(out_path.read_text())


def device_tag(device_name: str) -> str:
    """A short file-name tag for a device: ``h100``, ``h200``, ``a100``..., else a slug, ``cpu`` on CPU."""
    if device_name.startswith("CPU"):
        return "cpu"
    match = re.search(r"\b([A-Z]\d{2,3}[A-Za-z]?)\b", device_name)
    if match:
        return match.group(1).lower()
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    return slug or "cpu"


def run_suite(cfg) -> dict:
    """Run a composed ``conf/bench`` config: the probe, then every system; returns the report.

    Args:
        cfg: a mapping (``DictConfig`` or dict) with ``scenario``, ``systems.names``, ``out_dir``,
            ``isolate``, ``tag``, ``git_commit``, ``probe`` (size, iters), ``system_timeout_s``.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    scenario, names = cfg["scenario"], list(cfg["systems"]["names"])
    from lightning_sloth.bench_systems import resolve

    for name in names:
        resolve(name)  # unknown names fail before anything runs
    commit = cfg.get("git_commit")
    if commit is not None and not isinstance(commit, str):  # git_commit=982e255 reads as a float
        raise ValueError(
            f"git_commit={commit!r} was read as a {type(commit).__name__}, not a commit hash: quote it, "
            "e.g. \"git_commit='982e255'\""
        )
    workload = register_scenario(scenario)
    probe = {"kind": "probe", "probe_size": cfg["probe"]["size"], "probe_iters": cfg["probe"]["iters"]}
    timeout = float(cfg.get("system_timeout_s") or 3600)
    if cfg["isolate"]:
        env = _in_fresh_process(probe, "", timeout)
        if "device" not in env:
            raise RuntimeError(f"matmul probe failed: {env.get('reason')}")
    else:
        env = probe_environment(probe["probe_size"], probe["probe_iters"])
    env["git_commit"] = commit or _git_commit()
    tag = cfg.get("tag") or device_tag(env["device"])
    out = Path(cfg["out_dir"]) / f"bench_{scenario['name']}_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": env, "scenario": scenario, "workload": asdict(workload), "results": []}
    for name in names:
        task = {"kind": "system", "system": name, "scenario": scenario}
        begin = time.perf_counter()
        if cfg["isolate"]:
            preamble = resolve(name).preamble
            record = {"system": name, "label": resolve(name).label} | _in_fresh_process(
                task, preamble, timeout
            )
        else:
            record = measure(name, scenario)
        record["wall_s"] = time.perf_counter() - begin  # the whole system: process, build, every step
        add_mfu(record, env)
        report["results"].append(record)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(_line(record), flush=True)
    print(f"wrote {out}", flush=True)
    return report


def add_mfu(record: dict, env: dict) -> None:
    """MFU of a record against the measured matmul rate and the datasheet peak."""
    rate = record.get("model_tflops_per_s")
    if rate is None:
        return
    probe, sheet = env.get("matmul_probe_tflops"), env.get("datasheet_bf16_tflops")
    record["mfu_measured"] = rate / probe if probe else None
    record["mfu_datasheet"] = rate / sheet if sheet else None
    record["mfu"] = record["mfu_datasheet"]


def _line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['system']:<36} {r.get('status', '?').upper()}: {r.get('reason')}"
    peak = r.get("peak_allocated_gib")
    return (
        f"{r['system']:<36} {r['tokens_per_s_median']:>9.0f} tok/s "
        f"({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}), "
        f"peak {'-' if peak is None else f'{peak:.2f} GiB'}, loss {r['first_loss']:.3f}->{r['last_loss']:.3f}"
        + (f", GPU busy {r['gpu_busy_share']:.0%}" if "gpu_busy_share" in r else "")
        + (
            f" ({r['gpu_busy_share_unprofiled']:.0%} of the unprofiled step)"
            if "gpu_busy_share_unprofiled" in r
            else ""
        )
    )


def app(argv: list[str]) -> dict | None:
    """The Hydra app over ``conf/bench`` (``python -m lightning_sloth.bench [overrides]``)."""
    import hydra

    result: dict = {}

    @hydra.main(version_base="1.3", config_path="pkg://lightning_sloth.conf.bench", config_name="config")
    def _main(cfg) -> None:
        result["report"] = run_suite(cfg)

    sys.argv = [sys.argv[0], *argv]
    _main()
    return result.get("report")


def cli(argv: list[str], legacy) -> Any:
    """``report ...`` -> the report; ``--out ...`` -> the argparse harness; else the Hydra app."""
    if argv and argv[0] == "report":
        from lightning_sloth.bench_report import main as report_main

        raise SystemExit(report_main(argv[1:]))
    if any(a == "--out" or a.startswith("--out=") for a in argv):
        return legacy(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return app(argv)
