"""The "sloth" attention function transformers calls in every layer: argument checks, the choice of
backend per call, and rows without packing (see :mod:`lightning_sloth.attention`)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lightning_sloth.attention.efficient import efficient_packed, efficient_usable
from lightning_sloth.attention.masked import (
    attention_with_sinks,
    causal_window_mask,
    chunked_segments,
    document_ids,
    flex_packed,
    sdpa_packed,
)
from lightning_sloth.attention.varlen import varlen_packed, varlen_usable

ATTENTION_NAME = "sloth"
BACKENDS = ("auto", "varlen", "flex", "sdpa")

_backend = "auto"


def set_packed_attention_backend(backend: str) -> None:
    """Choose the kernel behind packed batches, process-wide.

    Args:
        backend: one of ``"auto"``, ``"varlen"``, ``"flex"``, ``"sdpa"`` (see the module docstring).
    """
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {backend!r}; choose one of {BACKENDS}")
    _backend = backend


def get_packed_attention_backend() -> str:
    """The backend chosen with :func:`set_packed_attention_backend` (``"auto"`` by default)."""
    return _backend


def register_sloth_attention() -> None:
    """Register :func:`sloth_attention_forward` as ``"sloth"`` in transformers' ``AttentionInterface``.

    Idempotent. No ``AttentionMaskInterface`` entry is registered, on purpose (module docstring).
    """
    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not sloth_attention_forward:
        AttentionInterface.register(ATTENTION_NAME, sloth_attention_forward)


def enable_packed_attention(model: torch.nn.Module, backend: str | None = None) -> None:
    """Switch a transformers model (plain or PEFT-wrapped) to the "sloth" attention, in place.

    Sets ``config.use_cache = False``: with a cache transformers ignores the packing metadata.

    Args:
        model: a ``PreTrainedModel`` or a PEFT ``PeftModel`` around one.
        backend: if given, also calls :func:`set_packed_attention_backend` with it.

    Raises:
        TypeError: ``model`` holds no ``PreTrainedModel``.
        RuntimeError: the model class cannot change its attention implementation at runtime.
    """
    if backend is not None:
        set_packed_attention_backend(backend)
    register_sloth_attention()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            f"enable_packed_attention needs a transformers PreTrainedModel (or a PEFT model around one), "
            f"got {type(model).__name__}"
        )
    base.set_attn_implementation(ATTENTION_NAME)
    if base.config._attn_implementation != ATTENTION_NAME:
        raise RuntimeError(
            f"{type(base).__name__} kept attention implementation {base.config._attn_implementation!r}: "
            "its modeling code does not dispatch through transformers' AttentionInterface"
        )
    base.config.use_cache = False


def sloth_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention for transformers' ``AttentionInterface``: packed when ``cu_seq_lens_q`` is given.

    Args:
        module: the calling attention layer (read for ``is_causal`` and ``num_key_value_groups``).
        query: ``[B, Hq, T, D]``.
        key: ``[B, Hkv, S, D]`` with ``Hq % Hkv == 0`` (GQA); ``S == T`` when packed.
        value: ``[B, Hkv, S, D]``.
        attention_mask: ``None`` (no mask function is registered for "sloth") or a caller's 4-D mask,
            honoured on unpacked batches only.
        dropout: attention dropout probability; packed batches support only ``0.0``.
        scaling: softmax scale, ``1/sqrt(D)`` if ``None``.
        **kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``[n + 1]`` int32/int64 document boundaries,
            the last equal to ``T``), ``max_length_q`` / ``max_length_k`` (Python ints, at least the
            longest document), ``sliding_window`` (int or ``None``), ``s_aux`` (GPT-OSS attention
            sinks, ``[Hq]``, or ``None``); the rest goes to transformers' SDPA on unpacked batches.
            A chunked-attention layer (Llama 4, read from the module's config and ``layer_idx``)
            cuts every document into pieces of ``config.attention_chunk_size`` positions.

    Returns:
        ``(attn_output, None)`` with ``attn_output`` ``[B, T, Hq, D]`` in the dtype of ``query`` (the
        autocast dtype on packed batches under autocast, as SDPA would give).

    Raises:
        ValueError: malformed packing metadata (missing ``max_length_q``, ``B != 1``, a mask given
            with ``cu_seq_lens_q``, ``cu_seqlens`` not covering the row, ...) or sinks that are not
            one value per query head.
        NotImplementedError: dropout, softcapping or non-causal attention on a packed batch.
    """
    _reject_unsupported(kwargs)
    _check_sinks(kwargs.get("s_aux"), query.shape[1])
    cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
    if cu_seqlens is None:
        return _unpacked_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    return _packed_attention(module, query, key, value, attention_mask, dropout, scaling, cu_seqlens, kwargs)


