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
  recompute, a reduction in the backward) remains as the switched-off path.
* ``"flex"``: FlexAttention with a document-causal ``BlockMask``, built block-sparse straight from
  ``cu_seqlens`` (``O((T/128)^2)``, never a ``[T, T]`` mask) and compiled on CUDA. On CPU it runs
  forward only (torch has no CPU flex backward).
* ``"sdpa"``: ``scaled_dot_product_attention`` with a ``[T, T]`` block-diagonal causal bool mask.
  Works everywhere, float32 included, forward and backward; ``O(T^2)`` memory.
* ``"auto"`` (default): ``"varlen"`` where it can run (CUDA, fp16/bf16, head_dim a multiple of 8
  up to 256), else ``"sdpa"``. An explicitly chosen backend that cannot serve an input (e.g.
  ``"varlen"`` with float32) falls back to ``"sdpa"`` with a warning, so every dtype stays correct.

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

One file past 500 lines on purpose: the backends share the argument checks, the per-batch mask
cache and the sink gate, and each is a few lines once those are in one place.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without varlen_attn: the "varlen" backend is unavailable
    varlen_attn = None

ATTENTION_NAME = "sloth"
BACKENDS = ("auto", "varlen", "flex", "sdpa")
FLEX_BLOCK_SIZE = 128

# torch 2.13 added ``enable_gqa`` to varlen_attn; torch 2.11 needs K/V heads repeated.
_VARLEN_HAS_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters

_backend = "auto"
_kv_repeat = False  # GQA without the K/V copy (set_varlen_kv_repeat(True) restores the copy)


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


def set_varlen_kv_repeat(repeat: bool) -> None:
    """Process-wide: repeat K/V heads for GQA in the ``"varlen"`` backend (``True`` copies them to
    one per query head first, as torch 2.11's ``varlen_attn`` alone needs; ``False``, the default,
    lets the flash kernel read the shared heads in place). Both give the same attention (GPU
    parity tests); the copy stays as the ablation's switched-off path."""
    global _kv_repeat
    if not isinstance(repeat, bool):
        raise TypeError(f"set_varlen_kv_repeat takes a bool, got {repeat!r}")
    _kv_repeat = repeat


def get_varlen_kv_repeat() -> bool:
    """Whether the ``"varlen"`` backend repeats K/V heads (:func:`set_varlen_kv_repeat`)."""
    return _kv_repeat


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
    if sinks is not None:
        if dropout > 0.0:
            raise NotImplementedError(
                f"sloth attention with sinks does not support attention dropout (got {dropout}); "
                "set config.attention_dropout = 0.0"
            )
        if attention_mask is None:
            attention_mask = _causal_window_mask(q_len, window, query.device, kv_len)
        query, key, value = _autocast_inputs(query, key, value)
        return _attention_with_sinks(query, key, value, attention_mask, scaling, sinks), None
    if attention_mask is None and window is not None and kv_len > window:
        if q_len != kv_len:
            raise NotImplementedError(
                "sloth attention: sliding-window attention with a KV cache is not supported; "
                'use model.set_attn_implementation("sdpa") for generation'
            )
        attention_mask = _causal_window_mask(q_len, window, query.device)
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

    query, key, value = _autocast_inputs(query, key, value)
    backend = _resolve_backend(query, key, value)
    if backend == "varlen":
        out = _varlen(query, key, value, cu_seqlens, cu_seqlens_k, max_q, max_k, scaling, window, sinks)
    elif backend == "flex":
        out = _flex(query, key, value, cu_seqlens, scaling, window, sinks)
    else:
        out = _sdpa_masked(query, key, value, cu_seqlens, scaling, window, sinks)
    return out, None


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


def _resolve_backend(query: Tensor, key: Tensor, value: Tensor) -> str:
    head_dim = query.shape[-1]
    varlen_ok = (
        varlen_attn is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )
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


