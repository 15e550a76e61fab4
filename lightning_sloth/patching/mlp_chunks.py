"""Token-chunked MLPs: a gated MLP run over slices of the tokens, so that its ``[tokens, I]``
intermediates never exist whole.

A gated MLP is per token: ``down(act(gate(x)) * up(x))`` reads one row of ``x`` for one row of
its output. At long sequences its intermediates (gate, up and the activation, ``[T, I]`` each, with
``I`` about 3.5 times the hidden size) are the largest tensors of a decoder layer: at 350k tokens of
a Llama-3.1-8B they are 10 GiB each in bf16, against 2.7 GiB for one ``[T, H]`` hidden state.

:func:`chunked_rows` runs the MLP over row chunks of at most ``size`` tokens::

    forward   (no graph)  out[c] = mlp(x[c])            for each chunk c; saved: x only
    backward              x_c = x[c] (needs grad);  y_c = mlp(x_c);  backward(y_c, dout[c])
                          dx[c] = x_c.grad,  LoRA gradients accumulate chunk by chunk

so the MLP's share of the peak is one chunk's intermediates, whatever the length; the backward runs
each chunk's forward again (a checkpoint inside the layer). Inside the layer checkpoint's own
recompute, where nothing reads the layer's output (``unread``), the chunked forward computes
nothing and returns an uninitialised tensor: the recompute costs no MLP work, and the backward's
per-chunk forward is the one the recompute would have run.

Every row is computed exactly as in the unchunked MLP; the parameters' gradients are sums over
chunks instead of one product over all rows (the same sum in another order).

The chunk size comes from a module attribute set by :func:`set_mlp_chunk_tokens` (an int,
``"auto"`` or ``None``); :func:`chunk_size_for` turns it into rows for one call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_sloth.quant.linear import compute_dtype

__all__ = [
    "MLP_CHUNK_BYTES",
    "chunk_size_for",
    "chunk_workspace_bytes",
    "chunked_rows",
    "mlp_chunk_tokens",
    "set_mlp_chunk_tokens",
    "token_chunked",
    "unread_chunked",
]

CHUNK_ATTR = "_sloth_mlp_chunk_tokens"
"""Module attribute holding an MLP's chunk setting (int tokens, ``"auto"`` or ``None``)."""

MLP_CHUNK_BYTES = 2 * 2**30
"""``"auto"``: the most bytes one chunk's three ``[rows, I]`` intermediates may take (2 GiB: a
Llama-3.1-8B MLP in bf16 runs whole up to 24,576 tokens and in chunks of that size beyond)."""

_AUTOCAST_DEVICES = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)


def _check_setting(tokens: int | str | None) -> int | str | None:
    if tokens is None or tokens == "auto":
        return tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"mlp_chunk_tokens must be a positive int, 'auto' or None, got {tokens!r}")
    return tokens


def set_mlp_chunk_tokens(modules: list[nn.Module], tokens: int | str | None) -> int:
    """Set the chunk setting of each gated MLP in ``modules``; returns how many were set.

    Args:
        modules: MLP modules whose forward reads the setting (the patched GLU forwards).
        tokens: rows per chunk; ``"auto"`` (chunks of :data:`MLP_CHUNK_BYTES` of intermediates,
            only past that length) or ``None`` (never chunked).
    """
    tokens = _check_setting(tokens)
    for module in modules:
        setattr(module, CHUNK_ATTR, tokens)
    return len(modules)


def mlp_chunk_tokens(module: nn.Module) -> int | str | None:
    """The chunk setting of an MLP module (``None`` where none was set)."""
    return getattr(module, CHUNK_ATTR, None)


def _intermediate_size(mlp: nn.Module) -> int | None:
    down = getattr(mlp, "down_proj", None)
    size = getattr(down, "in_features", None)
    if isinstance(size, int):
        return size
    fused = getattr(getattr(mlp, "gate_up_proj", None), "out_features", None)
    return fused // 2 if isinstance(fused, int) else None


