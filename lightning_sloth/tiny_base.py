"""The tiny pretrained base model shipped in the package, and the script that makes it.

The default run of the app fine-tunes this base with LoRA, so it is the real workflow (a
pretrained base, then an instruction fine-tune) in miniature and needs no download. The base is
a 4-layer Llama (hidden 128, 0.8M parameters, 3.2 MB of float32 safetensors) over the built-in
character tokenizer, pretrained from scratch on text produced by the synthetic generator
(``lightning_sloth.data.SyntheticTask``): 85% of the documents are *function calls* over all six
tasks it learns, 15% the instruction format the app fine-tunes on::

    reverse(hello)=olleh        upper(ab cd)=AB CD        repeat 3(ab)=ababab     (85%)
    reverse: hello\nolleh       copy: abc\nabc                                   (15%)

It comes out knowing the skills but sloppy in the instruction format: greedy decoding of
instruction prompts is right about half of the time (repeat 0.71, reverse 0.50, upper 0.33 on 48
prompts), and the app's default LoRA fine-tune (``reverse`` and ``repeat``) improves on it
(``tests/test_default_run.py`` checks a shortened default: a lower validation loss and whole
prompts answered right).

Rebuild (bit for bit on the same device type and software: fixed seeds, deterministic ops, eager
attention, a fixed thread count)::

    python -m lightning_sloth.tiny_base --device cuda --out lightning_sloth/assets/tiny_base

The shipped weights were made that way on an NVIDIA H100 (torch 2.11, transformers 5.17; two runs
gave the same SHA-256); ``--device cpu`` runs the same recipe deterministically on the CPU, whose
bits differ from the GPU's. ``--check`` rebuilds into a temporary directory and compares the
weights' SHA-256 with the shipped file. The directory holds ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import random
import tempfile
from pathlib import Path

import torch

from lightning_sloth.data.sources import SyntheticTask
from lightning_sloth.data.tokenizer import build_char_tokenizer

log = logging.getLogger(__name__)

TINY_BASE_DIR = Path(__file__).parent / "assets" / "tiny_base"
#: Tasks whose function-call exact match is logged while pretraining.
EVAL_TASKS = ("reverse", "upper", "repeat")
# The order of the two lists below is part of the recipe (it decides the documents drawn).
#: Every task of the pretraining text (``sort`` and ``add`` are beyond a model this small).
PRETRAIN_TASKS = ("reverse", "upper", "repeat", "copy", "next", "last")
#: Tasks the base also sees in the instruction format (15% of its documents).
INSTRUCTION_TASKS = ("copy", "next", "last", "reverse", "upper", "repeat")
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
_SEED = 1234
_THREADS = 2
_STEPS = 3000
_BATCH = 64
_LR = 3e-3
_WARMUP = 100
_INSTRUCTION_FRACTION = 0.15


def function_text(record: dict) -> str:
    """``reverse: abc\\n`` / ``cba`` -> ``reverse(abc)=cba``: the base's pretraining format."""
    task, argument = record["prompt"].rstrip("\n").split(": ", 1)
    return f"{task}({argument})={record['response']}"


def _documents(step: int, count: int, instruction_tasks: tuple[str, ...] = INSTRUCTION_TASKS) -> list[str]:
    """The ``count`` pretraining documents of one step (a pure function of ``step``)."""
    rng = random.Random(f"tiny-base:{_SEED}:{step}")
    docs = []
    for _ in range(count):
        if rng.random() < _INSTRUCTION_FRACTION:
            record = SyntheticTask(1, seed=rng.randrange(1 << 30), tasks=instruction_tasks)[0]
            docs.append(record["prompt"] + record["response"])
        else:
            record = SyntheticTask(1, seed=rng.randrange(1 << 30), tasks=PRETRAIN_TASKS)[0]
            docs.append(function_text(record))
    return docs


def _batch(tokenizer, docs: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)``: ``bos + text + eos`` rows, right-padded."""
    rows = [
        [tokenizer.bos_token_id, *tokenizer.encode(d, add_special_tokens=False), tokenizer.eos_token_id]
        for d in docs
    ]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def build_base_model(tokenizer):
    """A fresh random-weight ``LlamaForCausalLM`` of the base's shape (float32, seeded, eager attention:
    deterministic on CUDA too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="eager",
        **MODEL_SHAPE,
    )
    torch.manual_seed(_SEED)
    return LlamaForCausalLM(config)


