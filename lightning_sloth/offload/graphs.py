"""CUDA graphs of checkpointed decoder layers: each layer's forward, and its recompute + backward,
replayed as one graph each.

A host-bound step (many thin layers, ~200 launches per layer and pass) spends more time queueing
work than the GPU spends running it. With ``cuda_graphs=True`` on the checkpointing controller,
every node-checkpointed layer becomes, after one eager warm-up of its input shapes, two graphs:

- the forward, run without a graph as the node's forward is (what the eager node does);
- the backward: the layer run again with autograd and back-propagated, its input gradient and
  its trainable parameters' gradients written to buffers outside the graph.

Graphs need static shapes and addresses. A layer's positional tensors (the hidden state) and its
keyword tensors (rotary tables, ``cu_seqlens``, position ids) are copied into static buffers
shared by all layers of one shape (a keyword tensor only when it is not the one copied last:
the rotary tables and packing metadata of a step are copied once, not per layer). Python values
among the arguments (``max_length_q``...) are part of a graph's key: a new value is a new graph.
Feed it static shapes: ``PackedCollator(pad_to="max_tokens", segments_bucket="pow2")`` (its
``max_seqlen`` is bucketed to powers of two already) gives a handful of keys per run.

Parameter gradients are accumulated inside the graph into one buffer per parameter, which is the
parameter's ``.grad`` (a ``.grad`` set to ``None`` by ``zero_grad`` is zeroed and re-attached
before the replay, so accumulation over micro-batches is autograd's). The input gradient is
written into the static gradient buffer the next (earlier) layer reads, and a copy goes back
to autograd. All graphs share one memory pool: they run one at a time, in order.

Limits, each refused with an error when the controller is made or the layer first runs:
parameters' gradients bypass autograd's accumulation (so DDP's and FSDP's gradient hooks would
never fire: one device only); random ops are not replayed (dropout must be off); a layer must
return one tensor. Layers in ``"keep"`` mode (the memory plan) run eagerly, as does any call
whose tensors are not all on one CUDA device, and every key beyond ``max_keys``.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sloth.patching import layer_output_unread

log = logging.getLogger(__name__)

_AUTOCAST = ("cuda",)


def check_graphable(model: nn.Module) -> None:
    """Refuse models whose layers cannot be graphed: random ops (dropout) in training."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ValueError(
                f"cuda_graphs replays no random ops: {name or type(module).__name__} is a dropout with "
                f"p={module.p}; set it to 0 (or turn cuda_graphs off)"
            )
    config = getattr(model, "config", None)
    for key, value in (vars(config) if config is not None else {}).items():
        if "dropout" in key and isinstance(value, float) and value > 0:
            raise ValueError(
                f"cuda_graphs replays no random ops: config.{key}={value}; set it to 0 "
                "(or turn cuda_graphs off)"
            )


def _map_callable(fn: Any, leaf) -> Any:
    """``fn`` (nested ``functools.partial`` s) with every tensor among its bound arguments mapped."""
    if isinstance(fn, partial):
        return partial(
            _map_callable(fn.func, leaf),
            *(_map_value(a, leaf) for a in fn.args),
            **{k: _map_value(v, leaf) for k, v in fn.keywords.items()},
        )
    return fn


def _map_value(value: Any, leaf) -> Any:
    if isinstance(value, Tensor):
        return leaf(value)
    if isinstance(value, partial):
        return _map_callable(value, leaf)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_value(v, leaf) for v in value)
    return value


def _bound_values(fn: Any, out: list) -> list:
    """Every value bound in ``fn`` 's nested partials, depth first (tuples and lists opened)."""
    if isinstance(fn, partial):
        _bound_values(fn.func, out)
        for value in (*fn.args, *fn.keywords.values()):
            _flatten(value, out)
    return out


