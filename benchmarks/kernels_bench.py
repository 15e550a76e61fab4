"""Kernel micro-benchmarks: forward+backward time, bandwidth and peak memory of each ``sloth::`` op.

Every op runs at Llama-3.2-1B shapes in bf16 (16384 tokens, hidden 2048, 32/8 heads of 64,
intermediate 8192, LoRA r=16 on a 2048 -> 8192 projection, vocab 128256 and 151936), as:

    ours     the lightning_sloth op (Triton kernels on CUDA)
    eager    the plain-PyTorch expression transformers and PEFT run: LlamaRMSNorm's math,
             apply_rotary_pos_emb, act(gate) * up, lm_head + float32 F.cross_entropy,
             base(x) + lora_B(lora_A(x)) * scale
    compile  torch.compile of the eager expression (static shapes)
    liger    Liger-Kernel's equivalent, where ``liger_kernel`` imports (it has no LoRA op)

One timed call is a forward and a backward with random upstream gradients, on fresh random inputs
(seeded: every implementation of one op and shape sees the same values). The median comes from
``triton.testing.do_bench``, which flushes the L2 cache before each call; warm-up and compilation
are excluded. Memory-bound ops also report the achieved bandwidth over their minimal traffic (each
input read once and each output written once, forward and backward) and its fraction of a measured
device-to-device copy (read + write), computed from the GPU time of one call (``device_ms``: calls
captured in a CUDA graph, so the host's Python/autograd dispatch between kernels is not counted;
for the small ops that dispatch, not the kernels, sets the wall-clock ``ms``). Peak memory is ``torch.cuda.max_memory_allocated`` during one
call, over what the inputs already hold; an out-of-memory is recorded, not raised::

    python benchmarks/kernels_bench.py --out kernels.json
    python benchmarks/kernels_bench.py --out lce.json --ops linear_cross_entropy --impls ours,eager
    python benchmarks/kernels_bench.py --out tiny.json --device cpu --tiny --compile-backend eager

``--device cpu --tiny`` walks the same code paths at toy shapes on the CPU (the ops then run their
plain-torch references); its timings mean nothing. The exit status is 1 when a measurement of
``ours`` failed.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import inspect
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_sloth.bench.measure import environment
from lightning_sloth.ops.glu import geglu, swiglu
from lightning_sloth.ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy
from lightning_sloth.ops.lora import lora_linear
from lightning_sloth.ops.rms_norm import rms_norm
from lightning_sloth.ops.rope import apply_rope

OPS = ("rms_norm", "rope", "swiglu", "geglu", "lora_linear", "linear_cross_entropy")
IMPLS = ("ours", "eager", "compile", "liger")
DTYPE = torch.bfloat16
EPS = 1e-5
ROPE_THETA = 500000.0
LORA_SCALE = 2.0  # lora_alpha 32 / r 16
IGNORED_TARGETS = 0.05  # fraction of -100 targets, as prompt tokens and document starts give
CPU_REPS = 3
MIB = 2**20


@dataclass(frozen=True)
class Dims:
    """Problem sizes; the defaults are Llama-3.2-1B's with 16384 tokens per step."""

    tokens: int = 16384
    hidden: int = 2048
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 8192
    lora_rank: int = 16
    vocab_sizes: tuple[int, ...] = (128256, 151936)
    copy_bytes: int = 2 * 2**30


TINY = Dims(
    tokens=96,
    hidden=64,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=160,
    lora_rank=4,
    vocab_sizes=(500, 700),
    copy_bytes=8 * MIB,
)


@dataclass
class Inputs:
    """One benchmark's tensors.

    Attributes:
        args: Positional arguments of the implementation.
        grads: Upstream gradient of each output (random, never zeros).
        leaves: Tensors whose ``.grad`` the backward fills; reset to None before every call.
    """

    args: tuple
    grads: tuple[torch.Tensor, ...]
    leaves: list[torch.Tensor]


@dataclass
class Case:
    """One op at one shape: how to make its inputs and what to credit it with.

    Attributes:
        op: A name from :data:`OPS`.
        shape: Human-readable shape label.
        make_inputs: Builds fresh inputs from a seeded generator on the target device.
        min_bytes: Minimal forward+backward memory traffic (memory-bound ops only).
        flops: Forward+backward FLOPs (matmul ops only).
    """

    op: str
    shape: str
    make_inputs: Callable[[torch.Generator], Inputs]
    min_bytes: int | None = None
    flops: int | None = None