def _reject_unsupported(kwargs: dict) -> None:
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("sloth attention does not support attention logit softcapping (softcap)")


def _check_sinks(sinks, heads_q: int) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or sinks.shape != (heads_q,) or not sinks.is_floating_point():
        shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(
            f"attention sinks (s_aux) must be a floating tensor of one logit per query head [{heads_q}], got {shape}"
        )


def _unpacked_attention(
    module, query, key, value, attention_mask, dropout, scaling, kwargs
) -> tuple[Tensor, None]:
    """Ordinary rows: transformers' own SDPA, causal through ``is_causal`` (plus a window if any)."""
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    window = kwargs.pop("sliding_window", None)
    sinks = kwargs.pop("s_aux", None)
    q_len, kv_len = query.shape[2], key.shape[2]
    chunk = attention_chunk(module)
    if chunk is not None and attention_mask is None and kv_len > chunk:
        if q_len != kv_len:
            raise NotImplementedError(
                "sloth attention: chunked attention with a KV cache is not supported; "
                'use model.set_attn_implementation("sdpa") for generation'
            )
        attention_mask = causal_window_mask(q_len, window, query.device, chunk=chunk)
    if sinks is not None:
        if dropout > 0.0:
            raise NotImplementedError(
                f"sloth attention with sinks does not support attention dropout (got {dropout}); "
                "set config.attention_dropout = 0.0"
            )
        if attention_mask is None:
            attention_mask = causal_window_mask(q_len, window, query.device, kv_len)
        query, key, value = _autocast_inputs(query, key, value)
        return attention_with_sinks(query, key, value, attention_mask, scaling, sinks), None
    if attention_mask is None and window is not None and kv_len > window:
        if q_len != kv_len:
            raise NotImplementedError(
                "sloth attention: sliding-window attention with a KV cache is not supported; "
                'use model.set_attn_implementation("sdpa") for generation'
            )
        attention_mask = causal_window_mask(q_len, window, query.device)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _packed_attention(
    module, query, key, value, attention_mask, dropout, scaling, cu_seqlens, kwargs
) -> tuple[Tensor, None]:
    batch, heads_q, seq_len, head_dim = query.shape
    heads_kv = key.shape[1]
    if batch != 1:
        raise ValueError(
            f"packed attention (cu_seq_lens_q given) needs batch size 1, got query of shape {tuple(query.shape)}"
        )
    if key.shape[2] != seq_len or value.shape[2] != seq_len:
        raise ValueError(
            f"packed attention needs keys as long as queries, got {key.shape[2]} keys for {seq_len} queries"
        )
    if heads_q % heads_kv != 0:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if attention_mask is not None:
        raise ValueError("packed attention takes no attention_mask: documents are separated by cu_seq_lens_q")
    if dropout > 0.0:
        raise NotImplementedError(
            f"sloth packed attention does not support attention dropout (got {dropout}); "
            "set config.attention_dropout = 0.0"
        )
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise NotImplementedError("sloth packed attention is document-causal only; this layer is not causal")
    max_q = _host_int(kwargs.get("max_length_q"), "max_length_q")
    max_k = _host_int(kwargs.get("max_length_k", max_q), "max_length_k")
    cu_seqlens_k = kwargs.get("cu_seq_lens_k")
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    _check_cu_seqlens(cu_seqlens, seq_len, "cu_seq_lens_q")
    if cu_seqlens_k is not cu_seqlens:
        _check_cu_seqlens(cu_seqlens_k, seq_len, "cu_seq_lens_k")
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    chunk = attention_chunk(module)
    if chunk is not None and max(max_q, max_k) <= chunk:
        chunk = None  # no document is longer than a piece: plain document-causal attention
    if chunk is not None and cu_seqlens_k is not cu_seqlens:
        raise NotImplementedError(
            "sloth packed attention: chunked attention needs cu_seq_lens_k == cu_seq_lens_q"
        )

    query = _document_temperature(module, query, cu_seqlens, seq_len)
    query, key, value = _autocast_inputs(query, key, value)
    # Heads wider than flash takes run the memory-efficient kernel's varlen mode (no window, no sinks).
    wide = window is None and sinks is None and efficient_usable(query)
    backend = _resolve_backend(query, key, value, wide)
    value_dim = value.shape[-1]
    if backend == "varlen" and chunk is not None:
        cu_seqlens = cu_seqlens_k = chunked_segments(cu_seqlens, seq_len, chunk)
        max_q = max_k = chunk
    if backend == "varlen" and wide:
        out = efficient_packed(query, key, value, cu_seqlens, cu_seqlens_k, max_q, max_k, scaling)
    elif backend == "varlen":
        if value_dim < head_dim:
            # MLA (DeepSeek-V3): values narrower than queries/keys. The flash kernel takes one head
            # size; zero columns added to V leave the first value_dim output columns and every
            # gradient unchanged, and the extra output columns are dropped.
            value = torch.nn.functional.pad(value, (0, head_dim - value_dim))
        out = varlen_packed(query, key, value, cu_seqlens, cu_seqlens_k, max_q, max_k, scaling, window, sinks)
        out = out[..., :value_dim] if value_dim < head_dim else out
    elif backend == "flex":
        out = flex_packed(query, key, value, cu_seqlens, scaling, window, sinks, chunk)
    else:
        out = sdpa_packed(query, key, value, cu_seqlens, scaling, window, sinks, chunk, max(max_q, max_k))
    return out, None


