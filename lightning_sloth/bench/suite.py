"""The benchmark suite: one scenario × its systems, from the Hydra configs under ``conf/bench/``.

    python -m lightning_sloth.bench                                   # headline scenario, all systems
    python -m lightning_sloth.bench scenario=qwen3_0_6b systems=peers # another scenario / system set
    python -m lightning_sloth.bench report                            # tables + plots from JSON

Per run: a short bf16 matmul probe (the rate MFU is measured against), then every system in its own
fresh process (a clean CUDA context and allocator each; ``isolate=false`` runs them in this one),
then one JSON, ``<out_dir>/bench_<scenario>_<device>.json``, rewritten after every system::

    {"environment": device, driver, versions of torch/triton/transformers/peft/liger/unsloth (None
                    when absent), git commit, matmul probe TFLOP/s, datasheet TFLOP/s,
     "scenario": the composed config, "workload": the workload every system trained,
     "results": [one record per system: status, real tokens/s (median, min, max, per step), peak
                 allocated/reserved, MFU (measured and datasheet), first/last loss, LoRA gradient
                 norms (A and B), the system's wall time (process start to last step)]}

Compile caches: every process reads and writes Triton's and Inductor's caches under the user's
cache (:func:`~lightning_sloth.plugins.compile_cache.configure_compile_caches`), as the app does:
a system's figures are those of a machine that has run it before. ``cold_start=true`` measures
each system twice instead, in two fresh processes sharing a new, empty cache directory: first
``cold`` (every kernel compiled in that process, as on a fresh machine; with
``drop_page_cache=true`` and the rights to do it, the OS page cache is dropped first), then warm.
The record is the warm run's, with the cold run's figures beside it (``cold``,
``cold_tokens_per_s_median``, ``cold_vs_warm``). Every record counts the compilations of each
step (``compiles_per_step``, ``kernels_compiled_in_timed_steps``). ``process_env`` sets
variables in every system's process (``+process_env.CUDA_MODULE_LOADING=EAGER``: every CUDA
kernel of the libraries loaded when the context starts, none on first use in a step).

The guard: a system whose loss is not finite, or whose trainable gradients are all zero or not
finite, gets ``status: "failed"`` and a reason; the report never shows it as fast.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_sloth.bench.measure import environment, guard, run_loop_system, synchronize
from lightning_sloth.bench.systems import resolve
from lightning_sloth.bench.workload import bench_device, register_scenario, vocab_size
from lightning_sloth.plugins.compile_cache import CACHE_VARIABLES, configure_compile_caches

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


def measure(name: str, scenario: dict, profile_to: str | None = None) -> dict:
    """One system of one scenario, in this process: its record, guarded; errors become records.
    ``profile_to``: a loop system's profiled step is written there (``run_loop_system``)."""
    workload = register_scenario(scenario)
    system = resolve(name)
    record: dict[str, Any] = {"system": name, "label": system.label}
    try:
        samples = workload.samples(vocab_size(workload))
        if system.trainer is not None:
            record |= system.trainer(workload, samples)
        else:
            record |= run_loop_system(system, workload, samples, profile_to)
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
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
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
    device = bench_device()
    env = package_versions() | environment()  # the running versions (torch's +cu suffix) win
    if device.type == "cpu":
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


def worker_main(task_path: str, out_path: str) -> None:
    """Entry of a system's (or the probe's) fresh process: read the task, write the record."""
    task = json.loads(Path(task_path).read_text())
    if task["kind"] == "probe":
        out = probe_environment(task["probe_size"], task["probe_iters"])
    else:
        out = measure(task["system"], task["scenario"], task.get("profile_to"))
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
        "from lightning_sloth.bench.suite import worker_main",
        f"worker_main({task_path!r}, {out_path!r})",
    ]
    return "\n".join(lines) + "\n"


def _in_fresh_process(task: dict, preamble: str, timeout_s: float, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        task_path, out_path = Path(tmp) / "task.json", Path(tmp) / "out.json"
        task_path.write_text(json.dumps(task))
        code = _worker_code(preamble, str(task_path), str(out_path))
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code], timeout=timeout_s, env={**os.environ, **(env or {})}
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "reason": f"timed out after {timeout_s:.0f} s"}
        if not out_path.exists():
            return {"status": "error", "reason": f"process exited with code {proc.returncode}"}
        return json.loads(out_path.read_text())


