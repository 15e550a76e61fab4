"""One MoE layer, forward + backward: lightning_sloth's experts vs transformers' ``eager`` and ``grouped_mm``.

Shapes (bf16, one layer, random weights):

- ``qwen3_30b_a3b``: hidden 2048, 128 experts, top-8, expert intermediate 768 (``Qwen3MoeSparseMoeBlock``);
- ``gpt_oss_20b``: hidden 2880, 32 experts, top-4, expert intermediate 2880 (``GptOssMLP``).

Modes: ``frozen`` (expert and router weights frozen, the input's gradient taken) and ``lora``
(PEFT ``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``, r=16, alpha=32; for
transformers' implementations PEFT's own forward, for ``sloth`` the factors inside the grouped GEMMs).
Each system: median of CUDA-event timings over the timed steps (warm-up excluded), the peak memory
allocated above what was allocated before the step (weights, input and adapters), and the output's
relative difference to ``grouped_mm``'s on the same weights and input. ``sloth_nf4`` is ``sloth``
with the expert weights then stored in NF4 (``lightning_sloth.moe.quant``; LoRA made before, as in
training); its difference to ``grouped_mm`` is the quantisation error, and its base allocation holds
the 4-bit experts::

    python benchmarks/moe_bench.py --out moe_layer.json [--tokens 16384] [--skip-eager]
    python benchmarks/moe_bench.py --out moe_nf4.json --shapes qwen3_30b_a3b --systems grouped_mm,sloth,sloth_nf4

``sloth_fp8`` is ``sloth`` with the expert weights stored in FP8 e4m3 (``lightning_sloth.moe.fp8``:
``torch._scaled_grouped_mm`` with row-wise scales, the separate gather and combine); its difference to
``grouped_mm`` includes the activations' e4m3 rounding::

    python benchmarks/moe_bench.py --modes lora --systems grouped_mm,sloth,sloth_fused,sloth_fp8

``sloth_fused`` (and ``sloth_fused_nf4``) is ``sloth`` with the fused permutation
(``lightning_sloth.moe.fused``): the first grouped GEMM reads the token rows through the sort
permutation and the second writes through it into the combine, so neither the gathered copy nor the
combine's gather is made. The fused-permutation comparison, LoRA on the experts at 16k tokens, both
shapes, JSON under ``$OUT`` when set (else ``benchmarks/results/``) and a short table printed::

    python benchmarks/moe_bench.py --fused

``--fused-tiles BM,BN,BK,WARPS,STAGES`` overrides the fused grouped GEMMs' tile sizes on 16-bit
operands, ``--wgrad-tiles BA,BB,BR,WARPS,STAGES`` the fused weight gradient's. Either takes several
configurations separated by ``;``: then the first of each runs the systems as above, and every other
one re-times ``sloth_fused`` on the same block, input and gradient (one knob moved at a time), with its
output's difference to ``grouped_mm``; the report's ``sweep`` lists them and ``sweep_best`` names the
fastest (to pick the tiles for a new GPU)::

    python benchmarks/moe_bench.py --fused --timed 10 --fused-tiles "128,128,64,8,3;128,256,64,8,3;64,128,64,4,4" --wgrad-tiles "128,128,64,8,3;128,64,128,4,3"

``--down-rank-max R;R2`` is a third knob of the same kind: the largest LoRA rank whose down product
runs inside the main grouped GEMM (``lightning_sloth.moe.indexed.DOWN_IN_KERNEL_MAX_RANK``; 0: the
separate rank-r passes), e.g. ``--down-rank-max "32;0"`` times the one-pass LoRA against the
separate passes in one process::

    python benchmarks/moe_bench.py --fused --timed 10 --down-rank-max "32;0"

``--grouped-mm "none;ordered;gathered;both"`` is a fourth: which of the fused path's GEMMs run
``torch._grouped_mm`` (``lightning_sloth.moe.indexed``): ``ordered``, the two whose rows are already in
expert order (the second's forward, the first's input gradient), each token's k rows then summed
through the inverse permutation (``ORDERED_ROWS_GROUPED_MM``); ``gathered``, the two that read rows
through the permutation, from a gathered copy (``GATHERED_ROWS_GROUPED_MM``); ``both``.

``--weight-loads "pointer;tma;tma_ws;tma_rows"`` is a fifth: how the fused GEMMs load their weight
tiles (``lightning_sloth.kernels.moe_fused.WEIGHT_LOADS``): masked pointer loads, a TMA descriptor, a
descriptor in a warp-specialised K loop, or descriptors for the weights and for the rows of the GEMMs
whose rows are already in expert order.

``--lora-grad-pair "1;0"`` is a sixth: whether the first fused op's backward makes the LoRA up
factor's two rank-r products from its output's gradient in one pass
(``lightning_sloth.moe.indexed.LORA_GRAD_PAIR``) or in two GEMMs; it runs where the rank-r side is
made outside the GEMM (outputs wider than ``DOWN_IN_KERNEL_MAX_OUT``, as GPT-OSS-20B's).

The router: every system runs transformers' own (bf16 logits), so the systems differ in their experts
only. ``--router sloth`` gives lightning_sloth's systems the router ``apply_experts`` installs on a
model instead (``lightning_sloth.patching.install_router``: float32 logits; the GEMM, the top k and
the weights in one ``sloth::moe_router_topk`` kernel); its float32 logits choose other experts than
the bf16 ones where two nearly tie, so its output differs more from ``grouped_mm``'s::

    python benchmarks/moe_bench.py --fused --router sloth

``--graphs`` also captures each system's step (forward and backward) as one CUDA graph and times its
replays, synchronised and back to back: the device's time for the step without the host's launch gaps.
The replay's output and input gradient are checked against an eager step on the same input
(``graph_vs_eager_rel_diff``); a system whose step cannot be captured reports why. Where NVML can be
read (``nvidia-ml-py``), each graph's ``power`` gives the energy per replay and the mean power over
at least ``ENERGY_WINDOW_S`` of replays back to back (NVML's energy counter advances in coarse steps,
so a window of a few short replays misplaces whole steps of it), and the SM clock and power-cap
state sampled after each synchronised replay (a block that reaches the card's power cap slows as its
clock falls). With a sweep's
knobs, every configuration is also timed as a graph in each round (``graphed`` in its entry)::

    python benchmarks/moe_bench.py --fused --graphs

The block's time moves by about 5% between runs on one device; ``--rounds N`` times the sweep's
configurations N times each, interleaved (every configuration once per round), and pools their steps
(``round_medians_ms`` lists each round's median)::

    python benchmarks/moe_bench.py --fused --systems sloth_fused --rounds 3 --fused-tiles "default;128,256,32,8,5"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import torch

SHAPES = {
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "gpt_oss_20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        intermediate_size=2880,
    ),
}
SYSTEMS = ("eager", "grouped_mm", "sloth", "sloth_fused", "sloth_nf4", "sloth_fused_nf4", "sloth_fp8")
"""Run in this order: the NF4 and FP8 systems quantise the experts in place, so they come last (and a
run takes one of the two formats)."""
FUSED_SYSTEMS = "grouped_mm,sloth,sloth_fused"


def _block(
    shape: str, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    torch.manual_seed(seed)
    if model_type == "qwen3_moe":
        config = Qwen3MoeConfig(num_attention_heads=16, num_key_value_heads=4, norm_topk_prob=True, **spec)
        block = Qwen3MoeSparseMoeBlock(config)
    else:
        config = GptOssConfig(num_attention_heads=64, num_key_value_heads=8, **spec)
        block = GptOssMLP(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    return block.to(device, dtype)


def _with_lora(block: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    block = inject_adapter_in_model(config, block)
    with torch.no_grad():  # B is zero-initialised: give it values so the adapter contributes
        for name, param in block.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    return block


ROUTERS = ("transformers", "sloth")
ROUTER = "transformers"
"""Which router lightning_sloth's systems run (``--router``): transformers' own, or the plugin's
(``install_router``); transformers' systems always run their own."""


