"""Activation offload benchmark: tokens/s and peak memory of one LoRA fine-tuning step, per memory setup.

A random-weight Llama of the chosen shape in bf16, LoRA r=16 on all seven projections (PEFT),
one packed row of ``--tokens`` tokens per step. Every setup trains the same model on the same
seeded batches; warm-up steps are excluded, ``torch.cuda.synchronize`` brackets each timed step,
and the median step time is reported. The optimizer step is left out (LoRA's is negligible), so
the weights stay fixed and every setup's first loss must agree::

    python benchmarks/offload_bench.py results.json                       # Llama-3.2-1B shape
    python benchmarks/offload_bench.py results.json --shape llama_3_1_8b --setups checkpoint,offload_double
    python benchmarks/offload_bench.py results.json --probe-max-tokens 262144   # longest step per setup

The longest step is searched by doubling from ``--tokens`` and then bisecting to ``--probe-step``
tokens. Probe with ``--attention packed``: documents of up to 4096 tokens keep the attention
compute small, and flash attention's memory is linear in length either way, so the activation
memory of a step (what the setups differ in) is that of one sequence of the same length.

Setups:
    none            no checkpointing
    checkpoint      per-layer non-reentrant checkpointing (apply_checkpointing without offloader)
    offload_single  checkpointing + ActivationOffloader, inputs fetched when the backward asks
    offload_double  checkpointing + ActivationOffloader, next layer's input prefetched
    save_on_cpu     checkpointing + torch.autograd.graph.save_on_cpu(pin_memory=True) around the
                    forward: torch's own hooks at the same place, no pool, no prefetch
    planned         ActivationOffloader("auto") + memory_budget="auto": the planner picks
                    keep / recompute / offload per layer from the first step's measurement

The loss is the lm-head cross-entropy in checkpointed chunks of 2048 tokens (the ``[T, vocab]``
logits are never whole), the same for every setup; ``--loss fused`` uses
``lightning_sloth.ops.linear_cross_entropy`` instead.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_sloth.bench.measure import environment
from lightning_sloth.bench.workload import SHAPES
from lightning_sloth.offload import ActivationOffloader, apply_checkpointing

SETUPS = ("none", "checkpoint", "offload_single", "offload_double", "save_on_cpu", "planned")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_CHUNK = 2048
GIB = 2**30


def build_model(shape: str, attention: str, seed: int):
    """Random-weight bf16 Llama of ``shape`` on CUDA with PEFT LoRA r=16 on all projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa", use_cache=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    if attention == "packed":
        from lightning_sloth.attention import enable_packed_attention

        enable_packed_attention(model)
    return model.train()


def make_batch(tokens: int, vocab: int, attention: str, seed: int) -> dict:
    """One ``[1, tokens]`` row: a single causal sequence, or documents of random lengths packed end to end."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, tokens), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if attention == "packed":
        lengths = (
            torch.empty(4 * tokens // 64 + 1).log_normal_(6.0, 0.8, generator=gen).long().clamp(16, 4096)
        )
        ends = torch.cumsum(lengths, 0)
        ends = torch.cat([ends[ends < tokens], torch.tensor([tokens])])
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), ends]).int()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
        batch["position_ids"] = (torch.arange(tokens) - starts).unsqueeze(0)
        batch["labels"][0, cu_seqlens[:-1].long()] = -100  # no target crosses a document boundary
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        batch |= {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len}
        batch["max_length_k"] = max_len
    return {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _chunk_loss(hidden, targets, weight):
    return F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100, reduction="sum")


def lm_loss(model, batch: dict, loss: str) -> torch.Tensor:
    """Mean next-token cross-entropy of the decoder's hidden states, never materialising all logits."""
    base = model.get_base_model()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = base.model(**inputs).last_hidden_state[0]
    targets = torch.cat([batch["labels"][0, 1:], batch["labels"].new_full((1,), -100)])
    weight = base.lm_head.weight
    if loss == "fused":
        from lightning_sloth.ops.linear_cross_entropy import linear_cross_entropy

        return linear_cross_entropy(hidden, weight, targets)
    # The weight is bound, not a checkpoint input: save_on_cpu would copy it for every chunk.
    chunk_loss = partial(_chunk_loss, weight=weight)
    total = sum(
        checkpoint(chunk_loss, hidden[s : s + LOSS_CHUNK], targets[s : s + LOSS_CHUNK], use_reentrant=False)
        for s in range(0, hidden.shape[0], LOSS_CHUNK)
    )
    return total / (targets != -100).sum()


def configure(model, setup: str):
    """Apply ``setup``'s checkpointing/offload; returns (offloader or None, forward context factory)."""
    no_context = contextlib.nullcontext
    if setup == "none":
        apply_checkpointing(model).remove()
        return None, no_context
    if setup in ("checkpoint", "save_on_cpu"):
        apply_checkpointing(model)
        if setup == "save_on_cpu":
            return None, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
        return None, no_context
    if setup == "planned":
        offloader = ActivationOffloader("auto")
        apply_checkpointing(model, offloader=offloader, memory_budget="auto")
        return offloader, no_context
    offloader = ActivationOffloader("on", double_buffer=setup == "offload_double")
    apply_checkpointing(model, offloader=offloader)
    return offloader, no_context


def train_step(model, batch: dict, context, loss: str) -> torch.Tensor:
    with context():
        value = lm_loss(model, batch, loss)
    value.backward()
    model.zero_grad(set_to_none=True)
    return value.detach()


