"""Per-layer activation checkpointing of a transformers model, under the offloader and the plan.

Every decoder layer runs under non-reentrant activation checkpointing. The offloader's
saved-tensor hooks wrap the checkpoint call, so they see only what the checkpoint keeps for the
backward: the layer's input. (Inside a checkpoint the innermost hooks win, so hooks installed
there would silently turn recomputation off; they are never installed there.)

``checkpoint_impl="node"`` (the default) runs each layer's checkpoint as one autograd node
(:class:`_LayerNode`): the forward runs without a graph and saves only the layer's inputs; the
node's backward runs the layer again with the forward's autocast state and back-propagates through
it. torch's non-reentrant checkpoint packs and unpacks every tensor the layer's graph saves
through Python hooks, host time that a host-bound step pays per layer, twice; the node pays one
``apply`` and one nested backward. Like torch's checkpoint it replays the forward's random state
(CPU, and the CUDA device of the inputs), so dropout draws the same masks. A layer called with a
keyword tensor that needs a gradient takes torch's checkpoint (the node would give it none), and so
does every layer of a forward in which transformers records module outputs (router logits for a
load-balancing loss, hidden states): what the node's forward hands to those hooks has no graph.
``checkpoint_impl="torch"`` keeps torch's checkpoint for every layer (what FSDP2 takes where it
reshards a layer's weights after its forward).

Two more savings, each with a switch on the controller: the node of the layer fed by a frozen
plain input embedding keeps the token ids and looks the embedding up again in its backward
(``rebuild_embedding``; one ``[tokens, hidden]`` tensor less held through the step), and each
layer's fused LoRA layers take their adapters from one grouped cast per pass under autocast
(``group_adapter_casts``; see :func:`lightning_sloth.ops.lora_layers.adapter_casts`). The node's recompute
skips what only the layer output's values need, the fused LoRA ``down_proj``'s base product and
the residual add (``skip_unread_output``; see
:func:`lightning_sloth.patching._forwards.layer_output_unread`).

With ``cuda_graphs=True`` each node-checkpointed layer replays its forward and its recompute +
backward as CUDA graphs (:mod:`lightning_sloth.offload.graphs`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

from lightning_sloth.hf_model import find_decoder_layers, recorded_outputs, unwrap_compiled
from lightning_sloth.offload.hooks import ActivationOffloader
from lightning_sloth.offload.planner import LayerMode, plan_layers, plan_peak_bytes
from lightning_sloth.offload.transient import backward_transient_bytes, note_fragmentation
from lightning_sloth.ops.lora_groups import grouped_projections, shared_input_groups
from lightning_sloth.ops.lora_layers import adapter_casts
from lightning_sloth.ops.nf4 import scratch_bytes
from lightning_sloth.patching import layer_output_unread, patched_op
from lightning_sloth.patching.mlp_chunks import chunk_workspace_bytes
from lightning_sloth.quant import Linear4bit
from lightning_sloth.quant.linear import compute_dtype

log = logging.getLogger(__name__)


CheckpointImpl = Literal["torch", "node"]

_AUTOCAST_DEVICES = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)


class _LayerNode(torch.autograd.Function):
    """One checkpointed layer as one autograd node (see the module notes).

    ``forward(ctx, run, anchor, *args)``: ``run(*args)`` without a graph; ``anchor`` is a leaf that
    needs a gradient, so the node joins the graph even when no input needs one (the first layer of
    a LoRA model, whose input is a frozen embedding's output).
    """

    @staticmethod
    def forward(ctx, run, anchor, rebuild, unread, *args):
        ctx.run = run
        ctx.unread = unread
        ctx.rebuild = None if rebuild is None else (rebuild.position, rebuild.module)
        ctx.is_tensor = [isinstance(a, Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.needs = [isinstance(a, Tensor) and a.requires_grad for a in args]
        ctx.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
        ]
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        cuda = next((a.device for a in args if isinstance(a, Tensor) and a.is_cuda), None)
        ctx.rng = (cuda, torch.get_rng_state(), torch.cuda.get_rng_state(cuda) if cuda is not None else None)
        saved = [a for a in args if isinstance(a, Tensor)]
        if rebuild is not None:  # the rebuilt input's source is kept in its place
            saved[rebuild.position] = rebuild.source
        ctx.save_for_backward(*saved)  # the offloader sees these
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.saved_tensors)
        if ctx.rebuild is not None:
            position, module = ctx.rebuild
            with torch.no_grad():
                saved[position] = module(saved[position])
        saved = iter(saved)
        args = [
            next(saved).detach().requires_grad_(need) if is_tensor else other
            for is_tensor, other, need in zip(ctx.is_tensor, ctx.others, ctx.needs)
        ]
        cuda, cpu_state, cuda_state = ctx.rng
        with (
            torch.random.fork_rng(devices=[cuda] if cuda is not None else [], device_type="cuda"),
            torch.enable_grad(),
            contextlib.ExitStack() as stack,
        ):
            torch.set_rng_state(cpu_state)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda_state, cuda)
            for device, enabled, dtype in ctx.autocast:
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=ctx.autocast_cache)
                )
            if ctx.unread:  # only the outputs' gradient edges are used below, never their values
                stack.enter_context(layer_output_unread())
            out = ctx.run(*args)
        outs = out if isinstance(out, tuple) else (out,)
        # The backward starts from the outputs' gradient edges, not the outputs: the recomputed
        # outputs (a hidden state each) are freed before it runs rather than held through it.
        pairs = [
            (get_gradient_edge(o), g)
            for o, g in zip(outs, grads)
            if isinstance(o, Tensor) and o.requires_grad and g is not None
        ]
        del out, outs
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
        input_grads = [a.grad if need else None for a, need in zip(args, ctx.needs)]
        return (None, None, None, None, *input_grads)


class _Rebuild(NamedTuple):
    """A node input recomputed in the backward: ``module(source)`` is saved tensor ``position``."""

    position: int
    module: nn.Module
    source: Tensor


class _EmbeddingWatch:
    """Forward hook on the input embedding: remembers its last output (weakly) and its token ids.

    A layer whose input is that very tensor, frozen (no gradient), can keep the ids instead and
    look the embedding up again in its backward: one ``[tokens, hidden]`` tensor less, held through
    the whole step, for one gather in the backward. Only a plain embedding (a plain weight and no
    ``max_norm``, which writes into the weight) called with one tensor of ids qualifies.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.last: tuple[weakref.ref, Tensor] | None = None
        self.enabled = True
        self.handle = module.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs: tuple, output: Any) -> None:
        self.last = None
        if (
            torch.is_grad_enabled()
            and len(inputs) == 1
            and type(inputs[0]) is Tensor
            and type(output) is Tensor
            and not output.requires_grad
        ):
            self.last = (weakref.ref(output), inputs[0])

    def rebuild_for(self, args: tuple) -> _Rebuild | None:
        """How to rebuild the embedding's output among a layer's tensor ``args``, or None (the
        forward's record is used up by the layer it feeds; the later layers skip the search)."""
        if not self.enabled or self.last is None:
            return None
        output = self.last[0]()
        tensors = [a for a in args if isinstance(a, Tensor)]
        position = next((i for i, t in enumerate(tensors) if t is output), None)
        if position is None:
            return None
        rebuild, self.last = _Rebuild(position, self.module, self.last[1]), None
        return rebuild

    @staticmethod
    def plain(module: nn.Module | None) -> bool:
        if not isinstance(module, nn.Embedding) or module.max_norm is not None:
            return False
        # A parameter of a tensor subclass (DTensor, 4-bit) has the subclass's type.
        return type(module.weight) in (Tensor, nn.Parameter) and not module._forward_pre_hooks