def _set_router(name: str) -> None:
    global ROUTER
    ROUTER = name


def _select(block: torch.nn.Module, system: str) -> None:
    from lightning_sloth.moe import install_lora_experts, register, uninstall_lora_experts
    from lightning_sloth.moe.fp8 import quantize_experts_fp8
    from lightning_sloth.moe.fused import set_fused_permutation
    from lightning_sloth.moe.quant import quantize_experts
    from lightning_sloth.patching import install_router, uninstall_router

    register()
    experts = next(m for m in block.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts"))
    router = getattr(block, "router", None) or block.gate
    uninstall_router(router)
    if system.startswith("sloth") and ROUTER == "sloth":
        install_router(router, experts.config.model_type, experts.config)
    set_fused_permutation(system.startswith("sloth_fused"))
    if system.endswith("_nf4"):  # in place (idempotent): these systems run last
        quantize_experts(experts, "nf4")
    if system.endswith("_fp8"):
        quantize_experts_fp8(experts)
    if system.startswith("sloth"):
        system = "sloth"
    experts.config._experts_implementation = system
    uninstall_lora_experts(block)
    if system == "sloth":
        install_lora_experts(block)


def _step(block, x, grad):
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out


def _clear_grads(block, x) -> None:
    x.grad = None
    for param in block.parameters():
        param.grad = None


def measure(block, x, grad, warmup: int, timed: int, pipelined: bool = True) -> dict:
    """Synchronised steps' times; with ``pipelined``, also the same steps enqueued back to back."""
    for _ in range(warmup):
        _step(block, x, grad)
    _clear_grads(block, x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(block, x, grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        _clear_grads(block, x)
    result = {}
    if pipelined:
        # The same steps enqueued back to back, one synchronisation at the end: the host runs ahead as
        # it does from layer to layer in a training step, so its own time per step shows only where
        # it is longer than the GPU's.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(timed):
            _step(block, x, grad)
            _clear_grads(block, x)
        end.record()
        torch.cuda.synchronize()
        result["pipelined_ms"] = start.elapsed_time(end) / timed
    return result | {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "times_ms": times,
        "timed_steps": timed,
        "peak_over_base_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "base_allocated_gib": base / 2**30,
    }


class PowerMeter:
    """The CUDA device's energy counter, SM clock and power-cap state through NVML (``nvidia-ml-py``,
    the ``bench`` extra); inert, with ``error`` saying why, where NVML cannot be read."""

    def __init__(self, device=None) -> None:
        self.error: str | None = None
        self._handle = None
        try:
            import pynvml

            self._nvml = pynvml
            self._handle = torch.cuda._get_pynvml_handler(device)
            self.energy_mj(), self.sm_clock_mhz(), self.power_capped()  # each read once (energy: Volta on)
        except Exception as error:  # no nvidia-ml-py, no driver, an old GPU, a query not supported
            self._handle = None
            self.error = f"{type(error).__name__}: {error}"

    @property
    def available(self) -> bool:
        return self._handle is not None

    def energy_mj(self) -> int:
        """Millijoules used by the device since the driver loaded."""
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def sm_clock_mhz(self) -> int:
        return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def power_capped(self) -> bool:
        """Whether the software power cap is holding the clocks down now."""
        reasons = self._nvml.nvmlDeviceGetCurrentClocksEventReasons(self._handle)
        return bool(reasons & self._nvml.nvmlClocksEventReasonSwPowerCap)


ENERGY_WINDOW_S = 2.0
"""Seconds of back-to-back replays over which a graph's energy per replay is read (NVML's energy
counter on the H200 advances in steps of tens of milliseconds: over 20 replays of a 7 ms step it
gave 986 W synchronised and 508 W back to back, beside a 700 W cap)."""


def power_summary(energy_mj: int, seconds: float, steps: int, clocks: list[int], capped: list[bool]) -> dict:
    """Energy per step (J) and mean power (W) over a window of ``steps`` back-to-back steps lasting
    ``seconds``; the SM clock sampled after each synchronised step (median, min) and the share of those
    samples taken while the power cap held the clocks."""
    return {
        "energy_per_step_j": energy_mj / 1000 / steps,
        "mean_power_w": energy_mj / 1000 / seconds if seconds > 0 else None,
        "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
        "sm_clock_mhz_min": min(clocks) if clocks else None,
        "power_capped_share": sum(capped) / len(capped) if capped else None,
    }


def measure_graphed(block, x, grad, warmup: int, timed: int) -> dict:
    """The step (forward and backward) captured once as a CUDA graph and replayed: synchronised
    replays' times and the same replays back to back. A graph's replay is one launch, so these are the
    device's time for the step without the host's launch gaps (the method for many small launches).
    A step that cannot be captured (a host sync, a host-side copy) gives ``{"error": ...}``.

    Also the replay's output and input gradient against one eager step on the same input
    (``graph_vs_eager_rel_diff``): a replay must compute what the eager step computes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(warmup):
            _step(block, x, grad)
            _clear_grads(block, x)
    torch.cuda.current_stream().wait_stream(side)
    eager_out = _step(block, x, grad).detach().float()
    eager_grad = x.grad.detach().float()
    _clear_grads(block, x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_out = _step(block, x, grad)
    except Exception as error:  # a sync or a host copy inside the step: not capturable
        torch.cuda.synchronize()
        _clear_grads(block, x)
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    graph.replay()
    torch.cuda.synchronize()

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))

    diffs = {"output": rel(static_out, eager_out), "input_grad": rel(x.grad, eager_grad)}
    meter = PowerMeter()
    times, clocks, capped = [], [], []
    for _ in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if meter.available:  # between replays, outside the timed region
            clocks.append(meter.sm_clock_mhz())
            capped.append(meter.power_capped())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(timed):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    if meter.available:  # a window long enough for the counter's coarse steps, replays back to back
        replays = max(timed, math.ceil(ENERGY_WINDOW_S * 1000 / max(start.elapsed_time(end) / timed, 1e-3)))
        window_start, window_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        energy = meter.energy_mj()
        window_start.record()
        for _ in range(replays):
            graph.replay()
        window_end.record()
        torch.cuda.synchronize()
        seconds = window_start.elapsed_time(window_end) / 1000
        power = power_summary(meter.energy_mj() - energy, seconds, replays, clocks, capped)
        power |= {"energy_replays": replays, "energy_window_s": seconds}
    else:
        power = {"error": meter.error}
    result = {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "times_ms": times,
        "timed_steps": timed,
        "pipelined_ms": start.elapsed_time(end) / timed,
        "peak_over_base_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "graph_vs_eager_rel_diff": diffs,
        "power": power,
    }
    del graph, static_out
    _clear_grads(block, x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return result


def profile(block, x, grad, path: str, title: str) -> None:
    """Append the CUDA kernels of two steps, by total device time, to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            _step(block, x, grad)
        torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"== {title}\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=90))
        f.write("\n")


def _knob(text: str | None, parse) -> list:
    """A knob's ``;``-separated values, each parsed (``None`` for the default: no text, or ``default``)."""
    if not text:
        return [None]
    return [None if part.strip() in ("", "default") else parse(part.strip()) for part in text.split(";")]


def _tile(part: str) -> tuple:
    """``"a,b,c,d,e"`` -> the 5-tuple; ``"K:a,b,c,d,e"`` -> ``("depth", K, 5-tuple)``: those tiles only for
    the GEMMs with at most K inputs (``moe_fused.TILES_BY_DEPTH``), the others keep the built-in ones."""
    depth = None
    if ":" in part:
        head, part = part.split(":", 1)
        depth = int(head)
    values = tuple(int(v) for v in part.split(","))
    if len(values) != 5:
        raise ValueError(f"a tile configuration has five integers (sizes, warps, stages), got {part!r}")
    return values if depth is None else ("depth", depth, values)


def _tiles(text: str | None) -> list[tuple[int, ...] | None]:
    """``"a,b,c,d,e;..."`` -> a list of 5-tuples."""
    return _knob(text, _tile)


_DEFAULT_DOWN_RANK_MAX = None
_DEFAULT_GROUPED_MM = None
_DEFAULT_WEIGHT_LOADS = None
_DEFAULT_PAIR = None


def _set_tiles(
    tiles: tuple[int, ...] | None,
    wgrad: tuple[int, ...] | None,
    down: int | None = None,
    grouped: str | None = None,
    loads: str | None = None,
    pair: bool | None = None,
) -> None:
    global _DEFAULT_DOWN_RANK_MAX, _DEFAULT_GROUPED_MM, _DEFAULT_WEIGHT_LOADS, _DEFAULT_PAIR
    from lightning_sloth.kernels import moe_fused

    from lightning_sloth.moe import indexed

    by_depth = tiles is not None and tiles[0] == "depth"
    moe_fused.TILES, moe_fused.WGRAD_TILES = (None if by_depth else tiles), wgrad
    moe_fused.TILES_BY_DEPTH = ((tiles[1], tuple(tiles[2])),) if by_depth else ()
    if _DEFAULT_DOWN_RANK_MAX is None:
        _DEFAULT_DOWN_RANK_MAX = indexed.DOWN_IN_KERNEL_MAX_RANK
        _DEFAULT_GROUPED_MM = (indexed.ORDERED_ROWS_GROUPED_MM, indexed.GATHERED_ROWS_GROUPED_MM)
        _DEFAULT_WEIGHT_LOADS = moe_fused.WEIGHT_LOADS
        _DEFAULT_PAIR = indexed.LORA_GRAD_PAIR
    indexed.LORA_GRAD_PAIR = _DEFAULT_PAIR if pair is None else pair
    moe_fused.WEIGHT_LOADS = _DEFAULT_WEIGHT_LOADS if loads is None else loads
    indexed.DOWN_IN_KERNEL_MAX_RANK = _DEFAULT_DOWN_RANK_MAX if down is None else down
    flags = _DEFAULT_GROUPED_MM if grouped is None else indexed.grouped_mm_choice(grouped)
    indexed.ORDERED_ROWS_GROUPED_MM, indexed.GATHERED_ROWS_GROUPED_MM = flags


def _ranks(text: str | None) -> list[int | None]:
    """``"32;0"`` -> ``[32, 0]``."""
    return _knob(text, int)


def _grouped(text: str | None) -> list[str | None]:
    """``"none;both"`` -> ``["none", "both"]``; an unknown name is an error naming the choices."""
    from lightning_sloth.moe.indexed import grouped_mm_choice

    def checked(name: str) -> str:
        grouped_mm_choice(name)
        return name

    return _knob(text, checked)


def _loads(text: str | None) -> list[str | None]:
    """``"pointer;tma_ws"`` -> ``["pointer", "tma_ws"]``; an unknown name is an error naming the choices."""
    from lightning_sloth.kernels.moe_fused import WEIGHT_LOAD_CHOICES

    def checked(name: str) -> str:
        if name not in WEIGHT_LOAD_CHOICES:
            raise ValueError(f"--weight-loads takes {', '.join(WEIGHT_LOAD_CHOICES)}; got {name!r}")
        return name

    return _knob(text, checked)


def _switches(text: str | None) -> list[bool | None]:
    """``"1;0"`` -> ``[True, False]``; anything but 1/0/true/false is an error naming it."""

    def checked(value: str) -> bool:
        if value.lower() not in ("1", "0", "true", "false"):
            raise ValueError(f"--lora-grad-pair takes 1 or 0; got {value!r}")
        return value.lower() in ("1", "true")

    return _knob(text, checked)


def _variants(
    fused_tiles: str | None,
    wgrad_tiles: str | None,
    down_ranks: str | None = None,
    grouped: str | None = None,
    loads: str | None = None,
    pair: str | None = None,
) -> list[tuple]:
    """The first configuration of each knob, then every other one with the other knobs at their first:
    ``(tiles, wgrad tiles, down rank max, which GEMMs run torch._grouped_mm, weight loads, the LoRA
    gradient pair in one pass)``."""
    knobs = [
        _tiles(fused_tiles), _tiles(wgrad_tiles), _ranks(down_ranks), _grouped(grouped), _loads(loads),
        _switches(pair),
    ]  # fmt: skip
    first = tuple(k[0] for k in knobs)
    out = [first]
    for i, values in enumerate(knobs):
        out += [first[:i] + (v,) + first[i + 1 :] for v in values[1:]]
    return out


def _interleaved(variants: int, rounds: int) -> list[tuple[int, int]]:
    """``(round, variant)`` in the order the sweep times them: every variant once per round, so a drift
    of the device's clocks over the sweep falls on all of them alike."""
    return [(r, v) for r in range(max(1, rounds)) for v in range(variants)]


def _pooled(times: list[float]) -> dict:
    """Median, min and count over every timed step of a variant's rounds."""
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "times_ms": list(times),
        "timed_steps": len(times),
    }


def run_case(
    shape: str,
    mode: str,
    tokens: int,
    systems: list[str],
    warmup: int,
    timed: int,
    profile_path: str | None = None,
    variants: list[tuple] | None = None,
    rounds: int = 1,
    graphs: bool = False,
) -> dict:
    block = _block(shape)
    for param in block.parameters():
        param.requires_grad_(False)
    if mode == "lora":
        block = _with_lora(block)
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = SHAPES[shape]["hidden_size"]
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    results, outputs = {}, {}
    for system in systems:
        _select(block, system)
        try:
            with torch.no_grad():
                out = block(x)
            outputs[system] = (out[0] if isinstance(out, tuple) else out).float()
            steps = max(3, timed // 4) if system == "eager" else timed
            results[system] = measure(block, x, grad, warmup if system != "eager" else 1, steps)
            if graphs and system != "eager":
                results[system]["graphed"] = measure_graphed(block, x, grad, warmup, timed)
            if profile_path and system != "eager":
                profile(block, x, grad, profile_path, f"{shape}/{mode}/{system}")
        except torch.OutOfMemoryError as error:
            results[system] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
        torch.cuda.empty_cache()
        print(shape, mode, system, results[system], flush=True)
    reference = outputs.get("grouped_mm")
    for system, out in outputs.items():
        if reference is not None:
            results[system]["rel_diff_vs_grouped_mm"] = float((out - reference).norm() / reference.norm())
    grouped, ours = results.get("grouped_mm", {}), results.get("sloth", {})
    if "median_ms" in grouped and "median_ms" in ours:
        results["speedup_vs_grouped_mm"] = grouped["median_ms"] / ours["median_ms"]
        results["memory_ratio_vs_grouped_mm"] = ours["peak_over_base_gib"] / grouped["peak_over_base_gib"]
    fused = results.get("sloth_fused", {})
    results |= _speedups("fused", fused, {"grouped_mm": grouped, "sloth": ours})
    if variants and len(variants) > 1:
        sweep = [
            {
                "tiles": t,
                "wgrad_tiles": w,
                "down_rank_max": d,
                "grouped_mm": o,
                "weight_loads": ld,
                "lora_grad_pair": p,
            }  # fmt: skip
            for t, w, d, o, ld, p in variants
        ]
        times: list[list[float]] = [[] for _ in variants]
        graphed_times: list[list[float]] = [[] for _ in variants]
        for _round, index in _interleaved(len(variants), rounds):
            entry = sweep[index]
            if "error" in entry:
                continue
            _set_tiles(*variants[index])
            _select(block, "sloth_fused")
            try:
                if not times[index]:
                    with torch.no_grad():
                        out = block(x)
                    out = (out[0] if isinstance(out, tuple) else out).float()
                    if reference is not None:
                        entry["rel_diff_vs_grouped_mm"] = float((out - reference).norm() / reference.norm())
                timing = measure(block, x, grad, warmup, timed, pipelined=False)  # the sweep pools medians
                if not times[index]:
                    entry.update({k: v for k, v in timing.items() if k.endswith("gib")})
                entry.setdefault("round_medians_ms", []).append(timing["median_ms"])
                times[index].extend(timing["times_ms"])
                entry.update(_pooled(times[index]))
                if graphs:  # the same configuration's step as one CUDA graph, pooled over the rounds
                    replayed = measure_graphed(block, x, grad, warmup, timed)
                    if "error" in replayed:
                        entry["graphed"] = {"error": replayed["error"]}
                    else:
                        graphed_times[index].extend(replayed["times_ms"])
                        previous = entry.get("graphed", {})
                        entry["graphed"] = _pooled(graphed_times[index]) | {
                            "round_medians_ms": previous.get("round_medians_ms", [])
                            + [replayed["median_ms"]],
                            "round_pipelined_ms": previous.get("round_pipelined_ms", [])
                            + [replayed["pipelined_ms"]],
                            "round_energy_per_step_j": previous.get("round_energy_per_step_j", [])
                            + [replayed["power"].get("energy_per_step_j")],
                            "round_sm_clock_mhz_median": previous.get("round_sm_clock_mhz_median", [])
                            + [replayed["power"].get("sm_clock_mhz_median")],
                        }
            except Exception as error:  # a tile too large for shared memory, out of memory
                entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            torch.cuda.empty_cache()
            print(shape, mode, "sloth_fused", {k: v for k, v in entry.items() if k != "times_ms"}, flush=True)
        _set_tiles(*variants[0])
        results["sweep"] = sweep
        timed_ok = [e for e in sweep if "median_ms" in e]
        if timed_ok:
            best = min(timed_ok, key=lambda e: e["median_ms"])
            results["sweep_best"] = best
            if "median_ms" in grouped:
                results["sweep_best_speedup_vs_grouped_mm"] = grouped["median_ms"] / best["median_ms"]
    results |= _speedups(
        "fp8", results.get("sloth_fp8", {}), {"grouped_mm": grouped, "sloth": ours, "sloth_fused": fused}
    )
    nf4 = results.get("sloth_nf4", {})
    if "median_ms" in nf4 and "median_ms" in ours:
        results["nf4_time_ratio_vs_sloth_bf16"] = nf4["median_ms"] / ours["median_ms"]
        results["nf4_total_peak_gib"] = nf4["base_allocated_gib"] + nf4["peak_over_base_gib"]
        results["bf16_total_peak_gib"] = ours["base_allocated_gib"] + ours["peak_over_base_gib"]
    return results


def _speedups(prefix: str, mine: dict, others: dict[str, dict]) -> dict:
    """``{prefix}_speedup_vs_{name}`` (synchronised steps), ``{prefix}_pipelined_speedup_vs_{name}``
    (back to back) and, where both were captured, ``{prefix}_graphed_speedup_vs_{name}`` and
    ``{prefix}_graphed_pipelined_speedup_vs_{name}``: another system's time over this one's."""
    out = {}
    if "median_ms" not in mine:
        return out
    for name, other in others.items():
        if "median_ms" in other:
            out[f"{prefix}_speedup_vs_{name}"] = other["median_ms"] / mine["median_ms"]
        if "pipelined_ms" in other and "pipelined_ms" in mine:
            out[f"{prefix}_pipelined_speedup_vs_{name}"] = other["pipelined_ms"] / mine["pipelined_ms"]
        graphed, theirs = mine.get("graphed", {}), other.get("graphed", {})
        if "median_ms" in graphed and "median_ms" in theirs:
            out[f"{prefix}_graphed_speedup_vs_{name}"] = theirs["median_ms"] / graphed["median_ms"]
            out[f"{prefix}_graphed_pipelined_speedup_vs_{name}"] = (
                theirs["pipelined_ms"] / graphed["pipelined_ms"]
            )
    return out


def summary(report: dict) -> str:
    """A short table: median ms per system and case, and the fused path's speed-ups."""
    systems = [s for s in SYSTEMS if any(s in r for r in report["results"].values())]
    lines = ["case".ljust(26) + "".join(s.rjust(17) for s in systems) + "  fused vs grouped_mm / sloth"]
    for case, result in report["results"].items():
        cells = "".join(
            (f"{result[s]['median_ms']:.2f} ms" if "median_ms" in result.get(s, {}) else "-").rjust(17)
            for s in systems
        )
        ratios = [result.get(f"fused_speedup_vs_{n}") for n in ("grouped_mm", "sloth")]
        tail = " / ".join("-" if r is None else f"{r:.2f}x" for r in ratios)
        back_to_back = result.get("fused_pipelined_speedup_vs_grouped_mm")
        if back_to_back is not None:
            tail += f" (back to back: {back_to_back:.2f}x vs grouped_mm)"
        lines.append(case.ljust(26) + cells + "  " + tail)
        graphed = {s: result[s]["graphed"] for s in systems if "graphed" in result.get(s, {})}
        if graphed:
            cells = "".join(
                (
                    f"{graphed[s]['median_ms']:.2f} ms"
                    if "median_ms" in graphed.get(s, {})
                    else ("not captured" if s in graphed else "-")
                ).rjust(17)
                for s in systems
            )
            ratio = result.get("fused_graphed_speedup_vs_grouped_mm")
            back = result.get("fused_graphed_pipelined_speedup_vs_grouped_mm")
            tail = "-" if ratio is None else f"{ratio:.2f}x vs grouped_mm (back to back: {back:.2f}x)"
            lines.append("  as a CUDA graph".ljust(26) + cells + "  " + tail)
            energy = {
                s: g["power"]["energy_per_step_j"]
                for s, g in graphed.items()
                if "energy_per_step_j" in g.get("power", {})
            }
            if energy:
                cells = "".join((f"{energy[s]:.2f} J" if s in energy else "-").rjust(17) for s in systems)
                lines.append("  energy per replay".ljust(26) + cells)
        fp8 = [result.get(f"fp8_{k}speedup_vs_grouped_mm") for k in ("", "pipelined_", "graphed_")]
        if fp8[0] is not None:
            text = ", ".join(
                f"{label} {r:.2f}x"
                for label, r in zip(("synchronised", "back to back", "as a CUDA graph"), fp8, strict=True)
                if r is not None
            )
            lines.append("  FP8 experts vs grouped_mm: " + text)
        for entry in result.get("sweep", []):
            label = f"  tiles {entry['tiles'] or 'default'}, wgrad {entry['wgrad_tiles'] or 'default'}"
            if entry.get("down_rank_max") is not None:
                label += f", down in kernel up to rank {entry['down_rank_max']}"
            if entry.get("grouped_mm") is not None:
                label += f", torch._grouped_mm for {entry['grouped_mm']}"
            if entry.get("weight_loads") is not None:
                label += f", weights through {entry['weight_loads']}"
            if entry.get("lora_grad_pair") is not None:
                label += f", LoRA gradient pair {'in one pass' if entry['lora_grad_pair'] else 'in two'}"
            value = f"{entry['median_ms']:.2f} ms" if "median_ms" in entry else entry.get("error", "-")[:60]
            replayed = entry.get("graphed", {})
            if "median_ms" in replayed:
                value += f" (as a CUDA graph: {replayed['median_ms']:.2f} ms)"
            lines.append(label.ljust(60) + value)
    return "\n".join(lines)


def _default_out(fused: bool) -> str:
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / ("moe_fused.json" if fused else "moe_layer.json"))


def main(argv: list[str] | None = None) -> dict:
    from lightning_sloth.bench.measure import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the JSON report (default: $OUT or benchmarks/results/)")
    parser.add_argument(
        "--fused",
        action="store_true",
        help=f"the fused-permutation comparison: --modes lora --systems {FUSED_SYSTEMS} unless given",
    )
    parser.add_argument(
        "--fused-tiles",
        default=None,
        help="BM,BN,BK,WARPS,STAGES of the fused grouped GEMMs (K:... for those with at most K inputs); several: ';'",
    )
    parser.add_argument(
        "--wgrad-tiles", default=None, help="BA,BB,BR,WARPS,STAGES of the fused weight gradient; several: ';'"
    )
    parser.add_argument(
        "--down-rank-max",
        default=None,
        help="largest LoRA rank made inside the main GEMM (0: separate); several: ';'",
    )
    parser.add_argument(
        "--grouped-mm",
        default=None,
        help="which of the fused path's GEMMs run torch._grouped_mm: none, ordered (rows already in expert "
        "order), gathered (rows read through the permutation, from a gathered copy), both; several: ';'",
    )
    parser.add_argument(
        "--weight-loads",
        default=None,
        help="how the fused GEMMs load weight tiles: auto, pointer, tma (a TMA descriptor), tma_ws (that, "
        "warp-specialised), tma_rows (tma, and rows in expert order through a descriptor); several: ';'",
    )
    parser.add_argument(
        "--lora-grad-pair",
        default=None,
        help="1: the first fused op's backward makes g and dB of the LoRA up factor in one pass over its "
        "gradient; 0: two GEMMs; several: ';'",
    )
    parser.add_argument(
        "--group-m",
        type=int,
        default=None,
        help="M tiles per group of the fused GEMMs' program order (1: N fastest)",
    )
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default=ROUTER,
        help="lightning_sloth's systems run transformers' router (transformers) or the plugin's (sloth)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="also time each system's step captured as one CUDA graph (the device's time, no launch gaps)",
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--modes", default=None, help="frozen,lora (--fused: lora)")
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument(
        "--systems", default=None, help=f"a subset of {SYSTEMS}, run in that order (eager,grouped_mm,sloth)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the sweep's configurations this many times each, interleaved, and pool the steps",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=20)
    parser.add_argument("--profile", default=None, help="a text file for per-kernel device times")
    args = parser.parse_args(argv)
    args.modes = args.modes or ("lora" if args.fused else "frozen,lora")
    args.systems = args.systems or (FUSED_SYSTEMS if args.fused else "eager,grouped_mm,sloth")
    args.out = args.out or _default_out(args.fused)
    try:
        variants = _variants(
            args.fused_tiles, args.wgrad_tiles, args.down_rank_max, args.grouped_mm, args.weight_loads,
            args.lora_grad_pair,
        )  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    _set_tiles(*variants[0])
    _set_router(args.router)
    if args.group_m is not None:
        from lightning_sloth.kernels import moe_fused

        moe_fused.GROUP_M = args.group_m
    wanted = args.systems.split(",")
    if any(s.endswith("_nf4") for s in wanted) and "sloth_fp8" in wanted:
        parser.error("the NF4 and FP8 systems both quantise the experts in place: run them separately")
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    systems = [s for s in SYSTEMS if s in wanted and not (args.skip_eager and s == "eager")]
    report = {
        "benchmark": "one MoE layer, forward + backward, bf16",
        "environment": environment(),
        "tokens": args.tokens,
        "fused_tiles": args.fused_tiles,
        "wgrad_tiles": args.wgrad_tiles,
        "down_rank_max": args.down_rank_max,
        "grouped_mm": args.grouped_mm,
        "group_m": args.group_m,
        "router": args.router,
        "rounds": args.rounds,
        "graphs": args.graphs,
        "lora": {"r": 16, "alpha": 32, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
        "shapes": {name: SHAPES[name] for name in args.shapes.split(",")},
        "results": {},
    }
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            report["results"][f"{shape}/{mode}"] = run_case(
                shape,
                mode,
                args.tokens,
                systems,
                args.warmup,
                args.timed,
                args.profile,
                variants,
                args.rounds,
                args.graphs,
            )
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    print(summary(report), flush=True)
    print(f"wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
