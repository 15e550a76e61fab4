"""QLoRA benchmark: 4-bit base weights, LoRA r=16 on the 7 projections, packed 16k-token steps.

Systems (each in its own process; the step loop, timing and memory accounting are
``lightning_sloth.bench.run_system``'s):

    sloth_bf16         bf16 base weights, SlothStrategy(kernels=True) (our own 16-bit LoRA step)
    sloth_nf4          NF4 base weights (built directly in 4 bits on the GPU, layer by layer)
    sloth_nf4_offload  + activation offload ("on")
    sloth_nf4_planned  + the memory plan: offload "auto", memory_budget="auto" (keep, recompute or
                       offload per layer within the card's free memory, counting the 4-bit
                       dequantisation buffer)
    hf_bnb_packed      transformers + PEFT + bitsandbytes: the same NF4 weights as bitsandbytes
                       Linear4bit layers, prepare_model_for_kbit_training, packed rows with SDPA
    hf_bnb_padded      the same, the ordinary recipe: padded micro-batches of 8 samples with SDPA

    python benchmarks/qlora_bench.py --shape llama_3_1_8b --systems sloth_bf16,sloth_nf4,hf_bnb_packed --out x.json

``--probe-max-tokens CAP`` (with one system) finds the longest single sequence that trains one
step: lengths double from ``--probe-start`` to ``CAP``, then the bracket is bisected down to
``--probe-step`` tokens while ``--probe-seconds`` last (a bracket not closed in time is reported as
such). The model is built once; a failed length frees what it left before the next one.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict, replace

import torch

from lightning_sloth.bench import systems
from lightning_sloth.bench.harness import run_system
from lightning_sloth.bench.measure import environment, forward_backward, stage_batch
from lightning_sloth.bench.workload import SHAPES, Workload, hf_padded_batches, packed_batches, shape_config

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QLORA_SHAPES = ("llama_3_1_8b", "qwen3_14b")  # entries of workload.SHAPES


def quantized_model(shape: str, seed: int):
    from lightning_sloth.quant import random_quantized

    return random_quantized(shape_config(shape), "nf4", device="cuda", dtype=torch.bfloat16, seed=seed)


def add_lora(model, r: int):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.bfloat16)
    return model


def sloth_system(quantize: bool, **settings):
    def setup(workload: Workload):
        from transformers import AutoModelForCausalLM

        from lightning_sloth.transform import transform_model

        if quantize:
            model = quantized_model(workload.shape, workload.seed)
        else:
            torch.manual_seed(workload.seed)
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(shape_config(workload.shape), dtype=torch.bfloat16)
        model = add_lora(model, workload.lora_r)
        model._sloth_report = transform_model(model, kernels=True, **settings)
        return model

    return setup


def hf_bnb_system(workload: Workload):
    from lightning_sloth.bench.peers import as_bitsandbytes

    return add_lora(as_bitsandbytes(quantized_model(workload.shape, workload.seed)), workload.lora_r)


SYSTEMS = {
    "sloth_bf16": (sloth_system(False), packed_batches),
    "sloth_nf4": (sloth_system(True), packed_batches),
    "sloth_nf4_offload": (sloth_system(True, offload="on"), packed_batches),
    "sloth_nf4_planned": (sloth_system(True, offload="auto", memory_budget="auto"), packed_batches),
    # the MLP over 8,192-token chunks: the 14B's 16k step under 14 GiB (its warm speed is the question)
    "sloth_nf4_offload_mlp8k": (sloth_system(True, offload="on", mlp_chunk_tokens=8192), packed_batches),
    "hf_bnb_packed": (hf_bnb_system, packed_batches),
    "hf_bnb_padded": (hf_bnb_system, hf_padded_batches),
}


def _fits(model, workload: Workload, tokens: int) -> dict:
    """One training step of a single ``tokens``-long sequence: ``{"fits": bool, "peak_allocated_gib": ...}``."""
    one = replace(
        workload, median_len=tokens, min_len=tokens, max_len=tokens, sigma=1e-6, tokens_per_step=tokens,
        warmup_steps=0, timed_steps=1,
    )  # fmt: skip
    samples = one.samples(SHAPES[workload.shape]["vocab_size"])[:1]
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        micro, _, _, targets = next(packed_batches(one, samples, 0))
        micro, num_items = stage_batch(micro, targets)
        forward_backward(model, micro, num_items, targets)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    result = {
        "tokens": tokens,
        "fits": fits,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "seconds": time.perf_counter() - start,
    }
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def probe_max_tokens(args, workload: Workload) -> dict:
    """Longest single sequence (a multiple of ``--probe-step``) that trains one step; see the module notes."""
    model = SYSTEMS[args.only][0](workload)
    model.train()
    started, step, cap = time.perf_counter(), args.probe_step, args.probe_max_tokens
    tried: list[dict] = []

    def fits(tokens: int) -> bool:
        tried.append(_fits(model, workload, tokens))
        return tried[-1]["fits"]

    def in_time() -> bool:
        return time.perf_counter() - started < args.probe_seconds

    low, high = 0, None
    tokens = args.probe_start
    while high is None and tokens <= cap and in_time():
        low, high = (tokens, None) if fits(tokens) else (low, tokens)
        tokens *= 2
    while high is not None and high - low > step and in_time():
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    closed = high is None and tokens > cap or high is not None and high - low <= step
    return {
        "system": args.only,
        "max_tokens": low,
        "smallest_failure": high,
        "resolution": step,
        "cap": cap,
        "bracket_closed": closed,
        "probes": tried,
    }


def run_one(args) -> dict:
    systems.SYSTEMS.update(SYSTEMS)
    timed = args.timed_steps
    if args.only == "hf_bnb_padded" and args.padded_timed_steps:
        timed = args.padded_timed_steps
    workload = Workload(
        shape=args.shape,
        tokens_per_step=args.tokens_per_step,
        timed_steps=timed,
        warmup_steps=args.warmup_steps,
    )
    if args.probe_max_tokens:
        return probe_max_tokens(args, workload) | {"workload": asdict(workload)}
    if args.doc_len:  # one length for every document: a step of one long sequence
        workload.median_len = workload.min_len = workload.max_len = args.doc_len
        workload.sigma = 1e-6
    samples = workload.samples(SHAPES[args.shape]["vocab_size"])
    try:
        result = run_system(args.only, workload, samples, args.peak_tflops * 1e12)
    except torch.OutOfMemoryError as err:
        result = {"system": args.only, "oom": True, "error": str(err).splitlines()[0][:300]}
    result["workload"] = asdict(workload)
    return result


def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            or None
        )
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama_3_1_8b", choices=sorted(QLORA_SHAPES))
    parser.add_argument("--systems", default="sloth_bf16,sloth_nf4,sloth_nf4_offload,hf_bnb_packed")
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument(
        "--padded-timed-steps",
        type=int,
        default=0,
        help="timed steps of hf_bnb_padded only (0: --timed-steps)",
    )
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument(
        "--doc-len", type=int, default=0, help="every document this long (0: lognormal lengths)"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--probe-max-tokens", type=int, default=0, help="bisect the longest single sequence")
    parser.add_argument("--probe-start", type=int, default=16384)
    parser.add_argument("--probe-step", type=int, default=8192)
    parser.add_argument("--probe-seconds", type=float, default=240.0)
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    parser.add_argument(
        "--git-commit", default=None, help="recorded with the results (default: git rev-parse HEAD)"
    )
    args = parser.parse_args()
    if args.only:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    commit = args.git_commit or _git_commit()
    results = []
    for name in args.systems.split(","):
        cmd = [sys.executable, __file__, "--only", name] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("only", "out", "systems", "git_commit")
        ]
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, text=True
        )  # stderr (probe lines too) passes through
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = (
            json.loads(lines[-1][7:])
            if lines
            else {"system": name, "error": f"exit code {proc.returncode} (its stderr is in the run log)"}
        )
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "workload"}), flush=True)
        report = {
            "environment": environment(),
            "git_commit": commit,
            "command": "python benchmarks/qlora_bench.py " + " ".join(sys.argv[1:]),
            "shape": args.shape,
            "results": results,
        }
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