# Eager references: the expressions the Hugging Face and PEFT modules evaluate.


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward: normalise in float32, round to x's dtype, then scale by the weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_eager(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb on ``[B, T, heads, D]`` projections viewed as ``[B, heads, T, D]``."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def lora_linear_eager(x, weight, lora_a, lora_b) -> torch.Tensor:
    """PEFT's LoRA Linear without dropout: ``base(x) + lora_B(lora_A(x)) * scaling``."""
    return F.linear(x, weight) + F.linear(F.linear(x, lora_a), lora_b) * LORA_SCALE


def linear_cross_entropy_eager(hidden, weight, targets) -> torch.Tensor:
    """lm_head, then transformers' loss: float32 logits into F.cross_entropy."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX)


def _rope_ours(q, k, cos, sin):
    return apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


EAGER: dict[str, Callable] = {
    "rms_norm": rms_norm_eager,
    "rope": rope_eager,
    "swiglu": swiglu_eager,
    "geglu": geglu_eager,
    "lora_linear": lora_linear_eager,
    "linear_cross_entropy": linear_cross_entropy_eager,
}

OURS: dict[str, Callable] = {
    "rms_norm": lambda x, weight: rms_norm(x, weight, EPS),
    "rope": _rope_ours,
    "swiglu": swiglu,
    "geglu": geglu,
    "lora_linear": lambda x, weight, a, b: lora_linear(x, weight, a, b, LORA_SCALE),
    "linear_cross_entropy": lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets),
}


def _liger_rms_norm(lf) -> Callable:
    norm = lf.liger_rms_norm
    # Liger overwrites the upstream gradient in place by default; ours allocates, so compare like that.
    kwargs = {"in_place": False} if "in_place" in inspect.signature(norm).parameters else {}
    return lambda x, weight: norm(x, weight, EPS, **kwargs)


def _liger_rope(lf) -> Callable:
    rope = lf.liger_rope
    return lambda q, k, cos, sin: rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _liger_linear_cross_entropy(lf) -> Callable:
    fused = lf.liger_fused_linear_cross_entropy

    def loss(hidden, weight, targets):
        out = fused(hidden, weight, targets, ignore_index=IGNORE_INDEX)
        return out[0] if isinstance(out, tuple | list) else out

    return loss


LIGER: dict[str, Callable[[object], Callable]] = {
    "rms_norm": _liger_rms_norm,
    "rope": _liger_rope,
    "swiglu": lambda lf: lf.liger_swiglu,
    "geglu": lambda lf: lf.liger_geglu,
    "linear_cross_entropy": _liger_linear_cross_entropy,
}
"""Liger-Kernel equivalents, built from ``liger_kernel.transformers.functional``."""


# Inputs at each shape.


def _randn(gen: torch.Generator, shape, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=gen.device, dtype=DTYPE)
    return t.mul_(scale).requires_grad_(requires_grad)


def _rotary_tables(seq_len: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, T, D]`` cos/sin as Llama's rotary embedding returns them for positions 0..T-1."""
    inv_freq = ROPE_THETA ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((angles, angles), dim=-1)[None]
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def build_cases(op: str, d: Dims, lce_weight_grad: bool) -> list[Case]:
    """The shapes one op is measured at."""
    n, h, e = d.tokens, d.hidden, DTYPE.itemsize
    if op == "rms_norm":

        def make(gen):
            x = _randn(gen, (1, n, h), requires_grad=True)
            weight = (1 + _randn(gen, (h,), 0.1)).requires_grad_()
            return Inputs((x, weight), (_randn(gen, (1, n, h)),), [x, weight])

        # Forward reads x, w and writes y; backward reads dy, x, w and writes dx, dw.
        return [Case(op, f"x[1,{n},{h}]", make, min_bytes=(5 * n * h + 3 * h) * e)]

    if op == "rope":
        hq, hkv, hd = d.q_heads, d.kv_heads, d.head_dim

        def make(gen):
            # Projections are [B, T, heads, D]; the attention module rotates their transposed views.
            q = _randn(gen, (1, n, hq, hd), requires_grad=True)
            k = _randn(gen, (1, n, hkv, hd), requires_grad=True)
            cos, sin = _rotary_tables(n, hd, gen.device)
            grads = (
                _randn(gen, (1, n, hq, hd)).transpose(1, 2),
                _randn(gen, (1, n, hkv, hd)).transpose(1, 2),
            )
            return Inputs((q, k, cos, sin), grads, [q, k])

        # q and k are read and written once each way; cos and sin are read once each way.
        min_bytes = (4 * n * (hq + hkv) * hd + 4 * n * hd) * e
        return [Case(op, f"q[1,{hq},{n},{hd}] k[1,{hkv},{n},{hd}]", make, min_bytes=min_bytes)]

    if op in ("swiglu", "geglu"):
        inter = d.intermediate

        def make(gen):
            gate = _randn(gen, (1, n, inter), requires_grad=True)
            up = _randn(gen, (1, n, inter), requires_grad=True)
            return Inputs((gate, up), (_randn(gen, (1, n, inter)),), [gate, up])

        # Forward reads gate, up and writes out; backward reads dout, gate, up and writes dgate, dup.
        return [Case(op, f"[1,{n},{inter}]", make, min_bytes=8 * n * inter * e)]

    if op == "lora_linear":
        out_f, r = d.intermediate, d.lora_rank

        def make(gen):
            x = _randn(gen, (1, n, h), requires_grad=True)
            weight = _randn(gen, (out_f, h), h**-0.5)  # frozen base weight
            lora_a = _randn(gen, (r, h), h**-0.5, requires_grad=True)
            lora_b = _randn(gen, (out_f, r), r**-0.5, requires_grad=True)
            return Inputs((x, weight, lora_a, lora_b), (_randn(gen, (1, n, out_f)),), [x, lora_a, lora_b])

        # Forward x W^T, x A^T, (xA) B^T; backward dy W, dy B, g A, g^T x, dy^T (xA).
        flops = 2 * n * (2 * h * out_f + 3 * h * r + 3 * r * out_f)
        return [Case(op, f"x[1,{n},{h}] W[{out_f},{h}] r={r}", make, flops=flops)]

    if op == "linear_cross_entropy":
        cases = []
        for vocab in d.vocab_sizes:

            def make(gen, vocab=vocab):
                hidden = _randn(gen, (n, h), requires_grad=True)
                weight = _randn(gen, (vocab, h), h**-0.5, requires_grad=lce_weight_grad)
                targets = torch.randint(0, vocab, (n,), generator=gen, device=gen.device)
                ignored = torch.rand(n, generator=gen, device=gen.device) < IGNORED_TARGETS
                targets = targets.masked_fill_(ignored, IGNORE_INDEX)
                grad = 0.5 + torch.rand((), generator=gen, device=gen.device)
                leaves = [hidden, weight] if lce_weight_grad else [hidden]
                return Inputs((hidden, weight, targets), (grad,), leaves)

            # Logits, then d hidden (and d weight): one N x H x V product each.
            flops = 2 * n * h * vocab * (2 + int(lce_weight_grad))
            label = f"N={n} H={h} V={vocab}" + (" +dW" if lce_weight_grad else "")
            cases.append(Case(op, label, make, flops=flops))
        return cases

    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