def _to_varlen_layout(x: Tensor, repeats: int) -> Tensor:
    """``[1, H, T, D]`` -> ``[T, H * repeats, D]`` (kv head ``h`` serves query heads ``h*repeats ..``).

    A view where the projections' ``[1, T, H, D]`` memory allows (``squeeze``, not ``x[0]``: the
    backward of an index builds a zero tensor of x's shape, H-major, and copies the gradient into
    it, so every later gradient on the way back to the projection would need a copy of its own).
    """
    x = x.squeeze(0).transpose(0, 1)
    if repeats > 1:
        seq_len, heads, head_dim = x.shape
        x = (
            x[:, :, None, :]
            .expand(seq_len, heads, repeats, head_dim)
            .reshape(seq_len, heads * repeats, head_dim)
        )
    return x.contiguous()


def _varlen(
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scaling, window, sinks=None
) -> Tensor:
    groups = query.shape[1] // key.shape[1]
    extra = {}
    # The direct flash path covers GQA on a torch whose varlen_attn has no enable_gqa.
    direct_gqa = False
    if groups > 1 and not _kv_repeat:
        if _VARLEN_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            direct_gqa = True
        groups = 1
    # transformers' sliding window W keeps keys with q - k < W, i.e. W - 1 to the left.
    window_left = -1 if window is None else window - 1
    q, k, v = _to_varlen_layout(query, 1), _to_varlen_layout(key, groups), _to_varlen_layout(value, groups)
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(torch.int32)
    # Dynamo refuses an autograd.Function given one tensor twice: None stands for "cu_k is cu_q".
    cu_k_arg = None if cu_k is cu_q else cu_k
    if sinks is not None:
        out = _VarlenWithSinks.apply(q, k, v, sinks, cu_q, cu_k_arg, max_q, max_k, scaling, window_left)
    elif direct_gqa:
        out = _VarlenFlash.apply(q, k, v, cu_q, cu_k_arg, max_q, max_k, scaling, window_left)
    else:
        out = varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(window_left, 0), **extra
        )
    return out.unsqueeze(0)


def _flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):
    """Flash varlen forward on ``[T, H, D]``: ``(out, lse [Hq, T] float32, rng_state, unused)``."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        window_left < 0,
        False,
        scale=scale,
        window_size_left=window_left,
        window_size_right=0,
    )
    return out, lse, rng_state, unused


def _flash_varlen_backward(
    grad, q, k, v, out, lse, rng_state, unused, cu_q, cu_k, max_q, max_k, scale, window_left
):
    """Flash varlen backward: ``(dq, dk, dv)``; ``out`` only enters its row term ``rowsum(grad * out)``."""
    return torch.ops.aten._flash_attention_backward(
        grad,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        window_left < 0,
        rng_state,
        unused,
        scale=scale,
        window_size_left=window_left,
        window_size_right=0,
    )


class _VarlenFlash(torch.autograd.Function):
    """Flash varlen attention on ``[T, H, D]`` with ``Hkv`` dividing ``Hq``, K/V not repeated.

    The same two flash ops ``varlen_attn`` wraps; only its Python-side check for equal head counts
    is left out. The forward kernel maps query head ``h`` to K/V head ``h // (Hq / Hkv)`` and the
    backward returns ``dk``/``dv`` with ``Hkv`` heads (each summed over its group of query heads).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):
        cu_k = cu_q if cu_k is None else cu_k
        out, lse, rng_state, unused = _flash_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left
        )
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, window_left)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, rng_state, unused, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _flash_varlen_backward(
            grad.contiguous(), q, k, v, out, lse, rng_state, unused, cu_q, cu_k, *ctx.args
        )
        return dq, dk, dv, None, None, None, None, None, None


