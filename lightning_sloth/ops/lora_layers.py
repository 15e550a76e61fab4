"""PEFT's LoRA layers through ``sloth::lora_linear``: the plain case recognised from the layer's own
state (:func:`fused_lora_forward`), and each layer's adapters cast to the compute dtype once per
pass for a whole decoder layer (:func:`adapter_casts`).

A PEFT ``peft.tuners.lora.Linear`` is fused when it is in the plain case — one active adapter,
unmerged and enabled, on an ``nn.Linear`` base without bias, a frozen unquantized weight, no
dropout, no DoRA or other variant — and runs its own forward otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn

from lightning_sloth.ops.lora import UnreadSum, lora_linear_op
from lightning_sloth.ops.registry import call

__all__ = ["adapter_casts", "adapter_in", "compute_parts", "fused_lora_forward", "plain_parts"]


def _plain_weight(tensor: Tensor) -> bool:
    # Quantized or distributed weights (Params4bit, DTensor, ...) take PEFT's own path.
    return type(tensor) in (Tensor, nn.Parameter) and tensor.is_floating_point()


def plain_parts(
    module: nn.Module, allow_base_bias: bool = False
) -> tuple[str, nn.Linear, nn.Module, nn.Module] | None:
    """``(adapter, base, lora_A, lora_B)`` of a ``lora.Linear`` in the plain case, else None (the
    checks :func:`fused_lora_forward` documents). ``allow_base_bias``: a base layer with a bias
    passes too (for callers that add it themselves; the adapter's own layers never have one).

    PEFT's state is read from the layer's own dicts: its properties and ``nn.Module.__getattr__``
    cost more host time per call than a small layer's products.
    """
    if not isinstance(module, LoraLinear):
        return None
    d = module.__dict__
    adapter = d.get("_active_adapter", LoraLinear._active_adapter)
    if not isinstance(adapter, str):
        if len(adapter) != 1:
            return None
        adapter = adapter[0]
    if d.get("_disable_adapters", False) or d.get("merged_adapters") or d.get("fan_in_fan_out", False):
        return None
    if d.get("use_dora", {}).get(adapter, False) or adapter in d.get("lora_variant", {}):
        return None
    modules = d["_modules"]
    lora_a = modules["lora_A"]._modules.get(adapter)
    lora_b = modules["lora_B"]._modules.get(adapter)
    if lora_a is None or lora_b is None:
        return None
    if not isinstance(modules["lora_dropout"]._modules.get(adapter), nn.Identity):
        return None
    base = modules["base_layer"]
    while "base_layer" in base._modules:  # a tuner layer around another (PEFT's get_base_layer)
        base = base._modules["base_layer"]
    if not isinstance(base, nn.Linear) or any(
        m._parameters.get("bias") is not None
        for m in ((lora_a, lora_b) if allow_base_bias else (base, lora_a, lora_b))
    ):
        return None
    return adapter, base, lora_a, lora_b


def fused_lora_forward(
    module: nn.Module, x: Tensor, *, overwrite_input: bool = False, unread_sum_with: Tensor | None = None
) -> Tensor | None:
    """Forward of a PEFT ``peft.tuners.lora.Linear`` through :func:`lora_linear`, or None to fall back.

    Handles the plain case only: one active adapter, unmerged and enabled, on an ``nn.Linear`` base
    with a frozen unquantized weight, no dropout (``lora_dropout`` is ``Identity``), no DoRA or other
    LoRA variant and no LoRA bias. Anything else returns None, and the caller runs the module's own
    forward. Every call checks the layer's state afresh. A base bias (Qwen2's q/k/v) is added to the
    op's output in the compute dtype.

    The product runs in the base layer's compute dtype: the autocast dtype under autocast (as
    ``nn.Linear`` would), else the base weight's dtype (which x must have). Adapters stored in another
    dtype (e.g. float32) are cast to it; their gradients flow back through the cast.

    Args:
        module: A ``peft.tuners.lora.Linear``.
        x: ``[..., in]`` input.
        overwrite_input: Passed to :func:`lora_linear` (x read by nothing else afterwards).
        unread_sum_with: a residual ``[..., out]`` in the compute dtype: returns ``residual +
            module(x)`` for a backward only, its values never computed (:class:`UnreadSum`: the
            base product is skipped). For a checkpoint's recompute, whose output nothing reads.

    Returns:
        ``[..., out]`` output, or None if the module is not in the plain case.
    """
    parts = plain_parts(module, allow_base_bias=True)
    if parts is None:
        return None
    resolved = compute_parts(module, parts, x)
    if resolved is None:
        return None
    dtype, weight, a, b, scale = resolved
    residual = unread_sum_with
    if residual is not None and (
        residual.shape != (*x.shape[:-1], weight.shape[0]) or not residual.is_floating_point()
    ):
        return None
    # What lora_linear checks holds here (one dtype after the casts, frozen base); casts only when needed.
    casts = getattr(ADAPTER_CASTS, "copies", None)
    tensors = [t if t.dtype == dtype else cast_adapter(t, dtype, casts) for t in (x, weight, a, b)]
    bias = parts[1]._parameters.get("bias")
    if residual is not None:
        if bias is not None and bias.requires_grad:
            return None
        # A frozen bias moves the unread sum's values only, and nothing reads them.
        return UnreadSum.apply(residual, *tensors, float(scale), overwrite_input)
    y, _ = call(lora_linear_op, *tensors, float(scale), overwrite_input)
    return y if bias is None else y + (bias if bias.dtype == dtype else bias.to(dtype))


def compute_parts(module: nn.Module, parts: tuple, x: Tensor):
    """``(dtype, W, A, B, scale)`` of a plain-case layer for input x (the compute dtype: autocast's,
    else the weight's, which x must have), or None where the fused op does not apply."""
    adapter, base, lora_a, lora_b = parts
    weight = base._parameters.get("weight")
    if weight is None or not _plain_weight(weight) or weight.requires_grad:
        return None
    device_type = x.device.type
    # A model on the meta device (built per shard) is probed structurally; meta has no autocast.
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif x.dtype == weight.dtype:
        dtype = weight.dtype
    else:
        return None
    a, b = lora_a._parameters["weight"], lora_b._parameters["weight"]
    if x.device != weight.device or a.device != weight.device or b.device != weight.device:
        raise ValueError(
            f"x, the base weight, lora_A and lora_B of this LoRA layer must be on one device, got "
            f"{x.device}, {weight.device}, {a.device}, {b.device}"
        )
    scale = module.__dict__["scaling"][adapter] if "scaling" in module.__dict__ else module.scaling[adapter]
    return dtype, weight, a, b, scale


ADAPTER_CASTS = threading.local()  # .copies: id(adapter weight) -> its copy in the compute dtype


def cast_adapter(tensor: Tensor, dtype: torch.dtype, copies: dict[int, Tensor] | None) -> Tensor:
    copy = copies.get(id(tensor)) if copies else None
    return copy if copy is not None and copy.dtype == dtype else tensor.to(dtype)


def adapter_in(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """An adapter weight in ``dtype``: itself, the block's grouped cast of it (:func:`adapter_casts`)
    where there is one, else a cast of its own."""
    return (
        tensor
        if tensor.dtype == dtype
        else cast_adapter(tensor, dtype, getattr(ADAPTER_CASTS, "copies", None))
    )


class _CastAdapters(torch.autograd.Function):
    """Copies of several weights in one dtype from one ``_foreach_copy_`` (one launch, not one per
    weight); the backward casts their gradients back the same way. The copies are views of one
    buffer. Casts are exact roundings either way, so the values equal per-weight ``.to`` casts."""

    @staticmethod
    def forward(ctx, dtype, *weights):
        ctx.set_materialize_grads(False)  # copies no layer used get no zero gradients
        ctx.dtype = weights[0].dtype
        return tuple(_foreach_cast(list(weights), dtype))

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        out: list[Tensor | None] = [None] * len(grads)
        if present:
            cast = _foreach_cast([grads[i] for i in present], ctx.dtype)
            for i, g in zip(present, cast):
                out[i] = g
        return (None, *out)


def _foreach_cast(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    sizes = [t.numel() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device)
    views = [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors)]
    torch._foreach_copy_(views, tensors)  # other strides than the views': its per-tensor path
    return views


def _layer_adapters(modules: Sequence[nn.Module]) -> list[Tensor]:
    """The A and B weights of the plain-case LoRA layers among ``modules`` (see :func:`plain_parts`)."""
    weights = []
    for module in modules:
        parts = plain_parts(module, allow_base_bias=True)
        if parts is not None:
            weights += [parts[2]._parameters["weight"], parts[3]._parameters["weight"]]
    return weights


@contextlib.contextmanager
def adapter_casts(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, the fused LoRA layers among ``modules`` take their A and B weights in the
    compute dtype from one grouped cast made on entry, instead of two casts each per call.

    Under autocast with adapters stored in another dtype (float32 adapters, bf16 autocast), a
    decoder layer's seven LoRA layers cast fourteen small weights per forward, and the backward
    casts fourteen gradients back: 28 launches and autograd nodes per layer and pass, where a
    host-bound step pays for each. Here that is one ``_foreach_copy_`` each way (values unchanged).
    Nothing is cached across blocks: each entry casts the weights as they are then.

    Args:
        modules: The LoRA layers a block runs (e.g. one decoder layer's ``lora.Linear`` s).
    """
    weights = _layer_adapters(modules)
    device = weights[0].device if weights else None
    if device is None or not torch.is_autocast_enabled(device.type):
        yield
        return
    dtype = torch.get_autocast_dtype(device.type)
    weights = [
        w for w in weights if w.dtype != dtype and w.device == device and type(w) in (Tensor, nn.Parameter)
    ]
    if len(weights) < 2 or len({w.dtype for w in weights}) > 1:
        yield
        return
    with torch.autocast(device.type, enabled=False):
        copies = _CastAdapters.apply(dtype, *weights)
    previous = getattr(ADAPTER_CASTS, "copies", None)
    ADAPTER_CASTS.copies = {id(w): c for w, c in zip(weights, copies)}
    try:
        yield
    finally:
        ADAPTER_CASTS.copies = previous