def _document_temperature(module: torch.nn.Module, query: Tensor, cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """Llama 4's temperature-tuned NoPE layers scale each query by ``1 + attn_scale * log1p(floor((p +
    1) / floor_scale))`` of its position ``p`` in the *row* (``arange`` in the layer's forward); a
    document run alone has ``p`` counted from its own start. Rescale by the ratio of the two, on the
    device, so a packed row equals its documents run alone (positions ``p < floor_scale - 1`` are
    scaled by 1 either way: rows shorter than ``floor_scale`` are left as they are).
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor_scale, attn_scale = module.floor_scale, module.attn_scale
    if seq_len < floor_scale:
        return query
    row = torch.arange(seq_len, device=query.device, dtype=torch.float32)
    start = cu_seqlens[document_ids(cu_seqlens, seq_len).clamp(max=cu_seqlens.shape[0] - 1)].to(torch.float32)

    def temperature(position: Tensor) -> Tensor:
        return torch.log1p(torch.floor((position + 1.0) / floor_scale)) * attn_scale + 1.0

    ratio = temperature(row - start) / temperature(row)
    return (query.to(torch.float32) * ratio[:, None]).to(query.dtype)


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The piece length of a chunked-attention layer (``config.layer_types[layer_idx] ==
    "chunked_attention"``, Llama 4: ``config.attention_chunk_size``), else None."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not layer_types or not isinstance(index, int) or index >= len(layer_types):
        return None
    if layer_types[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _host_int(value, name: str) -> int:
    """A Python int from ``max_length_*`` without reading device memory."""
    if value is None:
        raise ValueError(
            f"packed attention needs {name} (the longest document, a Python int) next to cu_seq_lens_q/k; "
            "PackedBatch.model_inputs() passes both"
        )
    if isinstance(value, Tensor) and value.device.type != "cpu":
        raise TypeError(
            f"{name} must be a Python int, not a {value.device.type} tensor (reading it would sync the device)"
        )
    return int(value)


def _check_cu_seqlens(cu_seqlens: Tensor, seq_len: int, name: str) -> None:
    """Shape and dtype always; values only for host tensors in eager mode (reading device values would sync)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must be a 1-D tensor [num_segments + 1], got {cu_seqlens!r}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    on_host = cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_host and (cu_seqlens[0] != 0 or cu_seqlens[-1] != seq_len or bool((cu_seqlens.diff() < 0).any())):
        raise ValueError(
            f"{name} must rise from 0 to the packed length {seq_len} (padding is one more segment), "
            f"got {cu_seqlens.tolist()}"
        )


def _autocast_inputs(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cast to the autocast dtype, as autocast does for SDPA (varlen and flex have no autocast rule).

    Under bf16-mixed, rotary embeddings leave q/k in float32 while v is bf16; without this cast the
    packed batch would miss the bf16 kernels.
    """
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    return query, key, value


def _resolve_backend(query: Tensor, key: Tensor, value: Tensor, wide: bool = False) -> str:
    head_dim = query.shape[-1]
    varlen_ok = varlen_usable(query) or wide
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    flex_ok = query.is_cuda or not needs_grad
    if _backend == "auto":
        return "varlen" if varlen_ok else "sdpa"
    if (_backend == "varlen" and not varlen_ok) or (_backend == "flex" and not flex_ok):
        warnings.warn(
            f'packed attention backend "{_backend}" cannot run on {query.device.type} {query.dtype} '
            f'(head_dim {head_dim}, grad {needs_grad}); using "sdpa" with a block-diagonal mask',
            stacklevel=3,
        )
        return "sdpa"
    return _backend