class _VarlenWithSinks(torch.autograd.Function):
    """Flash varlen attention with per-head sinks: ``[T, Hq, D]`` in and out, sinks ``[Hq]``.

    Forward: ``o = out * w`` with ``w = sigmoid(lse - sink)`` in float32. Backward, ``g = dL/do``:

    * ``dL/dsink = -sum_t (g . o) (1 - w)``;
    * ``dL/dlse = (g . o) (1 - w)`` reaches every score of the row as ``p_ij * dL/dlse``. The flash
      backward computes ``ds_ij = p_ij (g'_i . v_j - D_i)`` with ``D_i = g'_i . out'_i`` from the
      ``(g', out')`` it is handed. Handing it ``(g * w, o)`` gives ``D_i = w^2 (g . out)``, which is
      exactly ``w (g . out) - dL/dlse``: the ``lse`` gradient without a kernel of our own.

    torch's ``varlen_attn`` returns ``lse`` but its backward ignores the ``lse`` gradient, hence the
    direct calls to the flash ops it wraps. Nothing here reads device memory on the host.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, window_left):
        cu_k = cu_q if cu_k is None else cu_k
        out, lse, rng_state, unused = _flash_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left
        )
        if lse.dim() != 2:
            raise NotImplementedError(
                f"sloth attention sinks need the flash varlen log-sum-exp as [heads, tokens], got {tuple(lse.shape)}"
            )
        gate = torch.sigmoid(lse.transpose(0, 1) - sinks.float())
        gated = (out.float() * gate[..., None]).to(out.dtype)
        ctx.save_for_backward(q, k, v, gated, lse, gate, rng_state, unused, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, window_left)
        ctx.sinks_dtype = sinks.dtype
        return gated

    @staticmethod
    def backward(ctx, grad):
        q, k, v, gated, lse, gate, rng_state, unused, cu_q, cu_k = ctx.saved_tensors
        grad32 = grad.float()
        dsinks = -((grad32 * gated.float()).sum(-1) * (1.0 - gate)).sum(0)
        grad_out = (grad32 * gate[..., None]).to(grad.dtype).contiguous()
        dq, dk, dv = _flash_varlen_backward(
            grad_out, q, k, v, gated, lse, rng_state, unused, cu_q, cu_k, *ctx.args
        )
        return dq, dk, dv, dsinks.to(ctx.sinks_dtype), None, None, None, None, None, None


def _sink_gate(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``out * sigmoid(lse - sink)``: ``out [B, H, T, D]``, ``lse [B, H, T]``, sinks ``[H]``."""
    gate = torch.sigmoid(lse.float() - sinks.float()[:, None])
    return (out.float() * gate[..., None]).to(out.dtype)


def _flex(query, key, value, cu_seqlens, scaling, window, sinks=None) -> Tensor:
    seq_len = query.shape[2]
    block_mask = _MASKS.get(
        cu_seqlens,
        ("flex", seq_len, window),
        lambda: document_block_mask(cu_seqlens, seq_len, window, FLEX_BLOCK_SIZE),
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
        out = _sink_gate(out, aux.lse, sinks)
    return out.transpose(1, 2).contiguous()


def _sdpa_masked(query, key, value, cu_seqlens, scaling, window, sinks=None) -> Tensor:
    seq_len = query.shape[2]
    mask = _MASKS.get(
        cu_seqlens, ("dense", seq_len, window), lambda: document_causal_mask(cu_seqlens, seq_len, window)
    )
    if sinks is not None:
        return _attention_with_sinks(query, key, value, mask, scaling, sinks)
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous()


@functools.cache
def _compiled_flex_attention() -> Callable:
    # Eager flex materializes the full score matrix; compiled it runs the block-sparse kernel.
    return torch.compile(flex_attention, dynamic=False)


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


def _attention_with_sinks(query, key, value, mask, scaling, sinks) -> Tensor:
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


def _causal_window_mask(
    q_len: int, window: int | None, device: torch.device, kv_len: int | None = None
) -> Tensor:
    """``[T, S]`` causal (sliding-window) mask for unpacked rows (built per call: an uncommon path).

    Queries are the last ``T`` of ``S`` positions: query ``i`` sits at ``i + S - T``.
    """
    kv_len = q_len if kv_len is None else kv_len
    distance = (torch.arange(q_len, device=device) + kv_len - q_len)[:, None] - torch.arange(
        kv_len, device=device
    )
    keep = distance >= 0
    if window is not None:
        keep &= distance < window
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
        if cu_seqlens is not self._cu_seqlens or cu_seqlens._version != self._version:
            self._cu_seqlens, self._version, self._masks = cu_seqlens, cu_seqlens._version, {}
        # A mask built under inference_mode (validation) cannot be saved for a later backward.
        key = (*key, torch.is_inference_mode_enabled())
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def clear(self) -> None:
        self._cu_seqlens, self._version, self._masks = None, -1, {}


_MASKS = _BatchMaskCache()


__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
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
