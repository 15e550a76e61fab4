"""The flex and sdpa backends of the packed attention: document-causal masks built from ``cu_seqlens``
(block-sparse for flex, ``[T, T]`` for sdpa), once per batch, and the float32 path with attention
sinks (see :mod:`lightning_sloth.attention`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers.integrations.sdpa_attention import repeat_kv

from lightning_sloth.kernels.tracing import tensor_version

FLEX_BLOCK_SIZE = 128


def sink_gate(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``out * sigmoid(lse - sink)``: ``out [B, H, T, D]``, ``lse [B, H, T]``, sinks ``[H]``."""
    gate = torch.sigmoid(lse.float() - sinks.float()[:, None])
    return (out.float() * gate[..., None]).to(out.dtype)


def flex_packed(query, key, value, cu_seqlens, scaling, window, sinks=None, chunk=None) -> Tensor:
    seq_len = query.shape[2]
    block_mask = _MASKS.get(
        cu_seqlens,
        ("flex", seq_len, window, chunk),
        lambda: document_block_mask(
            chunked_segments(cu_seqlens, seq_len, chunk), seq_len, window, FLEX_BLOCK_SIZE
        ),
    )
    if query.is_cuda:
        attend = _compiled_flex_attention()
    else:
        # CPU flex is forward-only and refuses inputs that require grad even under no_grad.
        attend = flex_attention
        query, key, value = query.detach(), key.detach(), value.detach()
    extra = {} if sinks is None else {"return_aux": AuxRequest(lse=True)}
    out = attend(
        query,
        key,
        value,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        **extra,
    )
    if sinks is not None:
        # flex differentiates through the lse it returns (on CUDA), so autograd handles the gate.
        out, aux = out
        out = sink_gate(out, aux.lse, sinks)
    return out.transpose(1, 2).contiguous()


def sdpa_packed(
    query, key, value, cu_seqlens, scaling, window, sinks=None, chunk=None, max_len: int | None = None
) -> Tensor:
    """SDPA over a packed row with a document-causal mask: in query tiles (:func:`band_tiles`)
    where ``max_len`` (the longest document, a host int) makes the reach of a query short against
    the row, else one ``[T, T]`` mask. Returns ``[1, T, Hq, Dv]``."""
    seq_len = query.shape[2]
    reach = band_reach(seq_len, max_len, window, chunk)
    if reach is not None:
        return _sdpa_banded(query, key, value, cu_seqlens, scaling, window, sinks, chunk, *reach)
    mask = _MASKS.get(
        cu_seqlens,
        ("dense", seq_len, window, chunk),
        lambda: document_causal_mask(chunked_segments(cu_seqlens, seq_len, chunk), seq_len, window),
    )
    if sinks is not None:
        return attention_with_sinks(query, key, value, mask, scaling, sinks)
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous()


BAND_TILE_MULTIPLE = 64


