"""Packed causal attention ("sloth") for transformers models.

A packed batch lays several documents end to end in one row (``B == 1``) and describes the
boundaries with ``cu_seqlens``. transformers forwards ``cu_seq_lens_q/k`` and
``max_length_q/k`` from the model call to the attention function of every layer, so the
function registered here reads them and keeps each document to itself::

    cu_seqlens = [0, 3, 5, 8]          keys ->
                                 a a a b b c c c
                 queries   a0    x
                   |       a1    x x
                   v       a2    x x x
                           b0          x
                           b1          x x
                           c0              x
                           c1              x x
                           c2              x x x

Backends (:func:`set_packed_attention_backend`):

* ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention on CUDA, fp16/bf16).
  No metadata at all beyond ``cu_seqlens``. GQA without copying K/V heads
  (:func:`set_varlen_kv_repeat`): ``varlen_attn(enable_gqa=True)`` where the installed torch has
  it (2.13); else the flash varlen ops it wraps, called directly (:class:`_VarlenFlash`), since
  the flash kernel itself reads each K/V head for its group of query heads and its backward sums
  the group's ``dk``/``dv``. Repeating K/V heads (``[T, Hq, D]`` copies in the forward and
  recompute, a reduction in the backward) remains as the switched-off path. Heads wider than flash
  takes (over 256: Gemma 4's 512-dim global layers) run the memory-efficient kernel's varlen mode
  over the same ``cu_seqlens`` (:mod:`.efficient`: ``Σ len²`` scores instead of a ``[T, T]`` mask's
  ``T²``; no sliding window or sinks there, which keep such a layer on ``"sdpa"``).
* ``"flex"``: FlexAttention with a document-causal ``BlockMask``, built block-sparse straight from
  ``cu_seqlens`` (``O((T/128)^2)``, never a ``[T, T]`` mask) and compiled on CUDA. On CPU it runs
  forward only (torch has no CPU flex backward).
* ``"sdpa"``: ``scaled_dot_product_attention`` with a document-causal bool mask. Works everywhere,
  float32 included, forward and backward. Where the longest document (or window, or chunk) is short
  against the row, the queries go in tiles, each against only the keys its queries can reach
  (``[T / tile]`` masks of ``tile x (tile + reach)``: about ``2 T reach`` scores instead of ``T^2``);
  otherwise one ``[T, T]`` mask (``O(T^2)`` memory).
* ``"auto"`` (default): ``"varlen"`` where it can run (CUDA, fp16/bf16, head_dim a multiple of 8
  up to 256, or wider without a window or sinks), else ``"sdpa"``. An explicitly chosen backend
  that cannot serve an input (e.g. ``"varlen"`` with float32) falls back to ``"sdpa"`` with a
  warning, so every dtype stays correct.

Attention sinks (GPT-OSS, ``s_aux``): one learned logit per query head joins every softmax row
as an extra column whose value is zero, so a row may put weight on "nothing". With ``lse`` the
log-sum-exp of a row's scores that is ``out * sigmoid(lse - sink)``. Each backend applies it as
that gate on its own output:

* ``"varlen"``: torch's ``varlen_attn`` returns ``lse`` but drops its gradient, and ``q``/``k``
  depend on it. :class:`_VarlenWithSinks` calls the flash kernels itself and folds the ``lse``
  gradient into the backward's row term ``D = rowsum(dO * O)``: given the gated output and the
  gated ``dO``, the unmodified flash backward returns the exact ``dq``/``dk``/``dv``.
* ``"flex"``: FlexAttention returns ``lse`` and differentiates through it; autograd does the rest.
* ``"sdpa"`` (and unpacked rows): an explicit float32 (float64 for float64 inputs) math path with
  the sink as an extra logit column, as transformers' eager GPT-OSS attention computes it.

Sliding windows (GPT-OSS alternates sliding and full layers; the layer passes ``sliding_window``)
follow transformers: a query at position ``i`` sees keys ``j`` of its own document with
``i - window < j <= i``.

The flex and sdpa masks are built once per batch: :class:`_BatchMaskCache` keeps the masks of the
``cu_seqlens`` tensor it last saw (the same object reaches every layer, and the recompute of a
checkpointed layer), so layers 2..N reuse them. Everything is built with device ops from the
device ``cu_seqlens``: no ``.item()``, no ``.tolist()``, no device-to-host sync.

Design note — no ``AttentionMaskInterface`` entry for "sloth". transformers builds the 4-D mask
before the layers run, in ``create_causal_mask``. For an implementation it has a mask function
for, that step inspects ``position_ids`` to detect packing (``find_packed_sequence_indices``,
whose ``.all()`` check syncs the GPU) and then materializes a ``[B, 1, T, T]`` packed mask, on
every step, for a mask the packed backends never read. For an implementation without an entry it
returns ``None`` at once (transformers 5.17 and 5.23 alike), which is what we want for packed
batches. The price is paid on unpacked batches: a 2-D padding ``attention_mask`` is dropped, and
rows get plain causal attention. That is exact for the real tokens of right-padded rows (causal
attention never looks ahead to the padding) but wrong for left padding, so generation with
left-padded prompts should switch back with ``model.set_attn_implementation("sdpa")``. A 4-D
mask passed by the caller still reaches the function and is honoured. Packing signalled only by
restarting ``position_ids`` (without ``cu_seq_lens``) is not detected: pass ``cu_seq_lens_q/k``.

Chunked attention (Llama 4's ``"chunked_attention"`` layers, read from the calling module's config
and ``layer_idx``) cuts every document into pieces of ``attention_chunk_size`` positions: the varlen
backend runs on those pieces' bounds (a fixed-length ``cu_seqlens`` built once per batch on the
device), flex and sdpa build their masks from them. Llama 4's temperature-tuned NoPE layers scale
queries by their position in the row; a packed row rescales them to positions in the document.

Rooms: :mod:`.packed` (the registered function: argument checks, backend choice, unpacked rows),
:mod:`.varlen` (the flash varlen backend, GQA and sinks), :mod:`.efficient` (its heads wider
than flash takes), :mod:`.masked` (the flex and sdpa backends, their document masks and the
per-batch mask cache), :mod:`.width` (the attention width of a config, for FLOP counts).
"""

from lightning_sloth.attention.masked import (
    FLEX_BLOCK_SIZE,
    document_block_mask,
    document_causal_mask,
    document_ids,
)
from lightning_sloth.attention.packed import (
    ATTENTION_NAME,
    BACKENDS,
    enable_packed_attention,
    get_packed_attention_backend,
    register_sloth_attention,
    set_packed_attention_backend,
    sloth_attention_forward,
)
from lightning_sloth.attention.varlen import get_varlen_kv_repeat, set_varlen_kv_repeat
from lightning_sloth.attention.width import attention_width

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "FLEX_BLOCK_SIZE",
    "attention_width",
    "document_block_mask",
    "document_causal_mask",
    "document_ids",
    "enable_packed_attention",
    "get_packed_attention_backend",
    "get_varlen_kv_repeat",
    "register_sloth_attention",
    "set_packed_attention_backend",
    "set_varlen_kv_repeat",
    "sloth_attention_forward",
]
