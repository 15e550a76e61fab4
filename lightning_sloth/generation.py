"""Greedy generation from a model prepared for packed training.

Training assumes packed rows: ``config.use_cache = False`` and the "sloth" attention, which reads
``cu_seq_lens_*`` and ignores a KV cache. Generation needs the opposite, so
:func:`generation_mode` steps those aside (a standard attention, the cache on, eval mode, no
gradients) and puts them back afterwards. Activation checkpointing needs nothing: transformers
only checkpoints layers in training mode. Kernel-patched forwards stay (they do not assume packing).

The samples callback (``lightning_sloth.plugins.samples``) and ``lightning-sloth-generate``
(:mod:`lightning_sloth.generate`) both generate through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lightning_sloth.attention import ATTENTION_NAME
from lightning_sloth.hf_model import find_hf_model

#: Attention used while generating when the model trains with the packed "sloth" attention; models
#: without an SDPA path (GPT-OSS: attention sinks) generate with their eager attention.
GENERATION_ATTENTION = "sdpa"


def _generation_attention(hf: nn.Module) -> str:
    return GENERATION_ATTENTION if getattr(hf, "_supports_sdpa", False) else "eager"


@contextmanager
def generation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Ready ``model`` (plain, PEFT-wrapped or inside a LightningModule) for cached generation.

    Inside the block: eval mode, ``torch.no_grad``, ``config.use_cache = True`` and, if the model
    uses the packed "sloth" attention, :data:`GENERATION_ATTENTION` instead (eager for a model
    without SDPA). On exit every one of
    them is put back as it was, also when generation raises.
    """
    hf = find_hf_model(model)
    was_training = model.training
    attention = hf.config._attn_implementation
    use_cache = hf.config.use_cache
    model.eval()
    try:
        if attention == ATTENTION_NAME:
            hf.set_attn_implementation(_generation_attention(hf))
        hf.config.use_cache = True
        with torch.no_grad():
            yield model
    finally:
        if attention == ATTENTION_NAME:
            hf.set_attn_implementation(ATTENTION_NAME)
        hf.config.use_cache = use_cache
        model.train(was_training)


def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    eos_token_id: int | None,
    max_new_tokens: int = 64,
    use_cache: bool = True,
) -> list[list[int]]:
    """Greedy continuations of token-id prompts, one prompt at a time (no padding involved).

    Args:
        model: a transformers causal LM (plain or PEFT-wrapped); call inside :func:`generation_mode`
            when it was prepared for packed training.
        prompts: token ids of each prompt, special tokens included (``bos`` as in training).
        eos_token_id: generation of a prompt stops after this id (it is not returned).
        max_new_tokens: most tokens generated per prompt.
        use_cache: decode with the KV cache (``False`` recomputes the whole prefix every token).

    Returns:
        The generated ids of every prompt, without the prompt and without ``eos``.
    """
    device = next(model.parameters()).device
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=use_cache,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )[0, input_ids.shape[1] :].tolist()
        if eos_token_id is not None and eos_token_id in generated:
            generated = generated[: generated.index(eos_token_id)]
        outputs.append(generated)
    return outputs


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a plain prompt as the data pipeline builds them: ``bos`` (if any) + the text."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else ids