def band_reach(
    seq_len: int, max_len: int | None, window: int | None, chunk: int | None
) -> tuple[int, int] | None:
    """``(tile, reach)`` for :func:`sdpa_packed`'s tiles, or None where one dense mask costs less.

    A query sees keys at most ``reach - 1`` positions back (its document, window or chunk piece is
    at most ``reach`` long), so a tile of ``tile`` queries needs the ``tile + reach`` keys that end
    with it. Tiles of ``reach`` rounded up to a multiple of 64 make ``2 T reach`` scores instead of
    ``T^2``; taken where that is at most half.
    """
    if max_len is None:
        return None
    reach = min(x for x in (max_len, window, chunk, seq_len) if x is not None)
    tile = -(-max(reach, 1) // BAND_TILE_MULTIPLE) * BAND_TILE_MULTIPLE
    tiles = -(-seq_len // tile)
    if tiles < 2 or tiles * tile * (tile + reach) > seq_len * seq_len // 2:
        return None
    return tile, reach


def band_tiles(cu_seqlens: Tensor, seq_len: int, window: int | None, tile: int, reach: int) -> Tensor:
    """``[n, 1, tile, tile + reach]`` bool masks of :func:`sdpa_packed`'s query tiles, True where
    query ``i`` of tile ``t`` (position ``t * tile + i``) may attend key ``j`` (position
    ``t * tile - reach + j``): same document, not later, inside the window. Positions before the
    row or past its end are padding: a padded query sees the padded keys up to itself (so no row
    is empty), and no real query sees padding."""
    tiles = -(-seq_len // tile)
    device = cu_seqlens.device
    doc = document_ids(cu_seqlens, seq_len).long()
    padded = tiles * tile
    doc = torch.cat([doc.new_full((reach,), -2), doc, doc.new_full((padded - seq_len,), -1)])
    starts = torch.arange(tiles, device=device)[:, None] * tile
    query_pos = starts + torch.arange(tile, device=device)  # [n, tile]
    key_pos = starts - reach + torch.arange(tile + reach, device=device)  # [n, tile + reach]
    distance = query_pos[:, :, None] - key_pos[:, None, :]
    query_doc, key_doc = doc[query_pos + reach], doc[key_pos + reach]
    keep = (query_doc[:, :, None] == key_doc[:, None, :]) & (distance >= 0)
    if window is not None:
        keep &= distance < window
    return keep[:, None]


def _windows(x: Tensor, tile: int, reach: int, tiles: int) -> Tensor:
    """``[1, H, T, D]`` -> ``[n, H, tile + reach, D]``: the keys (or values) each query tile reads."""
    seq_len = x.shape[2]
    x = F.pad(x, (0, 0, reach, tiles * tile - seq_len))
    return x.unfold(2, tile + reach, tile)[0].permute(1, 0, 3, 2)


def _sdpa_banded(query, key, value, cu_seqlens, scaling, window, sinks, chunk, tile, reach) -> Tensor:
    batch, heads, seq_len, _ = query.shape
    tiles = -(-seq_len // tile)
    mask = _MASKS.get(
        cu_seqlens,
        ("band", seq_len, window, chunk, tile, reach),
        lambda: band_tiles(chunked_segments(cu_seqlens, seq_len, chunk), seq_len, window, tile, reach),
    )
    queries = F.pad(query, (0, 0, 0, tiles * tile - seq_len))[0].unflatten(1, (tiles, tile)).transpose(0, 1)
    keys, values = _windows(key, tile, reach, tiles), _windows(value, tile, reach, tiles)
    if sinks is not None:
        out = attention_with_sinks(queries, keys, values, mask, scaling, sinks)  # [n, tile, H, Dv]
    else:
        groups = heads // key.shape[1]
        out = F.scaled_dot_product_attention(
            queries, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask, scale=scaling
        ).transpose(1, 2)
    return out.reshape(1, tiles * tile, heads, out.shape[-1])[:, :seq_len].contiguous()


@functools.cache
def _compiled_flex_attention() -> Callable:
    # Eager flex materializes the full score matrix; compiled it runs the block-sparse kernel.
    return torch.compile(flex_attention, dynamic=False)


def chunked_segments(cu_seqlens: Tensor, seq_len: int, chunk: int | None) -> Tensor:
    """The segments of ``cu_seqlens`` cut into pieces of ``chunk`` positions (chunked attention, Llama 4:
    a query sees the keys of its own piece only), built once per batch; ``cu_seqlens`` itself when
    ``chunk`` is None.

    Returns:
        ``[n + T // chunk + 1]`` bounds in the dtype of ``cu_seqlens`` (a piece starts where a segment
        starts and every ``chunk`` positions into it; unused entries at the end repeat ``T``, empty
        segments). A fixed length, so nothing is read on the host.
    """
    if chunk is None:
        return cu_seqlens
    return _MASKS.get(cu_seqlens, ("chunked", seq_len, chunk), lambda: _cut(cu_seqlens, seq_len, chunk))


def _cut(cu_seqlens: Tensor, seq_len: int, chunk: int) -> Tensor:
    positions = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    into_segment = (
        positions - cu_seqlens[document_ids(cu_seqlens, seq_len).clamp(max=cu_seqlens.shape[0] - 1)]
    )
    starts = torch.where(into_segment % chunk == 0, positions, seq_len)
    # At most one start per segment beyond its whole pieces: n + T // chunk starts in all.
    count = min(seq_len, cu_seqlens.shape[0] - 1 + seq_len // chunk)
    starts = torch.sort(starts).values[:count]
    return torch.cat([starts, starts.new_full((1,), seq_len)])


def document_ids(cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """Segment index of every position: ``[T]`` in the dtype of ``cu_seqlens``, on its device.

    Positions at or past ``cu_seqlens[-1]`` get index ``n`` (one more segment of their own).
    """
    positions = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def document_causal_mask(cu_seqlens: Tensor, seq_len: int, window: int | None = None) -> Tensor:
    """Dense ``[T, T]`` bool mask, True where query ``i`` may attend key ``j``.

    ``j <= i``, same document, and ``i - j < window`` when a sliding window is given.
    """
    doc = document_ids(cu_seqlens, seq_len)
    pos = torch.arange(seq_len, device=cu_seqlens.device)
    distance = pos[:, None] - pos[None, :]
    keep = (doc[:, None] == doc[None, :]) & (distance >= 0)
    if window is not None:
        keep &= distance < window
    return keep


def document_block_mask(
    cu_seqlens: Tensor, seq_len: int, window: int | None = None, block_size: int = FLEX_BLOCK_SIZE
) -> BlockMask:
    """FlexAttention ``BlockMask`` of :func:`document_causal_mask`, built at block granularity.

    Segments are contiguous, so a ``(query block i, key block j)`` tile is decided by the segments
    at the tile corners: it holds a visible pair iff ``j == i``, or ``j < i`` with block ``j``'s
    last segment equal to block ``i``'s first (and that closest pair inside the window); it is
    entirely visible iff ``j < i``, both blocks are complete, lie in one segment, and the farthest
    pair is inside the window. Only ``[T / block_size]^2`` tiles are touched, on the device.

    Args:
        cu_seqlens: ``[n + 1]`` int32/int64 segment boundaries.
        seq_len: packed length ``T``.
        window: transformers' sliding window (keys with ``q - k < window``), or ``None``.
        block_size: tile size of the mask (FlexAttention's default is 128).

    Returns:
        A ``BlockMask`` of shape ``(1, 1, T, T)`` broadcast over batch and heads.
    """
    doc = document_ids(cu_seqlens, seq_len)
    num_blocks = -(-seq_len // block_size)
    starts = torch.arange(num_blocks, device=doc.device) * block_size
    ends = (starts + block_size).clamp(max=seq_len) - 1
    first, last = doc[starts], doc[ends]
    q_blk, kv_blk = (
        torch.arange(num_blocks, device=doc.device)[:, None],
        torch.arange(num_blocks, device=doc.device),
    )
    below = kv_blk < q_blk
    touched = (kv_blk == q_blk) | (below & (last[None, :] == first[:, None]))
    complete = ends - starts == block_size - 1
    full = below & complete[:, None] & complete[None, :] & (first[None, :] == last[:, None])
    if window is not None:
        touched &= (starts[:, None] - ends[None, :] < window) | (kv_blk == q_blk)
        full &= ends[:, None] - starts[None, :] < window
    partial = touched & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    kv_num, kv_idx = _ordered_blocks(partial)
    full_num, full_idx = _ordered_blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


def _ordered_blocks(dense: Tensor) -> tuple[Tensor, Tensor]:
    """``[n, n]`` bool tiles -> (``[1, 1, n]`` counts, ``[1, 1, n, n]`` indices, selected ones first)."""
    dense = dense.to(torch.int32)
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), indices[None, None].contiguous()


def attention_with_sinks(query, key, value, mask, scaling, sinks) -> Tensor:
    """Attention with a sink logit column per head, as transformers' eager GPT-OSS attention.

    Args:
        query: ``[B, Hq, T, D]``; key, value: ``[B, Hkv, S, D]``.
        mask: bool (True = attend) or additive float, broadcastable to ``[B, Hq, T, S]``.
        scaling: softmax scale, ``1/sqrt(D)`` if ``None``.
        sinks: ``[Hq]`` logits of the sink column (its value is zero).

    Returns:
        ``[B, T, Hq, D]`` in ``query``'s dtype, computed in float32 (float64 for float64 inputs). A
        row with every key masked stays finite: all its weight goes to the sink.
    """
    groups = query.shape[1] // key.shape[1]
    dtype = torch.promote_types(query.dtype, torch.float32)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.to(dtype) @ repeat_kv(key, groups).to(dtype).transpose(-1, -2)) * scale
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    else:
        scores = scores + mask.to(dtype)
    sink_column = sinks.to(dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    out = probs @ repeat_kv(value, groups).to(dtype)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def causal_window_mask(
    q_len: int, window: int | None, device: torch.device, kv_len: int | None = None, chunk: int | None = None
) -> Tensor:
    """``[T, S]`` causal (sliding-window or chunked) mask for unpacked rows (built per call: an
    uncommon path).

    Queries are the last ``T`` of ``S`` positions: query ``i`` sits at ``i + S - T``. With ``chunk``,
    a query sees only keys of its own piece of ``chunk`` positions.
    """
    kv_len = q_len if kv_len is None else kv_len
    query_pos = torch.arange(q_len, device=device) + kv_len - q_len
    key_pos = torch.arange(kv_len, device=device)
    distance = query_pos[:, None] - key_pos
    keep = distance >= 0
    if window is not None:
        keep &= distance < window
    if chunk is not None:
        keep &= query_pos[:, None] // chunk == key_pos // chunk
    return keep


class _BatchMaskCache:
    """Masks of the current batch, keyed by the identity of its ``cu_seqlens`` tensor.

    transformers hands the same ``cu_seqlens`` object to every layer (and to the recompute of a
    checkpointed layer), so the first layer builds and the others reuse. Holding a reference keeps
    the object, hence its identity, alive: a new batch's tensor can never be mistaken for it even
    if the allocator reuses memory. In-place edits are caught by the tensor's version counter. The
    entry lives until a different ``cu_seqlens`` arrives.
    """

    def __init__(self) -> None:
        self._cu_seqlens: Tensor | None = None
        self._version = -1
        self._masks: dict = {}

    @torch.compiler.disable
    def get(self, cu_seqlens: Tensor, key: tuple, build: Callable[[], object]):
        version = tensor_version(cu_seqlens)  # validation's batches are inference tensors
        if cu_seqlens is not self._cu_seqlens or version != self._version:
            self._cu_seqlens, self._version, self._masks = cu_seqlens, version, {}
        # A mask built under inference_mode (validation) cannot be saved for a later backward.
        key = (*key, torch.is_inference_mode_enabled())
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def clear(self) -> None:
        self._cu_seqlens, self._version, self._masks = None, -1, {}


_MASKS = _BatchMaskCache()
