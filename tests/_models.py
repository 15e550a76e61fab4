"""Test helpers: tiny transformers models from configs and hand-built packed batches.

Imported as ``from _models import ...`` / ``import _models``: in pytest's default ``prepend``
import mode ``tests/`` is on ``sys.path`` (it holds ``conftest.py`` and the CPU test files).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lightning_sloth.data.batch import IGNORE_INDEX, PackedBatch

VOCAB = 128
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# initializer_range well above the usual 0.02 makes attention peaked, so a token that leaks across
# a document boundary moves the logits visibly.
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.15,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Random-weight float32 Llama, hidden 64, 4 query / 2 key-value heads (head_dim 16), eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**_TINY, **overrides})).float().eval()


def tiny_qwen3(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    """Random-weight float32 Qwen3 (q/k RMSNorm), hidden 64, head_dim 16 unless overridden, eval mode."""
    torch.manual_seed(seed)
    config = {**_TINY, "head_dim": 16, **overrides}
    return Qwen3ForCausalLM(Qwen3Config(**config)).float().eval()


def random_documents(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Token-id lists of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def packed_batch(documents: list[list[int]], pad_to: int | None = None, pad_id: int = 0) -> PackedBatch:
    """Pack token-id lists end to end into a :class:`PackedBatch`, on the CPU.

    Labels follow transformers' unshifted convention: the token itself, ``-100`` at each document's
    first position and on padding. Padding (when ``pad_to`` exceeds the total) is one more segment
    with positions restarting at 0. ``max_seqlen`` is the exact longest segment.
    """
    lengths = [len(doc) for doc in documents]
    total = sum(lengths)
    capacity = total if pad_to is None else pad_to
    if capacity < total:
        raise ValueError(f"pad_to={pad_to} is shorter than the {total} tokens of the documents")
    segments = lengths + ([capacity - total] if capacity > total else [])
    ids = [tok for doc in documents for tok in doc] + [pad_id] * (capacity - total)
    labels = []
    for doc in documents:
        labels += [IGNORE_INDEX, *doc[1:]]
    labels += [IGNORE_INDEX] * (capacity - total)
    positions = [p for n in segments for p in range(n)]
    cu = [0]
    for n in segments:
        cu.append(cu[-1] + n)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.int64),
        labels=torch.tensor([labels], dtype=torch.int64),
        position_ids=torch.tensor([positions], dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(segments),
        num_tokens=total,
        num_target_tokens=sum(max(n - 1, 0) for n in lengths),
        capacity=capacity,
    )


def add_lora(model, r: int = 8, seed: int = 0):
    """Wrap ``model`` in PEFT LoRA on the 7 projections with non-zero random ``lora_B``.

    PEFT initialises ``lora_B`` to zero, which makes the adapter a no-op and the ``lora_A`` gradients
    zero; random ``lora_B`` makes both loss and gradients depend on the adapter.
    """
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return peft_model