def chunk_size_for(mlp: nn.Module, x: Tensor) -> int | None:
    """Rows per chunk for ``mlp(x)``, or ``None`` to run it whole (no setting, or x fits one chunk).

    ``"auto"`` sizes a chunk so that its three ``[rows, I]`` intermediates, in the compute dtype
    (autocast's, else x's), take at most :data:`MLP_CHUNK_BYTES` (a multiple of 1024 rows, at least
    1024); the size depends only on the model, so every long batch gets the same chunks.
    """
    setting = mlp_chunk_tokens(mlp)
    # Under torch.compile (regional compile) the layer runs whole: Dynamo does not trace the
    # node's nested backward.
    if setting is None or torch.compiler.is_compiling():
        return None
    if setting == "auto":
        intermediate = _intermediate_size(mlp)
        if intermediate is None:
            return None
        per_row = 3 * intermediate * compute_dtype(x).itemsize
        size = max(1024, MLP_CHUNK_BYTES // per_row // 1024 * 1024)
    else:
        size = setting
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return size if rows > size else None


def chunk_workspace_bytes(mlp: nn.Module, x: Tensor) -> int:
    """Bytes of one chunk's three ``[rows, I]`` intermediates for ``mlp(x)`` (0 when it runs
    whole): what a chunked MLP's backward holds beyond the activations it saved."""
    size, intermediate = chunk_size_for(mlp, x), _intermediate_size(mlp)
    if size is None or intermediate is None:
        return 0
    return 3 * size * intermediate * compute_dtype(x).itemsize


def chunked_rows(
    body: Callable[[Tensor], Tensor],
    x: Tensor,
    size: int,
    *,
    unread: bool = False,
    grad_body: Callable[[Tensor], Tensor] | None = None,
    needs_grad: bool = True,
) -> Tensor:
    """``body(x)`` computed over row chunks of ``size`` tokens (see the module notes).

    Args:
        body: a per-row function ``[rows, in] -> [rows, out]`` (the MLP's forward).
        x: ``[..., in]`` input.
        size: rows per chunk (>= 1).
        unread: nothing reads the output's values (a checkpoint's recompute): return an
            uninitialised ``[..., out]`` tensor that carries the backward only.
        grad_body: what the backward runs per chunk (default ``body``): a function with the
            same gradients whose output values may go unread.
        needs_grad: whether parameters inside ``body`` need gradients (an anchor makes the
            backward run even when x needs none).

    Returns:
        ``[..., out]`` output.
    """
    if size < 1:
        raise ValueError(f"chunk size must be >= 1 row, got {size}")
    rows = x.reshape(-1, x.shape[-1])
    if not torch.is_grad_enabled() or not (x.requires_grad or needs_grad):  # no graph to build
        out = _run_chunks(body, rows, size)
        return out.view(*x.shape[:-1], out.shape[-1])
    out = _ChunkedRows.apply(body, grad_body or body, size, unread, _ANCHOR, rows)
    return out.view(*x.shape[:-1], out.shape[-1])


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def token_chunked(body: Callable) -> Callable:
    """A gated MLP forward ``body(module, x)`` that runs over token chunks when its module has a
    chunk setting and x is longer than one chunk; ``__wrapped__`` is ``body``."""

    @functools.wraps(body)
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        size = chunk_size_for(self, x)
        if size is None:
            return body(self, x)
        return chunked_rows(functools.partial(body, self), x, size, needs_grad=_trains(self))

    return forward


def unread_chunked(mlp: nn.Module, x: Tensor, residual: Tensor, size: int, for_gradients: Callable) -> Tensor:
    """``residual + mlp(x)`` in a recompute whose output nothing reads, over chunks of ``size``
    tokens: nothing is computed now; the backward runs ``for_gradients(mlp, chunk, zero)`` per
    chunk (the gradients-only forward, a zero residual standing in for the chunk's).

    ``mlp``'s forward is one made by :func:`token_chunked`."""
    body = mlp.__dict__["forward"].__func__.__wrapped__

    def grad_body(chunk: Tensor) -> Tensor:
        return for_gradients(mlp, chunk, residual.new_zeros(*chunk.shape[:-1], residual.shape[-1]))

    out = chunked_rows(
        functools.partial(body, mlp), x, size, unread=True, grad_body=grad_body, needs_grad=_trains(mlp)
    )
    return residual + out


_ANCHOR = torch.ones((), requires_grad=True)
"""A leaf needing a gradient: the chunked node joins the graph when only parameters need one."""


def _run_chunks(body: Callable[[Tensor], Tensor], rows: Tensor, size: int) -> Tensor:
    out = None
    for start in range(0, rows.shape[0], size):
        chunk = body(rows[start : start + size])
        if out is None:
            out = chunk.new_empty(rows.shape[0], chunk.shape[-1])
        out[start : start + chunk.shape[0]].copy_(chunk)
        del chunk  # one chunk's intermediates at a time
    if out is None:  # zero rows
        out = body(rows)
    return out


class _ChunkedRows(torch.autograd.Function):
    """``body`` over row chunks as one autograd node that saves only its input."""

    @staticmethod
    def forward(ctx, body, grad_body, size, unread, anchor, rows):
        ctx.grad_body, ctx.size = grad_body, size
        ctx.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
        ]
        ctx.save_for_backward(rows)
        with torch.no_grad():
            if unread:  # the output's shape and dtype, from zero rows
                empty = body(rows[:0])
                return empty.new_empty(rows.shape[0], empty.shape[-1])
            return _run_chunks(body, rows, size)

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[5]
        grad_rows = torch.empty_like(rows) if needs_x else None
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for device, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            for start in range(0, rows.shape[0], ctx.size):
                chunk = rows[start : start + ctx.size].detach().requires_grad_(needs_x)
                out = ctx.grad_body(chunk)
                if out.requires_grad:
                    torch.autograd.backward(out, grad_out[start : start + chunk.shape[0]])
                if needs_x:
                    grad = chunk.grad
                    grad_rows[start : start + chunk.shape[0]].copy_(grad if grad is not None else 0)
                del out, chunk
        return None, None, None, None, None, grad_rows