def _flatten(value: Any, out: list) -> None:
    if isinstance(value, partial):
        _bound_values(value, out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flatten(v, out)
    else:
        out.append(value)


def _meta(t: Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


class _Static:
    """Buffers shared by every graph of one tensor layout: inputs, keyword tensors, gradients."""

    def __init__(self, args: list[Tensor], keywords: list[Tensor], output: tuple) -> None:
        self.inputs = [torch.empty_like(a, memory_format=torch.contiguous_format) for a in args]
        self.keywords = [torch.empty_like(k) for k in keywords]
        shape, dtype = output
        # One input of the output's layout: the forward writes its output into the input buffer
        # and the backward its input gradient into the output-gradient buffer, so consecutive
        # layers find what they read already in place (and no separate output buffer is needed).
        self.chained = len(args) == 1 and (tuple(args[0].shape), args[0].dtype) == (shape, dtype)
        device = args[0].device
        self.output = None if self.chained else torch.empty(shape, dtype=dtype, device=device)
        self.grad_output = torch.empty(shape, dtype=dtype, device=device)
        # Which tensor's values each buffer holds now (with its version), to skip a copy.
        self.input_holds: list[tuple[Tensor, int] | None] = [None] * len(args)
        self.keyword_holds: list[tuple[Tensor, int] | None] = [None] * len(keywords)
        self.grad_holds: tuple[Tensor, int] | None = None

    @staticmethod
    def _load(buffers: list[Tensor], holds: list, sources: list[Tensor]) -> None:
        for i, (buffer, source) in enumerate(zip(buffers, sources)):
            held = holds[i]
            if held is None or held[0] is not source or held[1] != source._version:
                buffer.copy_(source)
                holds[i] = (source, source._version)

    def load(self, args: list[Tensor], keywords: list[Tensor]) -> None:
        self._load(self.inputs, self.input_holds, args)
        self._load(self.keywords, self.keyword_holds, keywords)

    def load_grad(self, grad: Tensor) -> None:
        held = self.grad_holds
        if held is None or held[0] is not grad or held[1] != grad._version:
            self.grad_output.copy_(grad)
            self.grad_holds = (grad, grad._version)


class _Entry:
    """One layer under one key: its forward and backward graphs (made on first use)."""

    def __init__(
        self, params: list[Tensor], grads: list[Tensor], run, static: _Static, autocast: list, unread: bool
    ) -> None:
        self.unread = unread  # the recompute skips what only the output's values need
        self.run = run  # the layer's forward over the static keyword tensors
        self.static = static
        self.autocast = autocast
        self.forward_graph: torch.cuda.CUDAGraph | None = None
        self.backward_graph: torch.cuda.CUDAGraph | None = None
        self.params = params
        self.grads = grads  # accumulation buffers of params (their .grad), shared by the layer's keys
        self.used: list[bool] = []  # params that get a gradient in this layer

    def autocast_contexts(self, stack: contextlib.ExitStack) -> None:
        # No autocast cache inside a capture: a cast cached before it would be read, never redone.
        for device, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False))