def run_setup(model, setup: str, args, vocab: int, weights_bytes: int) -> dict:
    """Warm up, then time ``args.timed_steps`` steps of one setup."""
    offloader, context = configure(model, setup)
    release_memory()
    result: dict = {"setup": setup, "tokens_per_step": args.tokens}
    try:
        losses = []
        for step in range(args.warmup_steps):
            batch = make_batch(args.tokens, vocab, args.attention, step)
            losses.append(float(train_step(model, batch, context, args.loss)))
        if offloader is not None:
            offloader.stats(reset=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(args.timed_steps):
            batch = make_batch(args.tokens, vocab, args.attention, args.warmup_steps + step)
            torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(model, batch, context, args.loss)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        result |= {
            "tokens_per_s": args.tokens / step_s,
            "median_step_s": step_s,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "peak_activations_gib": (torch.cuda.max_memory_allocated() - weights_bytes) / GIB,
            "first_loss": losses[0],
            "oom": False,
        }
        if offloader is not None:
            result["offload"] = offloader.stats()
    except torch.OutOfMemoryError as err:
        result |= {"oom": True, "error": str(err).splitlines()[0]}
    finally:
        release_memory()
    if args.probe_max_tokens:
        result["max_tokens"] = probe_max_tokens(model, setup, args, vocab)
    return result


def _fits(model, setup: str, tokens: int, *, args, vocab: int) -> bool:
    """Whether one training step of ``tokens`` tokens runs without a CUDA out-of-memory error."""
    _, context = configure(model, setup)  # fresh offloader, pool sized for this length
    try:
        train_step(model, make_batch(tokens, vocab, args.attention, 0), context, args.loss)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        release_memory()


def release_memory() -> None:
    """Drop what a finished or failed step left: garbage, cached device blocks, and cached pinned
    host blocks (probe lengths change, so old blocks rarely fit again)."""
    gc.collect()
    torch.cuda.empty_cache()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def probe_max_tokens(model, setup: str, args, vocab: int) -> int:
    """Longest step (in tokens, a multiple of ``--probe-step``, up to ``--probe-max-tokens``) that fits.

    Doubles from ``--tokens`` (or halves when that already fails) to bracket the limit, then
    bisects the bracket down to ``--probe-step`` tokens. Returns 0 when not even one
    ``--probe-step`` fits.
    """
    step, cap = args.probe_step, args.probe_max_tokens
    fits = partial(_fits, model, setup, args=args, vocab=vocab)
    low, high = 0, min(max(step, args.tokens // step * step), cap)  # largest fit, smallest failure
    if fits(high):  # bracket upwards
        low, high = high, None
        while high is None and low < cap:
            tokens = min(2 * low, cap)
            low, high = (tokens, None) if fits(tokens) else (low, tokens)
        if high is None:
            return low
    else:  # bracket downwards
        while not low and high > step:
            tokens = max(step, high // 2 // step * step)
            low, high = (tokens, high) if fits(tokens) else (0, tokens)
        if not low:
            return 0
    while high - low > step:  # bisect
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="lightning_sloth activation offload benchmark (CUDA)")
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--shape", default="llama_3_2_1b", choices=sorted(SHAPES))
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {SETUPS}")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (one packed row)")
    parser.add_argument("--attention", choices=("causal", "packed"), default="causal")
    parser.add_argument("--loss", choices=("chunked", "fused"), default="chunked")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument(
        "--probe-max-tokens", type=int, default=0, help="also find the longest step per setup"
    )
    parser.add_argument(
        "--probe-step", type=int, default=8192, help="resolution of --probe-max-tokens, in tokens"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setups = args.setups.split(",")
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        parser.error(f"unknown setups {unknown}; choose from {SETUPS}")
    if args.warmup_steps < 1 or args.timed_steps < 1:
        parser.error("--warmup-steps and --timed-steps must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("the offload benchmark needs a CUDA GPU")

    model = build_model(args.shape, args.attention, args.seed)
    torch.cuda.synchronize()
    weights_bytes = torch.cuda.memory_allocated()
    vocab = model.config.vocab_size
    report = {
        "environment": environment(),
        "config": vars(args) | {"shape_config": SHAPES[args.shape], "lora_r": 16, "dtype": "bfloat16"},
        "first_losses_agree": True,  # same weights and batch: every setup's first loss is the same
        "results": [],
    }
    for setup in setups:  # the report is rewritten after each setup: a cut-off run keeps what it measured
        report["results"].append(run_setup(model, setup, args, vocab, weights_bytes))
        first_losses = {r["first_loss"] for r in report["results"] if not r["oom"]}
        report["first_losses_agree"] = len(first_losses) <= 1
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    print_table(report)
    return report


def print_table(report: dict) -> None:
    env = report["environment"]
    print(
        f"{env['device']}  torch {env['torch']}  transformers {env['transformers']}  {report['config']['shape']}"
    )
    if not report["first_losses_agree"]:
        print("WARNING: the setups' first losses differ; they should be identical")
    header = f"{'setup':<15} {'tok/s':>8} {'step s':>7} {'alloc GiB':>9} {'resv GiB':>9} {'act GiB':>8} {'wait ms':>8} {'loss':>8}"
    probe = any("max_tokens" in r for r in report["results"])
    print(header + (f" {'max tok':>8}" if probe else ""))
    for r in report["results"]:
        if r["oom"]:
            row = f"{r['setup']:<15} {'OOM':>8}"
        else:
            wait = r.get("offload", {}).get("backward_wait_ms_per_step")
            row = (
                f"{r['setup']:<15} {r['tokens_per_s']:>8.0f} {r['median_step_s']:>7.3f} "
                f"{r['peak_allocated_gib']:>9.2f} {r['peak_reserved_gib']:>9.2f} {r['peak_activations_gib']:>8.2f} "
                f"{wait if wait is not None else float('nan'):>8.2f} {r['first_loss']:>8.4f}"
            )
        print(row + (f" {r.get('max_tokens', 0):>8}" if probe else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