# Timing and memory.


@dataclass(frozen=True)
class Settings:
    """How each measurement runs."""

    device: str
    seed: int
    warmup_ms: float
    rep_ms: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clear_grads(leaves: list[torch.Tensor]) -> None:
    for t in leaves:
        t.grad = None


def _make_step(fn: Callable, inputs: Inputs) -> Callable[[], tuple[torch.Tensor, ...]]:
    def step():
        out = fn(*inputs.args)
        outs = out if isinstance(out, tuple) else (out,)
        # A loss may come back in another float dtype than ours (e.g. Liger's); autograd wants a match.
        grads = tuple(g if g.dtype == o.dtype else g.to(o.dtype) for g, o in zip(inputs.grads, outs))
        torch.autograd.backward(outs, grads)
        return outs

    return step


def time_ms(step: Callable, leaves: list[torch.Tensor], once_ms: float, settings: Settings) -> float:
    """Median milliseconds of ``step``; at least ~10 timed calls however slow one call is."""
    device = torch.device(settings.device)
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(
            step,
            warmup=max(settings.warmup_ms, 3 * once_ms),
            rep=max(settings.rep_ms, 10 * once_ms),
            grad_to_none=leaves,
            return_mode="median",
        )
    times = []
    for _ in range(CPU_REPS):
        _clear_grads(leaves)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def device_time_ms(step: Callable, leaves: list[torch.Tensor], settings: Settings, reps: int = 10) -> float:
    """Milliseconds the GPU spends on one ``step``, without the host's dispatch time in between.

    ``reps`` calls, each after an L2 flush, are captured in one CUDA graph and replayed; the same
    graph without the calls (flushes only) is subtracted. A small op's wall time under
    :func:`time_ms` is mostly Python and autograd dispatch (the GPU waits for the host), which says
    nothing about the kernel; this is the number its bandwidth is computed from.
    """
    device = torch.device(settings.device)
    flush = torch.empty(256 * MIB, dtype=torch.int8, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
        for _ in range(3):
            _clear_grads(leaves)
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    _sync(device)

    def capture(with_step: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.zero_()
                if with_step:
                    _clear_grads(leaves)
                    step()
        return graph

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()  # warm
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    full, flushes = capture(True), capture(False)
    elapsed = (replay_ms(full) - replay_ms(flushes)) / reps
    del full, flushes
    _clear_grads(leaves)
    return elapsed


def copy_bandwidth_gbps(nbytes: int, settings: Settings) -> float:
    """Device-to-device copy bandwidth of ``nbytes``, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=settings.device)
    dst = torch.empty_like(src)

    def step():
        dst.copy_(src)

    step()
    _sync(src.device)
    start = time.perf_counter()
    step()
    _sync(src.device)
    ms = time_ms(step, [], (time.perf_counter() - start) * 1e3, settings)
    return 2 * nbytes / ms / 1e6


def _measure(case: Case, fn: Callable, settings: Settings, copy_gbps: float) -> dict:
    device = torch.device(settings.device)
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    inputs = case.make_inputs(gen)
    step = _make_step(fn, inputs)
    step()  # warm-up: Triton JIT, torch.compile, cuBLAS heuristics
    _clear_grads(inputs.leaves)
    _sync(device)

    cuda = device.type == "cuda"
    if cuda:
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    outs = step()
    _sync(device)
    once_ms = (time.perf_counter() - start) * 1e3
    peak_mib = (torch.cuda.max_memory_allocated(device) - baseline) / MIB if cuda else None
    check = sum(float(o.detach().abs().mean(dtype=torch.float32)) for o in outs) / len(outs)
    del outs

    ms = time_ms(step, inputs.leaves, once_ms, settings)
    # Bandwidth and FLOP rate come from the GPU's own time where it can be measured apart from the
    # host's (CUDA graphs); the wall-clock median is kept beside it.
    device_ms, device_error = None, None
    if cuda:
        try:
            device_ms = device_time_ms(step, inputs.leaves, settings)
        except Exception as err:  # e.g. an implementation that cannot be captured in a graph
            device_error = f"{type(err).__name__}: {str(err).strip()[:200]}"
            torch.cuda.synchronize(device)
    rate_ms = device_ms if device_ms is not None else ms
    gbps = case.min_bytes / rate_ms / 1e6 if case.min_bytes else None
    return {
        "median_ms": ms,
        "device_ms": device_ms,
        "device_time_error": device_error,
        "gbps": gbps,
        "copy_fraction": gbps / copy_gbps if gbps is not None else None,
        "tflops": case.flops / rate_ms / 1e9 if case.flops else None,
        "peak_mib": peak_mib,
        "output_check": check,
    }


def measure(case: Case, impl: str, fn: Callable, settings: Settings, copy_gbps: float) -> dict:
    """One record: time, bandwidth, FLOP rate and peak memory of ``fn`` on ``case``; failures recorded."""
    record = {"op": case.op, "impl": impl, "shape": case.shape, "dtype": str(DTYPE).removeprefix("torch.")}
    try:
        record |= _measure(case, fn, settings, copy_gbps)
        record["status"] = "ok"
    except Exception as err:  # one failed measurement must not lose the others
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        record["status"] = "oom" if oom else "error"
        record["error"] = f"{type(err).__name__}: {message}"[:500]
        if not oom:
            traceback.print_exc()
    finally:
        gc.collect()
        if torch.device(settings.device).type == "cuda":
            torch.cuda.empty_cache()
    return record


def _load_liger(device: torch.device):
    """Liger's functional module and version, or None and why not."""
    if device.type != "cuda":
        return None, "skipped: needs CUDA"
    try:
        module = importlib.import_module("liger_kernel.transformers.functional")
    except Exception as err:  # not installed, or an install that fails at import
        return None, f"skipped: {type(err).__name__}: {err}"
    try:
        return module, importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return module, "unknown"


def _add_speedups(records: list[dict]) -> None:
    eager = {
        (r["op"], r["shape"]): r["median_ms"] for r in records if r["impl"] == "eager" and r["status"] == "ok"
    }
    for r in records:
        base = eager.get((r["op"], r["shape"]))
        if r["status"] == "ok" and base is not None:
            r["speedup_vs_eager"] = base / r["median_ms"]


def _cell(value: float | None, width: int, spec: str) -> str:
    return "-".rjust(width) if value is None else format(value, f"{width}{spec}")


def format_table(records: list[dict]) -> str:
    """A compact fixed-width table of the records."""
    header = (
        f"{'op':<21} {'shape':<34} {'impl':<8} {'ms':>9} {'GPU ms':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'TFLOP/s':>8} {'peak MiB':>9} {'x eager':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in records:
        label = f"{r['op']:<21} {r['shape']:<34} {r['impl']:<8}"
        if r["status"] != "ok":
            lines.append(f"{label} {r['status'].upper()}: {r['error'][:80]}")
            continue
        fraction = r["copy_fraction"]
        lines.append(
            f"{label} {r['median_ms']:>9.3f} {_cell(r.get('device_ms'), 9, '.3f')} {_cell(r['gbps'], 7, '.0f')} "
            f"{_cell(None if fraction is None else 100 * fraction, 6, '.1f')} "
            f"{_cell(r['tflops'], 8, '.1f')} {_cell(r['peak_mib'], 9, '.0f')} "
            f"{_cell(r.get('speedup_vs_eager'), 7, '.2f')}"
        )
    return "\n".join(lines)


def _names(value: str, allowed: tuple[str, ...], what: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in allowed]
    if unknown or not names:
        parser.error(
            f"unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(allowed)}"
        )
    return names


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmarks chosen on the command line; returns (and writes) the JSON payload."""
    parser = argparse.ArgumentParser(description="lightning_sloth kernel micro-benchmarks")
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {', '.join(IMPLS)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="toy shapes, to check the code paths")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of 'compile'")
    parser.add_argument("--lce-weight-grad", action="store_true", help="lm-head weight trainable (full FT)")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    ops = _names(args.ops, OPS, "op", parser)
    impls = _names(args.impls, IMPLS, "implementation", parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu --tiny to check the code paths")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu needs --tiny: the full shapes would take hours on a CPU")

    dims = TINY if args.tiny else Dims()
    device = torch.device(args.device)
    settings = Settings(args.device, args.seed, args.warmup_ms, args.rep_ms)
    liger, liger_version = _load_liger(device) if "liger" in impls else (None, "not requested")
    payload = {
        "environment": environment() | {"liger_kernel": liger_version},
        "config": {
            "dims": asdict(dims),
            "dtype": str(DTYPE).removeprefix("torch."),
            "device": args.device,
            "tiny": args.tiny,
            "ops": ops,
            "impls": impls,
            "compile_backend": args.compile_backend,
            "lce_weight_grad": args.lce_weight_grad,
            "rms_norm_eps": EPS,
            "lora_scale": LORA_SCALE,
            "timing": "ms: triton.testing.do_bench median, L2 flushed (wall clock, host dispatch included); "
            "device_ms: GPU time per call from a CUDA graph of 10 L2-flushed calls minus the flushes alone; "
            "GB/s, %copy and TFLOP/s use device_ms"
            if device.type == "cuda"
            else "perf_counter",
        },
        "copy_bandwidth_gbps": None,
        "records": [],
    }
    if liger is None and "liger" in impls:
        print(f"liger: {liger_version}", flush=True)

    payload["copy_bandwidth_gbps"] = copy_gbps = copy_bandwidth_gbps(dims.copy_bytes, settings)
    print(
        f"device copy bandwidth: {copy_gbps:.0f} GB/s ({dims.copy_bytes / 2**30:.2f} GiB buffer)", flush=True
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for op in ops:
        fns = {"ours": OURS[op], "eager": EAGER[op]}
        if "compile" in impls:
            fns["compile"] = torch.compile(EAGER[op], dynamic=False, backend=args.compile_backend)
        if liger is not None and op in LIGER:
            try:
                fns["liger"] = LIGER[op](liger)
            except AttributeError as err:  # an older Liger without this function
                print(f"liger {op}: skipped ({err})", flush=True)
        for case in build_cases(op, dims, args.lce_weight_grad):
            for impl in (i for i in impls if i in fns):
                record = measure(case, impl, fns[impl], settings, copy_gbps)
                payload["records"].append(record)
                result = f"{record['median_ms']:.3f} ms" if record["status"] == "ok" else record["error"]
                print(f"{op:<21} {case.shape:<34} {impl:<8} {result}", flush=True)
                args.out.write_text(json.dumps(payload, indent=2))  # kept if the run is cut short
    _add_speedups(payload["records"])
    args.out.write_text(json.dumps(payload, indent=2))
    print(format_table(payload["records"]), flush=True)
    return payload


def failed_ours(payload: dict) -> list[dict]:
    """Records of our ops that did not complete."""
    return [r for r in payload["records"] if r["impl"] == "ours" and r["status"] != "ok"]


if __name__ == "__main__":
    sys.exit(1 if failed_ours(main()) else 0)