#: The figures of a cold run kept beside the warm one.
COLD_FIELDS = (
    "status",
    "reason",
    "tokens_per_s",
    "tokens_per_s_median",
    "tokens_per_s_steps",
    "median_step_s",
    "setup_s",
    "wall_s",
    "compiles_per_step",
    "triton_compile_s_per_step",
    "dynamo_graphs_per_step",
    "compiles_in_timed_steps",
    "compile_s_in_timed_steps",
    "kernels_compiled_in_timed_steps",
    "page_cache_dropped",
)


def drop_page_cache() -> bool:
    """Empty the OS page cache (what a fresh machine has not read yet: the CUDA and torch
    libraries, the model files); whether it worked (it needs root and a writable /proc/sys)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def cold_and_warm(
    task: dict, preamble: str, timeout_s: float, drop_cache: bool = False, env: dict | None = None
) -> dict:
    """One system in two fresh processes sharing a new compile cache: cold (the cache empty), then
    warm. The warm record, with the cold one's figures under ``cold`` and the ratio of their
    median real tokens/s in ``cold_vs_warm``. ``env``: more variables for both processes."""
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as root:
        caches = {variable: Path(root) / sub for variable, sub in CACHE_VARIABLES.items()}
        for path in caches.values():
            path.mkdir()
        env = dict(env or {}) | {variable: str(path) for variable, path in caches.items()}
        dropped = drop_page_cache() if drop_cache else False
        begin = time.perf_counter()
        cold = _in_fresh_process(task, preamble, timeout_s, env) | {"page_cache_dropped": dropped}
        cold["wall_s"] = time.perf_counter() - begin
        warm = _in_fresh_process(task, preamble, timeout_s, env)
    warm["cold"] = {k: cold[k] for k in COLD_FIELDS if k in cold}
    rate, cold_rate = warm.get("tokens_per_s_median"), cold.get("tokens_per_s_median")
    warm["cold_tokens_per_s_median"] = cold_rate
    warm["cold_vs_warm"] = cold_rate / rate if rate and cold_rate else None
    return warm


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
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    scenario, names = cfg["scenario"], list(cfg["systems"]["names"])
    profiled = list(cfg.get("profile") or [])
    for name in names + profiled:
        resolve(name)  # unknown names fail before anything runs
    if set(profiled) - set(names):
        raise ValueError(f"profile={profiled} names systems the run does not measure: {names}")
    cold_start = bool(cfg.get("cold_start"))
    if cold_start and not cfg["isolate"]:
        raise ValueError("cold_start=true measures each system in fresh processes: it needs isolate=true")
    configure_compile_caches()  # every process shares the user's compile caches
    process_env = {str(k): str(v) for k, v in (cfg.get("process_env") or {}).items()}
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
        if name in profiled:
            task["profile_to"] = str(out.with_name(f"profile_{scenario['name']}_{tag}_{name}.txt"))
        begin = time.perf_counter()
        if cold_start:
            preamble = resolve(name).preamble
            measured = cold_and_warm(task, preamble, timeout, bool(cfg.get("drop_page_cache")), process_env)
            record = {"system": name, "label": resolve(name).label} | measured
        elif cfg["isolate"]:
            preamble = resolve(name).preamble
            record = {"system": name, "label": resolve(name).label} | _in_fresh_process(
                task, preamble, timeout, process_env
            )
        else:
            record = measure(name, scenario, task.get("profile_to"))
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
        + (
            f", cold {r['cold_tokens_per_s_median']:.0f} tok/s ({r['cold_vs_warm']:.1%} of warm)"
            if r.get("cold_vs_warm")
            else ""
        )
        + (
            f", {r['compiles_in_timed_steps']} compiles in timed steps"
            if r.get("compiles_in_timed_steps")
            else ""
        )
        + (f", GPU busy {r['gpu_busy_share']:.0%}" if "gpu_busy_share" in r else "")
        + (
            f" ({r['gpu_busy_share_unprofiled']:.0%} of the unprofiled step)"
            if "gpu_busy_share_unprofiled" in r
            else ""
        )
    )


def app(argv: list[str]) -> dict | None:
    """The Hydra app over ``conf/bench`` (``python -m lightning_sloth.bench [overrides]``)."""
    result: dict = {}

    @hydra.main(version_base="1.3", config_path="pkg://lightning_sloth.conf.bench", config_name="config")
    def _main(cfg) -> None:
        result["report"] = run_suite(cfg)

    sys.argv = [sys.argv[0], *argv]
    _main()
    return result.get("report")