class LayerGraphs:
    """The CUDA graphs of a :class:`~lightning_sloth.offload.checkpoint.CheckpointedLayers`.

    Args:
        layers: the decoder layers, in forward order.
        warmup: eager runs of a layer with an input layout before graphs are captured for it
            (Triton compiles and cuBLAS picks its algorithms outside any capture). Later keys of
            the same layout (other packing values) are captured at their first call.
        max_keys: distinct keys (shapes and Python values) to capture graphs for; calls with
            more run eagerly (a warning names the cause).

    Attributes:
        captures: graphs captured so far (forward and backward counted apart).
        replays: graph replays so far.
        eager_calls: node calls that ran eagerly (warm-up, or not graphable).
    """

    def __init__(self, layers: list[nn.Module], warmup: int = 1, max_keys: int = 16) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("cuda_graphs needs CUDA")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the first run of a key is eager), got {warmup}")
        self.layers = layers
        self.warmup = warmup
        self.max_keys = max_keys
        self.pool = None
        self._stream: torch.cuda.Stream | None = None
        self._seen: dict[tuple, int] = {}
        self._outputs: dict[tuple, tuple] = {}
        self._entries: dict[tuple, _Entry] = {}
        self._statics: dict[tuple, _Static] = {}
        self._grads: dict[int, list[Tensor]] = {}  # per layer: its trainable parameters' .grad buffers
        self._keys: set[tuple] = set()
        self._warned = False
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0

    # ---------------------------------------------------------------------------- keys
    def key(self, index: int, forward, args: tuple, unread: bool = False) -> tuple[tuple | None, list]:
        """The graph key of a call (layer, tensor layouts, Python values, autocast state, whether
        the recompute skips what only the output's values need) and its keyword tensors (each
        once, in order), from one walk over the bound arguments; the key is None when the call
        cannot be graphed (a tensor off the layer's CUDA device, an unknown value)."""
        if not args or any(not isinstance(a, Tensor) for a in args):
            return None, []
        device = args[0].device
        if device.type != "cuda" or any(a.device != device for a in args):
            return None, []
        layout, values, first, keywords = [], [], {}, []
        for value in _bound_values(forward, []):
            if isinstance(value, Tensor):
                if value.device != device:
                    return None, []
                position = first.setdefault(id(value), len(first))
                if position == len(keywords):
                    keywords.append(value)
                layout.append(position)
                values.append(_meta(value))
            elif isinstance(value, (int, float, bool, str, type(None), torch.dtype)):
                values.append(value)
            elif isinstance(value, nn.Module):
                values.append(type(value).__name__)
            elif callable(value):  # a wrapper's name tells which passes run around the layer
                values.append(getattr(value, "__qualname__", type(value).__name__))
            else:
                return None, []
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST)
        key = (index, tuple(_meta(a) for a in args), tuple(layout), tuple(values), autocast, unread)
        return key, keywords

    # ---------------------------------------------------------------------------- calls
    @staticmethod
    def _warm_key(key: tuple) -> tuple:
        # Warm-up is per layer and input layout: a new key that differs only in packing values
        # (cu_seqlens' length, max_seqlen) compiles nothing new and is captured at once.
        return (key[0], key[1], key[4])

    def graphed(self, key: tuple | None) -> bool:
        """Whether a call of ``key`` replays graphs (else it runs eagerly: :meth:`note_eager`)."""
        if key is None:
            return False
        if key in self._entries:
            return True
        if self._seen.get(self._warm_key(key), 0) < self.warmup:
            return False
        if key[1:] not in self._keys:
            if len(self._keys) >= self.max_keys:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "cuda_graphs: more than %d distinct layer input shapes or packing values; "
                        "further ones run eagerly (pad batches to one shape: "
                        "PackedCollator(pad_to='max_tokens', segments_bucket='pow2'))",
                        self.max_keys,
                    )
                return False
            self._keys.add(key[1:])
        return True

    def note_eager(self, key: tuple | None, output: Any) -> None:
        """Count an eager run of ``key`` towards its warm-up and remember its output's layout."""
        self.eager_calls += 1
        if key is None:
            return
        warm = self._warm_key(key)
        if not isinstance(output, Tensor):
            self._seen[warm] = -(10**9)  # never graphed: the layer returns more than one tensor
            return
        self._seen[warm] = self._seen.get(warm, 0) + 1
        self._outputs[warm] = (tuple(output.shape), output.dtype)

    def entry(self, key: tuple, keywords: list[Tensor], forward, args: tuple) -> _Entry:
        """The graphs of ``key`` (the static buffers of its layout shared with other layers)."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        output = self._outputs[self._warm_key(key)]
        layout = (key[1], tuple(_meta(k) for k in keywords), output)
        static = self._statics.get(layout)
        if static is None:
            static = self._statics[layout] = _Static(list(args), keywords, output)
        mapping = {id(k): s for k, s in zip(keywords, static.keywords)}
        run = _map_callable(forward, lambda t: mapping[id(t)])
        index = key[0]
        if index not in self._grads:  # one set per layer, whichever key's graph accumulates into it
            self._grads[index] = [torch.zeros_like(p) for p in self._params(index)]
        entry = _Entry(self._params(index), self._grads[index], run, static, list(key[4]), unread=key[5])
        self._entries[key] = entry
        return entry

    def _params(self, index: int) -> list[Tensor]:
        return [p for p in self.layers[index].parameters() if p.requires_grad]

    def _capture(self, body) -> torch.cuda.CUDAGraph:
        """Capture ``body`` on a side stream into the shared pool. Not ``torch.cuda.graph``: that
        synchronizes, collects garbage and empties the cache at every capture; here a capture
        costs what the eager pass costs, plus the graph's instantiation."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            # thread_local: a DataLoader's pinning thread may allocate host memory meanwhile.
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        self.captures += 1
        return graph

    def forward(self, entry: _Entry, keywords: list[Tensor], args: tuple) -> Tensor:
        """The layer's forward (no autograd graph) by replay: a fresh tensor with the output.

        Where the layer maps one tensor to one of the same layout (a decoder layer), the graph
        writes its output into the input buffer, so the next layer finds its input in place."""
        static = entry.static
        static.load(list(args), keywords)
        target = static.inputs[0] if static.chained else static.output
        if entry.forward_graph is None:

            def body():
                with torch.no_grad(), contextlib.ExitStack() as stack:
                    entry.autocast_contexts(stack)
                    target.copy_(entry.run(*static.inputs))

            entry.forward_graph = self._capture(body)
        entry.forward_graph.replay()
        self.replays += 1
        out = target.clone()
        if static.chained:
            static.input_holds[0] = (out, out._version)
        return out

    def backward(
        self, entry: _Entry, keywords: list[Tensor], saved: list[Tensor], needs: list[bool], grad: Tensor
    ) -> list[Tensor | None]:
        """Recompute + backward by replay: the inputs' gradients (fresh tensors, None where not
        needed); the parameters' gradients accumulated into their ``.grad``.

        Where chained (see :meth:`forward`), the input gradient is written into the gradient
        buffer the layer before reads."""
        static = entry.static
        static.load(saved, keywords)
        static.load_grad(grad)
        chained = static.chained and needs[0]
        if entry.backward_graph is None:
            entry.grads_in = [
                (static.grad_output if chained and i == 0 else torch.empty_like(s)) if need else None
                for i, (s, need) in enumerate(zip(static.inputs, needs))
            ]

            def body():
                inputs = [s.detach().requires_grad_(need) for s, need in zip(static.inputs, needs)]
                with torch.enable_grad(), contextlib.ExitStack() as stack:
                    entry.autocast_contexts(stack)
                    if entry.unread:
                        stack.enter_context(layer_output_unread())
                    out = entry.run(*inputs)
                wanted = [x for x, need in zip(inputs, needs) if need] + entry.params
                grads = iter(torch.autograd.grad(out, wanted, static.grad_output, allow_unused=True))
                del out
                input_grads = [next(grads) if need else None for need in needs]
                param_grads = list(grads)
                entry.used = [g is not None for g in param_grads]
                pairs = [(b, g) for b, g in zip(entry.grads, param_grads) if g is not None]
                if pairs:
                    torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs])
                # Last: the output gradient buffer is read above and may be the target here.
                for buffer, g in zip(entry.grads_in, input_grads):
                    if buffer is not None:
                        buffer.copy_(g)

            entry.backward_graph = self._capture(body)
        self._attach(entry)
        entry.backward_graph.replay()
        self.replays += 1
        out = [None if b is None else b.clone() for b in entry.grads_in]
        if chained:
            static.grad_holds = (out[0], out[0]._version)
        return out

    @staticmethod
    def _attach(entry: _Entry) -> None:
        """Make each parameter's ``.grad`` its accumulation buffer, as autograd would accumulate:
        zeroed where ``.grad`` is None, holding the gradient so far where it is another tensor.
        Parameters the layer gives no gradient keep theirs."""
        zero, adopt = [], []
        for p, buffer, used in zip(entry.params, entry.grads, entry.used):
            if not used:
                continue
            current = p.grad
            if current is None:
                zero.append(buffer)
                p.grad = buffer
            elif current is not buffer:
                adopt.append((buffer, current))
                p.grad = buffer
        if zero:
            torch._foreach_zero_(zero)
        if adopt:
            torch._foreach_copy_([b for b, _ in adopt], [c for _, c in adopt])


class GraphedLayerNode(torch.autograd.Function):
    """A node-checkpointed layer replayed from :class:`LayerGraphs` (the graphs' counterpart of
    the eager ``_LayerNode``: the same inputs saved, the same gradients)."""

    @staticmethod
    def forward(ctx, graphs, entry, keywords, anchor, rebuild, *args):
        ctx.graphs, ctx.entry, ctx.keywords = graphs, entry, keywords
        ctx.rebuild = None if rebuild is None else (rebuild.position, rebuild.module)
        ctx.needs = [a.requires_grad for a in args]
        saved = list(args)
        if rebuild is not None:  # the rebuilt input's source is kept in its place
            saved[rebuild.position] = rebuild.source
        ctx.save_for_backward(*saved)  # the offloader sees these
        return graphs.forward(entry, keywords, args)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * (5 + len(ctx.needs))
        saved = list(ctx.saved_tensors)
        if ctx.rebuild is not None:
            position, module = ctx.rebuild
            with torch.no_grad():
                saved[position] = module(saved[position])
        grads = ctx.graphs.backward(ctx.entry, ctx.keywords, saved, ctx.needs, grad)
        return (None, None, None, None, None, *grads)
