"""The per-layer memory plan: keep, recompute or offload each decoder layer within a budget.

:func:`plan_layers` picks one mode per layer from measured bytes and a memory budget:

- ``keep``: no checkpoint, the layer's activations stay on the device (fastest);
- ``recompute``: checkpoint, the input stays on the device;
- ``offload``: checkpoint, the input lives in host memory until the backward needs it.

``workspace_bytes`` is what any layer's backward needs on top of the activations whatever the
plan: the dequantisation buffer of a 4-bit base (its largest weight in the compute dtype, one
buffer shared by every layer: :func:`lightning_sloth.ops.nf4.scratch_bytes`) and, where the MLPs
run over token chunks, one chunk's intermediates. It shifts every checkpointed layer's backward
peak, so it counts against the budget once, not per layer.

``backward_bytes`` is what one layer's backward makes beyond what it saved: the gradients of its
intermediates and its kernels' scratch (a wide-head attention backward's accumulators), measured
per layer on the device. It counts for every layer, kept or checkpointed: a kept layer's backward
runs with the layers below still holding theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

LayerMode = Literal["keep", "recompute", "offload"]


def _per_layer(name: str, value: int | Sequence[int], num_layers: int) -> list[int]:
    values = [int(value)] * num_layers if isinstance(value, int) else [int(v) for v in value]
    if len(values) != num_layers:
        raise ValueError(f"{name} has {len(values)} entries for {num_layers} layers")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} must be non-negative, got {values}")
    return values


def plan_peak_bytes(
    plan: Sequence[LayerMode],
    act_bytes_per_layer: Sequence[int],
    input_bytes_per_layer: Sequence[int],
    workspace_bytes: int = 0,
    backward_bytes: int | Sequence[int] = 0,
) -> int:
    """Peak device bytes the layers' activations take under ``plan`` (the planner's memory model).

    Resident after the forward: ``keep`` layers hold their activations, ``recompute`` layers
    their input, ``offload`` layers nothing. The backward of a checkpointed layer ``i`` holds the
    resident bytes of layers below it, its own recomputed activations and, when layer ``i - 1``
    is offloaded, that layer's prefetched input::

        peak = max(sum(resident), max_i(sum(resident[:i]) + act[i] + prefetch[i - 1] + workspace))

    and every layer's backward, kept or not, adds its ``backward_bytes`` to ``sum(resident[:i]) + act[i]``.

    Args:
        plan: one mode per layer, in forward order.
        act_bytes_per_layer: bytes one layer saves for its backward without checkpointing
            (its input included).
        input_bytes_per_layer: bytes of one layer's input (what a checkpoint keeps).
        workspace_bytes: transient bytes of any layer's backward outside its activations (the
            4-bit dequantisation buffer).
        backward_bytes: transient bytes of each layer's backward beyond its saved activations (one
            value for all layers, or one per layer; 0: not measured).

    Returns:
        The peak in bytes.
    """
    if workspace_bytes < 0:
        raise ValueError(f"workspace_bytes must be non-negative, got {workspace_bytes}")
    grads = _per_layer("backward_bytes", backward_bytes, len(plan))
    resident = [
        act if mode == "keep" else inp if mode == "recompute" else 0
        for mode, act, inp in zip(plan, act_bytes_per_layer, input_bytes_per_layer)
    ]
    peak, below = sum(resident), 0
    for i, mode in enumerate(plan):
        if mode != "keep":
            prefetch = input_bytes_per_layer[i - 1] if i > 0 and plan[i - 1] == "offload" else 0
            peak = max(peak, below + act_bytes_per_layer[i] + prefetch + workspace_bytes + grads[i])
        else:
            peak = max(peak, below + act_bytes_per_layer[i] + grads[i])
        below += resident[i]
    return peak


def _last_checkpointed_is_offloaded(plan: Sequence[LayerMode]) -> bool:
    checkpointed = [mode for mode in plan if mode != "keep"]
    return bool(checkpointed) and checkpointed[-1] == "offload"


def plan_layers(
    num_layers: int,
    act_bytes_per_layer: int | Sequence[int],
    input_bytes_per_layer: int | Sequence[int],
    budget_bytes: int,
    *,
    offload: bool = True,
    workspace_bytes: int = 0,
    backward_bytes: int | Sequence[int] = 0,
) -> list[LayerMode]:
    """Choose keep / recompute / offload per layer so the activations fit ``budget_bytes``.

    Starts from the leanest plan (every layer offloaded but the last, whose input the backward
    needs first; all recompute without ``offload``) and spends the budget, last layer first:
    first turning offloads into recomputes (each costs one layer input and saves its copies),
    then recomputes into keeps (each costs the layer's activations and saves its recompute). A
    layer is upgraded only while :func:`plan_peak_bytes` stays within the budget. If even the
    leanest plan does not fit, it is returned anyway: it is the least the layers can take.

    Args:
        num_layers: number of decoder layers (>= 1).
        act_bytes_per_layer: bytes each layer saves for the backward without checkpointing
            (one value for all layers, or one per layer).
        input_bytes_per_layer: bytes of each layer's input (one value, or one per layer).
        budget_bytes: device bytes the layers' activations may take.
        offload: allow ``"offload"`` (an offloader is available).
        workspace_bytes: transient bytes of any layer's backward outside its activations
            (:func:`plan_peak_bytes`).
        backward_bytes: transient bytes of each layer's backward beyond its saved activations
            (:func:`plan_peak_bytes`).

    Returns:
        One of ``"keep"``, ``"recompute"``, ``"offload"`` per layer, in forward order.
    """
    if num_layers < 1:
        raise ValueError(f"plan_layers needs at least one layer, got num_layers={num_layers}")
    act = _per_layer("act_bytes_per_layer", act_bytes_per_layer, num_layers)
    inp = _per_layer("input_bytes_per_layer", input_bytes_per_layer, num_layers)
    grads = _per_layer("backward_bytes", backward_bytes, num_layers)
    plan: list[LayerMode] = ["offload" if offload else "recompute"] * (num_layers - 1) + ["recompute"]

    def upgrade(i: int, mode: LayerMode) -> None:
        previous, plan[i] = plan[i], mode
        if plan_peak_bytes(
            plan, act, inp, workspace_bytes, grads
        ) > budget_bytes or _last_checkpointed_is_offloaded(plan):
            plan[i] = previous

    for i in reversed(range(num_layers - 1)):
        upgrade(i, "recompute")
    for i in reversed(range(num_layers)):
        if plan[i] == "recompute":
            upgrade(i, "keep")
    return plan