class CheckpointedLayers:
    """The decoder layers under lightning_sloth's checkpointing, with their plan and offloader.

    Made by :func:`apply_checkpointing`; each layer's ``_gradient_checkpointing_func`` calls
    :meth:`run_layer` with its index. With a ``memory_budget``, the first training forward also
    measures each layer (one extra forward per layer, its graph dropped at once) and installs
    :func:`plan_layers`'s plan for the following steps.

    Attributes:
        layers: the decoder layers, in forward order.
        plan: the mode of each layer.
        offloader: the active offloader, or ``None``.
        activation_bytes: measured bytes each layer saves without checkpointing (or ``None``).
        input_bytes: measured bytes of each layer's input (or ``None``).
        budget_bytes: the budget the plan was made for (or ``None``).
        workspace_bytes: what every layer's backward needs beyond its measured activations,
            counted once: the 4-bit dequantisation buffer (the largest 4-bit weight in the compute
            dtype) and one token chunk's MLP intermediates where the MLPs run in chunks.
    """

    def __init__(
        self,
        model: nn.Module,
        offloader: ActivationOffloader | None,
        plan: Sequence[LayerMode] | None,
        memory_budget: int | Literal["auto"] | None,
        compile_layers: bool | dict[str, Any] = False,
        checkpoint_impl: CheckpointImpl = "node",
        cuda_graphs: bool = False,
    ) -> None:
        if checkpoint_impl not in get_args(CheckpointImpl):
            raise ValueError(
                f"checkpoint_impl must be one of {get_args(CheckpointImpl)}, got {checkpoint_impl!r}"
            )
        self.model = model
        self.layers = list(find_decoder_layers(model))
        self.checkpoint_impl: CheckpointImpl = checkpoint_impl
        self._anchor = torch.ones((), requires_grad=True)
        self.offloader = offloader if offloader is not None and offloader.enabled else None
        if plan is not None and memory_budget is not None:
            raise ValueError("apply_checkpointing takes a plan or a memory_budget, not both")
        if memory_budget is not None and memory_budget != "auto" and memory_budget < 0:
            raise ValueError(f"memory_budget must be 'auto' or non-negative bytes, got {memory_budget}")
        self.memory_budget = memory_budget
        self.plan = self._check_plan(plan) if plan is not None else self._leanest_plan()
        self.activation_bytes: list[int] | None = None
        self.input_bytes: list[int] | None = None
        self.backward_bytes: list[int] | None = None  # each layer's backward beyond its activations
        self.budget_bytes: int | None = None
        self.workspace_bytes = 0
        self._measured: list[tuple[int, int, int]] = []
        # One compiled entry shared by all layers: they run the same code, so Dynamo builds one
        # graph (module parameters are graph inputs), and the checkpoint and hooks stay eager.
        options = compile_layers if isinstance(compile_layers, dict) else {}
        compiled = compile_layers is True or isinstance(compile_layers, dict)  # {}: default options
        self._compiled = torch.compile(_call_layer, **options) if compiled else None
        self._embedding = self._watch_embedding() if checkpoint_impl == "node" else None
        # Each layer's fused LoRA layers, for one grouped cast of their adapters per pass (eager only).
        self._adapters = [[m for m in layer.modules() if patched_op(m) == "lora"] for layer in self.layers]
        self.group_adapter_casts = True
        """Each layer's fused LoRA layers take their adapters from one grouped cast per pass
        (:func:`lightning_sloth.ops.lora_layers.adapter_casts`); ``False``: two casts per call, as before."""
        self._groups = [shared_input_groups(layer) for layer in self.layers]
        self.group_projections = True
        """Each layer's LoRA layers that read one input (q/k/v, gate/up) compute as one node that
        reads x once for their ``x A^T`` and ``dA`` and accumulates ``dx`` in the products'
        epilogues (:func:`lightning_sloth.ops.lora_groups.grouped_projections`; eager only, and only where
        every layer of a group is a plain LoRA layer); ``False``: one node per layer."""
        self.skip_unread_output = True
        """The node's recompute skips what only the layer output's values need (the fused LoRA
        ``down_proj``'s base product and the residual add: see
        :func:`lightning_sloth.patching._forwards.layer_output_unread`); ``False``: the whole forward."""
        self._said_recording = False
        self.graphs = self._graphs(model) if cuda_graphs else None
        """The layers' CUDA graphs (:class:`~lightning_sloth.offload.graphs.LayerGraphs`), or None."""

    def _graphs(self, model: nn.Module):
        from lightning_sloth.offload.graphs import LayerGraphs, check_graphable

        if self.checkpoint_impl != "node":
            raise ValueError("cuda_graphs needs checkpoint_impl='node' (the graphs replay the node's passes)")
        if self._compiled is not None:
            raise ValueError("cuda_graphs and compile_layers exclude each other: choose one")
        check_graphable(model)
        return LayerGraphs(self.layers)

    def _watch_embedding(self) -> _EmbeddingWatch | None:
        """The node checkpoint of the layer fed by a frozen plain input embedding keeps the token ids
        and looks the embedding up again in its backward (see :class:`_EmbeddingWatch`)."""
        try:
            embedding = self.model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return None
        return _EmbeddingWatch(embedding) if _EmbeddingWatch.plain(embedding) else None

    @property
    def rebuild_embedding(self) -> bool:
        """Whether the first layer's node keeps the token ids instead of the frozen embedding's
        output (the node checkpoint with a plain input embedding; on by default)."""
        return self._embedding is not None and self._embedding.enabled

    @rebuild_embedding.setter
    def rebuild_embedding(self, value: bool) -> None:
        if self._embedding is not None:
            self._embedding.enabled = bool(value)

    def _leanest_plan(self) -> list[LayerMode]:
        if self.offloader is None:
            return ["recompute"] * len(self.layers)
        return ["offload"] * (len(self.layers) - 1) + ["recompute"]

    def _check_plan(self, plan: Sequence[LayerMode]) -> list[LayerMode]:
        plan = list(plan)
        if len(plan) != len(self.layers):
            raise ValueError(f"plan has {len(plan)} entries for {len(self.layers)} decoder layers")
        unknown = sorted({m for m in plan if m not in get_args(LayerMode)})
        if unknown:
            raise ValueError(f"unknown layer modes {unknown}; use {get_args(LayerMode)}")
        if "offload" in plan and self.offloader is None:
            raise ValueError("the plan offloads layers but no enabled ActivationOffloader was given")
        if plan[-1] == "offload":
            raise ValueError(
                "the last layer's input is needed first in the backward: plan it 'recompute' or 'keep'"
            )
        return plan

    @torch.compiler.disable  # an outer torch.compile stops here instead of tracing the hooks
    def run_layer(self, index: int, forward, *args: Any) -> Any:
        """Run layer ``index`` (``forward`` bound to its keyword arguments) under its mode."""
        if torch.is_grad_enabled() and self.memory_budget is not None and self.activation_bytes is None:
            self._measure(index, forward, args)
        if self._compiled is not None:
            forward = partial(self._compiled, forward)
        else:
            if self.group_projections and self._groups[index]:
                forward = partial(_with_groups, forward, self._groups[index])
            if self.group_adapter_casts and self._adapters[index]:
                forward = partial(_with_adapter_casts, forward, self._adapters[index])
        mode = self.plan[index] if torch.is_grad_enabled() else "keep"
        if mode == "keep":
            return forward(*args)
        if self.offloader is None:
            return self._checkpoint(index, forward, args)
        with self.offloader.saved_tensors_hooks(offload=mode == "offload"):
            return self._checkpoint(index, forward, args)

    def _checkpoint(self, index: int, forward, args: tuple) -> Any:
        if self.checkpoint_impl == "node" and self._node_fits(forward) and not self._recording():
            rebuild = self._embedding.rebuild_for(args) if self._embedding is not None else None
            graphs = self.graphs
            unread = self.skip_unread_output and self._compiled is None
            if graphs is None:
                return _LayerNode.apply(forward, self._anchor, rebuild, unread, *args)
            from lightning_sloth.offload.graphs import GraphedLayerNode

            key, keywords = graphs.key(index, forward, args, unread)
            if graphs.graphed(key):
                entry = graphs.entry(key, keywords, forward, args)
                return GraphedLayerNode.apply(graphs, entry, keywords, self._anchor, rebuild, *args)
            out = _LayerNode.apply(forward, self._anchor, rebuild, unread, *args)
            graphs.note_eager(key, out)
            return out
        return checkpoint(forward, *args, use_reentrant=False)

    def _recording(self) -> bool:
        """transformers records module outputs in this forward (a router loss's logits, hidden
        states): the node's forward has no graph, so what it recorded would carry no gradient. Such
        a forward runs the layers under torch's checkpoint, whose recorded outputs keep theirs."""
        recorded = recorded_outputs()
        if recorded and not self._said_recording:
            self._said_recording = True
            log.info(
                "transformers records %s in this forward: the layers run under torch's checkpoint "
                "(not the one-node checkpoint) so they carry their gradient",
                ", ".join(recorded),
            )
        return bool(recorded)

    @staticmethod
    def _node_fits(forward) -> bool:
        """Keyword tensors that need a gradient would get none through the node: torch's checkpoint.

        ``forward`` may wrap the layer's forward (compiled entry, adapter casts) as a partial whose
        first argument is the next one in; the keywords of each count."""
        keywords = []
        while isinstance(forward, partial):
            keywords += _keywords(forward)
            forward = forward.args[0] if forward.args else None
        return not any(t.requires_grad for t in _tensors(keywords))

    def _measure(self, index: int, forward, args: tuple) -> None:
        if index == 0:
            self._measured = []
            self.workspace_bytes = self._dequant_workspace(args) + self._chunk_workspace(args)
            self.budget_bytes = self._budget(args)
        # Parameters, buffers and the keyword tensors (rotary tables, packing metadata) are shared,
        # not activations of this layer. Buffers matter for 4-bit weights: the block scales and code
        # book a 4-bit layer saves for its backward are views of its buffers (the packed codes are
        # its weight parameter), so they cost nothing per step and count for nothing here.
        layer = self.layers[index]
        shared = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
        keywords = forward.keywords.values() if isinstance(forward, partial) else ()
        shared |= {t.untyped_storage().data_ptr() for t in _tensors(keywords)}
        if self._compiled is not None:
            forward = partial(self._compiled, forward)
        saved: dict[int, int] = {}

        def count(tensor: Tensor) -> Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in shared:
                saved[storage.data_ptr()] = storage.nbytes()
            # Detached: a saved *output* of a node packed as itself would reference its own
            # grad_fn, a cycle in C++ that no collector breaks: the measuring forward's whole graph
            # (every layer's activations) would stay alive for the rest of the run.
            return tensor.detach()

        device = next((t.device for t in _tensors(args)), torch.device("cpu"))
        rng_devices = [device] if device.type == "cuda" else []
        # The measuring forward must not shift the random streams the real forward sees.
        with (
            torch.random.fork_rng(devices=rng_devices),
            torch.autograd.graph.saved_tensors_hooks(count, _same),
        ):
            output = forward(*args)
            backward = backward_transient_bytes(output, layer, args, device)
        del output
        inputs = sum(t.numel() * t.element_size() for t in _tensors(args))
        self._measured.append((sum(saved.values()), inputs, backward))
        if index == len(self.layers) - 1 and len(self._measured) == len(self.layers):
            self.activation_bytes, self.input_bytes, self.backward_bytes = map(list, zip(*self._measured))
            self.replan(self.budget_bytes)

    def _dequant_workspace(self, args: tuple) -> int:
        """Bytes of the dequantisation buffer the 4-bit layers share: their largest weight in the
        compute dtype (autocast's, else the layer input's)."""
        sizes = [m.out_features * m.in_features for m in self.model.modules() if isinstance(m, Linear4bit)]
        tensor = next(iter(_tensors(args)), None)
        if not sizes or tensor is None:
            return 0
        return max(sizes) * compute_dtype(tensor).itemsize

    def _chunk_workspace(self, args: tuple) -> int:
        """One token chunk's MLP intermediates (the measured activations of a chunked MLP are its
        input alone; its backward makes one chunk's intermediates at a time)."""
        tensor = next(iter(_tensors(args)), None)
        if tensor is None or not tensor.is_floating_point():
            return 0
        mlps = [m for m in self.model.modules() if patched_op(m) == "glu"]
        return max((chunk_workspace_bytes(m, tensor) for m in mlps), default=0)

    def _budget(self, args: tuple) -> int | None:
        if self.memory_budget != "auto":
            return self.memory_budget
        device = next((t.device for t in _tensors(args)), None)
        if device is None or device.type != "cuda":
            return None
        note_fragmentation()
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # The 4-bit layers' dequantisation buffer is made in the first forward, after this count.
        pending = max(0, self._dequant_workspace(args) - scratch_bytes())
        # Still to come after the first forward: gradients and two fp32 optimizer states of the
        # trainable parameters (Adam-type), plus a tenth of the device for the loss and allocator slack.
        later = sum(
            p.numel() * (p.element_size() + 8)
            for p in self.model.parameters()
            if p.requires_grad and p.grad is None
        )
        return max(0, free + cached - later - pending - total // 10)

    def replan(self, budget_bytes: int | None) -> list[LayerMode]:
        """Re-plan from the measured bytes for ``budget_bytes`` (``None``: keep the leanest plan)."""
        if self.activation_bytes is None or self.input_bytes is None:
            raise RuntimeError("replan needs measured layers: pass memory_budget and run one training step")
        self.budget_bytes = budget_bytes
        if budget_bytes is None:
            self.plan = self._leanest_plan()
        else:
            self.plan = plan_layers(
                len(self.layers),
                self.activation_bytes,
                self.input_bytes,
                budget_bytes,
                offload=self.offloader is not None,
                workspace_bytes=self.workspace_bytes,
                backward_bytes=self.backward_bytes or 0,
            )
        if self.offloader is not None:
            self.offloader.activation_bytes_hint = max(self.activation_bytes)
        peak = plan_peak_bytes(
            self.plan, self.activation_bytes, self.input_bytes, self.workspace_bytes, self.backward_bytes or 0
        )
        log.info(
            "layer plan for a %s-byte budget: %s (estimated activation peak %d bytes)",
            budget_bytes,
            {mode: self.plan.count(mode) for mode in get_args(LayerMode)},
            peak,
        )
        if budget_bytes is not None and peak > budget_bytes:
            warnings.warn(
                f"the leanest layer plan needs about {peak} bytes of activations, over the {budget_bytes}-byte budget",
                stacklevel=2,
            )
        return self.plan

    def remove(self) -> None:
        """Turn checkpointing off on every layer (the layers run plainly again)."""
        if self._embedding is not None:
            self._embedding.handle.remove()
            self._embedding = None
        for layer in self.layers:
            layer = unwrap_compiled(layer)
            layer.gradient_checkpointing = False
            layer.__dict__.pop("_gradient_checkpointing_func", None)


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _call_layer(forward, *args: Any) -> Any:
    return forward(*args)


def _with_groups(forward, groups: list[list[nn.Module]], *args: Any) -> Any:
    with grouped_projections(groups):
        return forward(*args)


def _with_adapter_casts(forward, modules: list[nn.Module], *args: Any) -> Any:
    with adapter_casts(modules):
        return forward(*args)


def _keywords(fn) -> list[Any]:
    return list(fn.keywords.values()) if isinstance(fn, partial) else []


def _tensors(values) -> list[Tensor]:
    out = []
    for value in values:
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(_tensors(value))
    return out


def apply_checkpointing(
    model: nn.Module,
    *,
    offloader: ActivationOffloader | None = None,
    plan: Sequence[LayerMode] | None = None,
    memory_budget: int | Literal["auto"] | None = None,
    compile_layers: bool | dict[str, Any] = False,
    checkpoint_impl: CheckpointImpl = "node",
    cuda_graphs: bool = False,
) -> CheckpointedLayers:
    """Checkpoint every decoder layer of a transformers model, wrapped by the offloader's hooks.

    Sets each layer's ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` (the hook
    transformers' ``GradientCheckpointingLayer`` calls in training), so the model's forward is
    untouched. Call it after PEFT wrapping and instead of ``gradient_checkpointing_enable``.

    Regional compilation goes through ``compile_layers``: the compiled layer computation runs
    inside the checkpoint, the checkpoint and the offloader's hooks stay eager around it (Dynamo
    cannot trace saved-tensor hooks; with transformers >= 5.23 a ``layer.compile()`` would compile
    nothing, because the checkpoint call sits inside the layer's own ``forward``).

    Args:
        model: a transformers model, plain or PEFT-wrapped.
        offloader: moves checkpointed inputs to host memory (``None`` or disabled: plain
            non-reentrant checkpointing).
        plan: one mode per layer (``"keep"``, ``"recompute"``, ``"offload"``). Default: every
            layer offloaded but the last (``"recompute"``); all ``"recompute"`` without an
            offloader.
        memory_budget: device bytes for the layers' activations, or ``"auto"`` (the device's free
            memory at the first layer of the first step, less the gradients and Adam states of the
            trainable parameters and a tenth of the device). The first training step measures
            every layer and then :func:`plan_layers` decides per layer. Excludes ``plan``.
        compile_layers: compile each layer's computation with ``torch.compile`` (``True``, or
            a dict of ``torch.compile`` keyword arguments).
        checkpoint_impl: ``"node"`` (the default: each layer one autograd node, less host time
            per layer; see the module notes) or ``"torch"`` (torch's non-reentrant checkpoint).
        cuda_graphs: replay each node-checkpointed layer's forward and its recompute + backward
            as CUDA graphs (one device, static shapes, no dropout; see
            :mod:`lightning_sloth.offload.graphs`).

    Returns:
        The :class:`CheckpointedLayers` controller (plan, measurements, ``remove()``).
    """
    controller = CheckpointedLayers(
        model, offloader, plan, memory_budget, compile_layers, checkpoint_impl, cuda_graphs
    )
    for index, layer in enumerate(controller.layers):
        layer = unwrap_compiled(layer)
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(controller.run_layer, index)
    return controller