@torch.no_grad()
def _teacher_forced_exact_match(model, tokenizer, docs: list[str], split_at: str) -> float:
    """Fraction of docs whose every token after ``split_at`` (and the eos) is the argmax prediction."""
    device = next(model.parameters()).device
    ids, mask, labels = (t.to(device) for t in _batch(tokenizer, docs))
    for i, doc in enumerate(docs):
        answer_start = 1 + len(doc.split(split_at, 1)[0]) + len(split_at)
        labels[i, :answer_start] = -100
    logits = model(input_ids=ids, attention_mask=mask).logits
    targets = labels[:, 1:]
    wrong = (logits[:, :-1].argmax(-1) != targets) & (targets != -100)
    return float((wrong.sum(1) == 0).float().mean())


def pretrain(
    steps: int = _STEPS,
    log_every: int = 250,
    device: str = "cpu",
    instruction_tasks: tuple[str, ...] = INSTRUCTION_TASKS,
):
    """Pretrain the base from scratch; returns ``(model, tokenizer)`` (model on the CPU).

    Deterministic: fixed seeds, ``torch.use_deterministic_algorithms``, eager attention, a fixed
    CPU thread count; on CUDA ``CUBLAS_WORKSPACE_CONFIG`` is set by :func:`main`. Bits agree
    between runs on the same device type and software, not between CPU and GPU.
    """
    torch.set_num_threads(_THREADS)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_char_tokenizer()
    model = build_base_model(tokenizer).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_factor(step: int) -> float:
        if step < _WARMUP:
            return (step + 1) / _WARMUP
        progress = (step - _WARMUP) / max(steps - _WARMUP, 1)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    held_out = SyntheticTask(128, seed=_SEED + 7, tasks=EVAL_TASKS)
    for step in range(steps):
        batch = _batch(tokenizer, _documents(step, _BATCH, instruction_tasks))
        ids, mask, labels = (t.to(device, non_blocking=True) for t in batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            model.eval()
            em = {
                task: _teacher_forced_exact_match(
                    model, tokenizer, [function_text(r) for r in held_out if r["task"] == task], ")="
                )
                for task in EVAL_TASKS
            }
            model.train()
            scores = ", ".join(f"{task} {value:.2f}" for task, value in em.items())
            log.info(
                "step %d loss %.4f held-out function-call exact match: %s", step + 1, loss.item(), scores
            )
    return model.cpu().eval(), tokenizer


def save_base(model, tokenizer, out: str | Path) -> Path:
    """Write the model (float32 safetensors), its generation config and the tokenizer to ``out``."""
    from transformers import GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    model.set_attn_implementation("sdpa")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def weights_sha256(directory: str | Path) -> str:
    """SHA-256 of ``model.safetensors`` in ``directory``."""
    return hashlib.sha256((Path(directory) / "model.safetensors").read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_sloth.tiny_base [--out DIR] [--check] [--steps N]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(TINY_BASE_DIR), help="directory to write the base to")
    parser.add_argument("--steps", type=int, default=_STEPS, help="pretraining steps")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--instruction-tasks",
        default=",".join(INSTRUCTION_TASKS),
        help="tasks also shown in the instruction format (comma-separated)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="rebuild in a temporary directory and compare with the shipped weights",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # cuBLAS needs a fixed workspace to be deterministic; set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    model, tokenizer = pretrain(
        args.steps, device=args.device, instruction_tasks=tuple(args.instruction_tasks.split(","))
    )
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            rebuilt = weights_sha256(save_base(model, tokenizer, tmp))
        shipped = weights_sha256(TINY_BASE_DIR)
        print(f"rebuilt {rebuilt}\nshipped {shipped}\n{'identical' if rebuilt == shipped else 'DIFFERENT'}")
        raise SystemExit(0 if rebuilt == shipped else 1)
    out = save_base(model, tokenizer, args.out)
    print(f"wrote {out} (model.safetensors sha256 {weights_sha256(out)})")


if __name__ == "__main__":
    main()
