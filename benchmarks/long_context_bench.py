"""The longest single sequence one optimizer step trains, and every GiB of that step.

``step`` builds a model of a shape straight into NF4 (``random_quantized``: one module at a time,
the 16-bit weights of the whole model never exist), or in bf16, puts LoRA r=16 on the seven
projections, applies ``transform_model`` (kernels, packed attention, checkpointing, offload, token-
chunked MLPs, the memory plan), and trains one full optimizer step (forward, backward, AdamW) on
one sequence of ``--tokens`` tokens. Building the model is timed apart from the step. Its JSON
(``fits``, peak allocated and reserved, step seconds, loss) goes to ``$OUT`` (else
``benchmarks/results/``), with the offloader's bytes moved to the host and kept on the device (its
pinned pool is capped at half the host's memory unless ``--max-host-gib`` says otherwise: at 350k
tokens an 8B's layer inputs are 2.7 GiB each); ``--account`` adds the memory accounting
(``benchmarks/memory_accounting.py``: what the model holds, and what the step adds at its peak by
category)::

    python benchmarks/long_context_bench.py step --shape llama_3_1_8b --tokens 16384 --account
    python benchmarks/long_context_bench.py step --shape llama_3_1_8b --tokens 360448

``bisect`` finds the longest length that fits, one step per process (a step that runs out of
memory leaves nothing behind for the next): it probes the middle of ``[--low, --high]`` (a length
known to fit, one known not to, or guesses) rounded to ``--step`` tokens, until the bracket closes
or ``--max-seconds`` would be passed by another probe; each probe's JSON lands under
``$OUT/probes/``, the bracket in ``$OUT/bisect_<shape>_<base>.json``. A bracket left open is the
next call's ``--low``/``--high``::

    python benchmarks/long_context_bench.py bisect --shape llama_3_1_8b --low 262144 --high 524288 \\
        --step 16384 --max-seconds 540

Shapes: those of ``lightning_sloth.bench.workload.SHAPES`` (``llama_3_1_70b`` among them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_accounting, probes/

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXIT_OOM = 3


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")


def config_of(shape: str):
    from lightning_sloth.bench.workload import SHAPES, shape_config

    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: one of {sorted(SHAPES)}")
    return shape_config(shape)


def build(args, device: torch.device):
    """The LoRA model of ``args.shape`` on ``device``, transformed; its base never whole in 16 bits
    when ``--base nf4``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_sloth.quant import random_quantized
    from lightning_sloth.transform import transform_model

    config = config_of(args.shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.base == "nf4":
        model = random_quantized(config, "nf4", device=device, dtype=dtype, seed=args.seed)
    else:
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    chunk = args.mlp_chunk_tokens
    budget = args.memory_budget
    report = transform_model(
        model,
        kernels=True,
        offload=args.offload,
        memory_budget=int(budget) if budget not in (None, "auto") else budget,
        mlp_chunk_tokens=int(chunk)
        if chunk not in (None, "auto", "none")
        else (None if chunk == "none" else chunk),
    )
    if report.offloader is not None and args.max_host_gib is not None:
        report.offloader.pool.max_bytes = int(args.max_host_gib * 2**30)
    return model.train(), report


def one_sequence(tokens: int, vocab: int, device: torch.device, seed: int) -> dict:
    """One packed row holding one ``tokens``-long document, as ``PackedBatch.model_inputs`` gives it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels = ids.clone()
    labels[0, 0] = -100
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    inputs = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.arange(tokens).unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": tokens,
        "max_length_k": tokens,
        "use_cache": False,
    }
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
    }


def train_step(model, optimizer, inputs: dict, tokens: int) -> torch.Tensor:
    """Forward, backward and optimizer step (bf16 autocast on CUDA, float32 on the CPU)."""
    device = inputs["input_ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(**inputs, num_target_tokens=tokens - 1).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_step(args) -> dict:
    """``step``: one optimizer step at ``args.tokens`` (see the module notes)."""
    from memory_accounting import model_bytes, print_table, step_bytes, table

    from lightning_sloth.bench.measure import environment

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    record = {
        "shape": args.shape, "base": args.base, "tokens": args.tokens, "lora_r": args.lora_r,
        "offload": args.offload, "mlp_chunk_tokens": args.mlp_chunk_tokens, "memory_budget": args.memory_budget,
        "environment": environment(), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }  # fmt: skip
    start = time.perf_counter()
    model, report = build(args, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=cuda)
    vocab = model.get_output_embeddings().weight.shape[0]
    inputs = one_sequence(args.tokens, vocab, device, args.seed)
    if cuda:
        torch.cuda.synchronize()
    record |= {"build_seconds": time.perf_counter() - start, "applied": list(report.applied)}
    if cuda:
        record["after_build_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        if args.account:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    start = time.perf_counter()
    try:
        loss = train_step(model, optimizer, inputs, args.tokens)
        if cuda:
            torch.cuda.synchronize()
        record |= {"fits": True, "loss": float(loss), "step_seconds": time.perf_counter() - start}
    except torch.OutOfMemoryError as error:
        record |= {"fits": False, "error": str(error).splitlines()[0]}
    if cuda:
        record |= {
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    if report.offloader is not None:
        stats = report.offloader.stats()
        record["offloader"] = {
            k: stats[k] for k in ("offloaded_bytes_per_step", "kept_on_device_bytes_per_step") if k in stats
        }
        record["max_host_gib"] = (report.offloader.pool.max_bytes or 0) / 2**30
    ckpt = report.checkpointing
    if ckpt is not None:
        record["plan"] = {mode: ckpt.plan.count(mode) for mode in ("keep", "recompute", "offload")}
    if args.account and record["fits"]:
        step = None
        if cuda:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            step = step_bytes(snapshot["device_traces"][torch.cuda.current_device()])
        held = model_bytes(model, optimizer)
        peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if cuda else (None, None)
        record["accounting"] = table(held, step, *peak)
        print_table(record["accounting"])
    name = f"step_{args.shape}_{args.base}_{args.tokens}.json"
    out = out_dir() / (args.name or name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps({k: record[k] for k in record if k not in ("environment", "accounting")}))
    del model, optimizer
    gc.collect()
    return record


def next_length(low: int, high: int, step: int) -> int | None:
    """The middle of ``(low, high)`` on the ``step`` grid, or None once the bracket is closed."""
    if high - low <= step:
        return None
    mid = (low + high) // 2 // step * step
    return mid if low < mid < high else None


def bisect(fits, low: int, high: int, step: int, time_left) -> dict:
    """Bisect ``[low, high]`` with ``fits(tokens) -> (bool, seconds)`` while ``time_left(last)``.

    ``low`` is taken to fit and ``high`` not to (unprobed ends are the caller's guesses: a
    ``high`` that fits, or a ``low`` that does not, shows as a bracket pinned at that end).
    """
    tried, last = [], 0.0
    while (tokens := next_length(low, high, step)) is not None and time_left(last):
        ok, last = fits(tokens)
        tried.append({"tokens": tokens, "fits": ok})
        low, high = (tokens, high) if ok else (low, tokens)
    return {"low": low, "high": high, "closed": next_length(low, high, step) is None, "probes": tried}


def run_bisect(args, argv: list[str]) -> dict:
    """``bisect``: one ``step`` process per probe (see the module notes)."""
    started = time.perf_counter()
    probes = out_dir() / "probes"
    passthrough = _passthrough(argv)

    def fits(tokens: int) -> tuple[bool, float]:
        name = f"probes/step_{args.shape}_{args.base}_{tokens}.json"
        begin = time.perf_counter()
        command = [sys.executable, __file__, "step", "--tokens", str(tokens), "--name", name, *passthrough]
        done = subprocess.run(command, check=False)
        path = out_dir() / name
        ok = done.returncode == 0 and path.exists() and json.loads(path.read_text())["fits"]
        return ok, time.perf_counter() - begin

    def time_left(last: float) -> bool:  # the next probe takes about as long as the last one
        return time.perf_counter() - started + last <= args.max_seconds

    probes.mkdir(parents=True, exist_ok=True)
    result = bisect(fits, args.low, args.high, args.step, time_left)
    result |= {"shape": args.shape, "base": args.base, "step": args.step}
    path = out_dir() / f"bisect_{args.shape}_{args.base}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


def _passthrough(argv: list[str]) -> list[str]:
    """The arguments of a ``bisect`` call that its ``step`` processes take too."""
    keep = (
        "--shape",
        "--base",
        "--lora-r",
        "--offload",
        "--mlp-chunk-tokens",
        "--memory-budget",
        "--seed",
        "--device",
    )
    out, it = [], iter(argv)
    for arg in it:
        key = arg.split("=", 1)[0]
        if key in keep:
            out += [arg] if "=" in arg else [arg, next(it)]
    return out


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = main.add_subparsers(dest="command", required=True)
    for name in ("step", "bisect"):
        sub = commands.add_parser(name)
        sub.add_argument("--shape", default="llama_3_1_8b")
        sub.add_argument("--base", choices=("nf4", "bf16"), default="nf4")
        sub.add_argument("--lora-r", type=int, default=16)
        sub.add_argument("--offload", choices=("off", "on", "auto"), default="on")
        sub.add_argument("--mlp-chunk-tokens", default="auto", help="'auto', a token count or 'none'")
        sub.add_argument("--memory-budget", default=None, help="bytes or 'auto' for the per-layer plan")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument(
            "--max-host-gib",
            type=float,
            default=None,
            help="the offloader's pinned-pool cap (default: half the host)",
        )
        sub.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    step = commands.choices["step"]
    step.add_argument("--tokens", type=int, required=True)
    step.add_argument("--account", action="store_true", help="print and record every GiB by category")
    step.add_argument("--name", default=None, help="file name of the JSON under $OUT")
    bis = commands.choices["bisect"]
    bis.add_argument("--low", type=int, required=True, help="a length taken to fit")
    bis.add_argument("--high", type=int, required=True, help="a length taken not to fit")
    bis.add_argument("--step", type=int, default=8192, help="resolution in tokens")
    bis.add_argument("--max-seconds", type=float, default=540.0)
    return main


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    # Long steps allocate a few huge blocks of many sizes: growable segments keep the cache from
    # splitting (read when CUDA first allocates; a value the caller set is kept).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.command == "bisect":
        return run_bisect(args, argv)
    record = run_step(args)
    if not record["fits"]:
        raise SystemExit(EXIT_OOM)
    return record


if __name__ == "__main__":
    main()
