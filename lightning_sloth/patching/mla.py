"""The DeepSeek-V3 attention forward for packed rows: multi-head latent attention (MLA) with q, k and v
built in the layout the flash varlen kernel reads.

transformers' ``DeepseekV3Attention.forward`` lays q/k/v out ``[1, H, T, D]``: a ``cat`` of the query's
unrotated and rotated parts, a new key tensor with the shared rotary key copied into every head, and
the values a view of ``kv_b_proj``'s output. The packed attention's flash path then pads the values to
the query/key head size (the kernel takes one head size), copies each of the three to ``[T, H, D]``,
slices the output back to the value width, and transformers makes that slice contiguous for
``o_proj``. The layout copies one layer writes, in ``[T, H, n + r]`` tensors (DeepSeek-V3's head
dims, eager, counted by ``tests/test_mla.py`` against transformers 5.24):

=============================  =======================================  ==============================
pass                           transformers + packed attention          this forward
=============================  =======================================  ==============================
forward (and recompute)        7.08: q cat, k build, v pad, the three   3.75: q, k, v (one ``cat``
                               ``[T, H, D]`` copies, output slice copy  each), output slice copy
backward                       8.77: output slice gradient, q's and     3.44: output gradient padded,
                               kv's gradients out of the cats, pads     q's gradient, kv's gradient
                               and head-major transposes                (one write each)
=============================  =======================================  ==============================

The four forward writes are the fewest the kernel allows: the query's rotary columns change, the key
repeats one head's rotary part in every head, the values need zero columns, and ``o_proj`` reads the
first ``v`` columns of each head of a ``[T, H, D]`` output. The q/k/v assembly is
:mod:`lightning_sloth.ops.mla` (plain-torch autograd Functions: Inductor fuses each into one pass
under ``torch.compile``).

Which calls take it: a packed call (``cu_seq_lens_q`` given, no cache, no mask, no attention dropout
in training, interleaved rotary, batch 1) of a model on the "sloth" attention. The ``[T, H, D]``
tensors go, as ``[1, H, T, D]`` views, to the "sloth" attention function, which checks the packing
metadata and picks the backend; its flash varlen path reads them in place (no further copy). Where
it will pick flash (``"auto"`` or ``"varlen"``, CUDA, fp16/bf16) the values are written zero-padded
to the query/key width; for its sdpa or flex backend (float32 included, so the CPU tests run this
forward too) at their own width. Every other call runs transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_sloth.attention import ATTENTION_NAME, get_packed_attention_backend, sloth_attention_forward
from lightning_sloth.attention.varlen import varlen_usable
from lightning_sloth.ops.mla import interleaved_rope, mla_key_value, mla_output, mla_query
from lightning_sloth.patching._forwards import _op_forward

__all__ = ["mla_attention_fits", "mla_attention_forward"]

_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_SIZES = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "scaling")
_UNSUPPORTED = ("cache", "past_key_values", "s_aux", "sliding_window", "softcap")


def mla_attention_fits(module: nn.Module) -> bool:
    """Whether ``module`` is the MLA :func:`mla_attention_forward` reproduces: DeepSeek-V3's
    projections and sizes, with the interleaved rotary (``config.rope_interleave``)."""
    config = getattr(module, "config", None)
    query = "q_proj" if getattr(module, "q_lora_rank", None) is None else "q_b_proj"
    return (
        getattr(config, "rope_interleave", False) is True
        and isinstance(getattr(module, query, None), nn.Module)
        and all(isinstance(getattr(module, part, None), nn.Module) for part in _PARTS)
        and all(hasattr(module, size) for size in _SIZES)
    )


@_op_forward("mla")
def mla_attention_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any):
    """``DeepseekV3Attention.forward`` for packed rows (module docstring); transformers' forward for
    every other call.

    Args:
        hidden_states: ``[1, T, hidden]``.
        **kwargs: as transformers' decoder layer passes them: ``position_embeddings`` (``cos``,
            ``sin``, ``[1, T, r]``), ``attention_mask`` (None), ``cu_seq_lens_q/k``,
            ``max_length_q/k`` (Python ints) and the rest, handed to the attention function.

    Returns:
        ``(o_proj output [1, T, hidden], None)``.
    """
    if args or not _packed_call(self, hidden_states, kwargs):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return _packed_forward(self, hidden_states, **kwargs)


def _packed_call(self: nn.Module, hidden_states: Tensor, kwargs: dict[str, Any]) -> bool:
    cos = (kwargs.get("position_embeddings") or (None,))[0]
    return (
        kwargs.get("cu_seq_lens_q") is not None
        and self.config._attn_implementation == ATTENTION_NAME
        and self.config.rope_interleave is True
        and kwargs.get("attention_mask") is None
        and all(kwargs.get(name) is None for name in _UNSUPPORTED)
        and not kwargs.get("output_attentions")
        and not (self.training and self.attention_dropout > 0.0)
        and hidden_states.dim() == 3
        and hidden_states.shape[0] == 1
        and isinstance(cos, Tensor)
        and cos.shape == (1, hidden_states.shape[1], self.qk_rope_head_dim)
    )


def _packed_forward(
    self: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], **kwargs: Any
) -> tuple[Tensor, None]:
    for name in ("attention_mask", *_UNSUPPORTED):
        kwargs.pop(name, None)
    tokens = hidden_states.shape[1]
    heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
    value_dim = self.v_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, rope], dim=-1)
    kv = self.kv_b_proj(self.kv_a_layernorm(kv_nope)).reshape(tokens, heads, nope + value_dim)
    cos, sin = position_embeddings[0][0], position_embeddings[1][0]
    k_rot = interleaved_rope(k_rot.reshape(tokens, 1, rope), cos, sin)[:, 0]
    query = mla_query(q.reshape(tokens, heads, nope + rope), cos, sin, nope)

    # The flash kernel takes one head size: where the packed attention will run it, the values are
    # written zero-padded to the query/key width (and the output's first v columns kept), else at
    # their own width. Either way the "sloth" attention function checks the metadata and runs it.
    flash = get_packed_attention_backend() in ("auto", "varlen") and varlen_usable(query)
    key, value = mla_key_value(kv, k_rot, nope, nope + rope if flash else value_dim)
    views = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, H, T, D]
    out, _ = sloth_attention_forward(self, *views, None, dropout=0.0, scaling=self.scaling, **kwargs)
    out = mla_output(out[0], value_dim)  # [T, H, W] -> [T, H * v]
    return self.o_proj(out.unsqueeze(0)), None
