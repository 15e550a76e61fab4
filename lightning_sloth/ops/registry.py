"""One factory for every ``sloth::`` op, so each op registers the same way on every machine.

Where CUDA and Triton are usable, ops are ``torch.library.triton_op``: ``torch.compile`` then sees the
Triton kernels inside them and Inductor schedules them itself. Elsewhere they are
``torch.library.custom_op``: on a CPU-only machine Inductor would otherwise try to compile the Triton
kernels of a ``triton_op`` (and fail), even when the body never reaches them.

An op body dispatches on the device of its tensors with :func:`use_triton`: CUDA tensors go to the
Triton launchers of ``lightning_sloth.kernels``, anything else to the plain-torch reference.

Typical use::

    @sloth_op("my_op")
    def my_op(x: torch.Tensor, eps: float) -> torch.Tensor:
        if use_triton(x):
            return kernels.my_op(x, eps)
        return my_op_reference(x, eps)

    my_op.register_fake(...)
    my_op.register_autograd(...)
    register_flops(my_op, lambda x_shape, eps, out_shape=None: 4 * math.prod(x_shape))
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable

import torch
from torch._library.custom_ops import CustomOpDef
from torch.utils.flop_counter import register_flop_formula

from lightning_sloth.kernels.tracing import tracing

__all__ = [
    "NAMESPACE",
    "TRITON_OPS",
    "call",
    "register_autograd",
    "register_flops",
    "sloth_op",
    "tracing",
    "use_triton",
]

NAMESPACE = "sloth"


def _triton_ops_usable() -> bool:
    # The interpreter's kernels cannot be traced by Inductor, so interpreter runs use the custom_op path.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


TRITON_OPS: bool = _triton_ops_usable()
"""True where CUDA and Triton are usable: ops are registered as ``triton_op`` and run Triton on CUDA."""


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op body should launch its Triton kernel for ``tensor``.

    True for float16/bfloat16/float32 CUDA tensors where Triton is usable. The kernels compute in
    fp32, so float64 (used by gradient checks) goes to the plain-torch reference like CPU tensors.
    """
    return TRITON_OPS and tensor.device.type == "cuda" and tensor.dtype in _TRITON_DTYPES


def sloth_op(
    name: str, *, mutates_args: Iterable[str] = ()
) -> Callable[[Callable[..., object]], CustomOpDef]:
    """Register a type-annotated function as the op ``sloth::<name>``.

    Args:
        name: The op name without namespace, e.g. ``"rms_norm"``.
        mutates_args: Names of the arguments the body writes in place; must be exact.

    Returns:
        A decorator returning the ``CustomOpDef``; call ``.register_fake``, ``.register_autograd`` and
        :func:`register_flops` on it.
    """
    if "::" in name:
        raise ValueError(f"sloth_op takes a bare op name (namespace {NAMESPACE!r} is added), got {name!r}")
    qualname = f"{NAMESPACE}::{name}"
    mutates = tuple(mutates_args)

    def decorate(fn: Callable[..., object]) -> CustomOpDef:
        if TRITON_OPS:
            op = torch.library.triton_op(qualname, fn, mutates_args=mutates)
        else:
            op = torch.library.custom_op(qualname, fn, mutates_args=mutates)
        _EAGER[qualname] = fn
        return op

    return decorate


_EAGER: dict[str, Callable[..., object]] = {}
"""Per op: what an eager call runs directly (the body, or an autograd.Function around it)."""

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def register_autograd(
    op: CustomOpDef, backward: Callable, setup_context: Callable, *, none_grads: bool = False
) -> None:
    """``op.register_autograd(backward, setup_context=...)``, plus the same formula for :func:`call`.

    With ``none_grads`` the backward takes None for an output nothing used (on the eager path; the
    library path may still pass zeros), instead of a zero tensor made for it.

    The eager path is a ``torch.autograd.Function`` with the op's body as its forward and the very
    ``setup_context``/``backward`` registered on the op, so both paths compute the same thing. Its
    forward takes ``ctx`` and calls ``setup_context`` itself: a Function that defines
    ``setup_context`` has every ``apply`` bind its arguments through ``inspect.signature`` (tens of
    microseconds of host time per call, per op, per layer), which this path exists to avoid. It
    never runs under functorch transforms (:func:`call` sends those to the op).
    """
    op.register_autograd(backward, setup_context=setup_context)
    body = _EAGER[op._qualname]

    def forward(ctx, *args):
        output = body(*args)
        setup_context(ctx, args, output)
        # Gradients of outputs nothing used stay None instead of zero tensors made (and filled) for
        # every call: None for the non-differentiable outputs (saved products, rstd), which the
        # backwards ignore; zeros, made here, only for a differentiable output left unused.
        ctx.set_materialize_grads(False)
        skip = {id(t) for t in getattr(ctx, "non_differentiable", None) or ()}
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.sloth_outputs = [
            (o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) and id(o) not in skip else None
            for o in outputs
        ]
        return output

    def eager_backward(ctx, *grads):
        if not none_grads and any(g is None for g in grads):
            grads = tuple(
                torch.zeros(meta[0], dtype=meta[1], device=meta[2]) if g is None and meta is not None else g
                for g, meta in zip(grads, ctx.sloth_outputs)
            )
        return backward(ctx, *grads)

    # Named after the op, so its autograd node reads e.g. ``rms_norm_eagerBackward``.
    name = f"{op._qualname.split('::')[1]}_eager"
    methods = {"forward": forward, "backward": eager_backward}
    _Eager = type(name, (torch.autograd.Function,), {k: staticmethod(v) for k, v in methods.items()})
    _EAGER[op._qualname] = _Eager.apply


def call(op: CustomOpDef, *args: object) -> object:
    """Call ``op`` with positional ``args``: through ``torch.library`` when anything may trace or
    intercept it, otherwise straight to its body (or its autograd.Function).

    The library path (autograd wrapper, redispatch, alias checks, the Dynamo-disabled body) costs
    a few hundred microseconds of host time per call, which in eager training is paid by every op
    of every layer and leaves the GPU waiting. It is what ``torch.compile``, ``torch.export``,
    fake tensors, functorch transforms and dispatch modes (``FlopCounterMode``, and so Lightning's
    FLOP counting) need, so any of those takes it; plain eager calls on plain tensors do not.
    """
    if (
        tracing()
        or torch._C._are_functorch_transforms_active()
        or any(type(a) not in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor))
    ):
        return op(*args)
    return _EAGER[op._qualname](*args)


def register_flops(op: CustomOpDef, formula: Callable[..., int]) -> None:
    """Give ``op`` a FLOP formula; without one ``FlopCounterMode`` counts custom ops as 0 FLOPs.

    Args:
        op: An op returned by :func:`sloth_op`.
        formula: Called like the op, with every tensor argument replaced by its shape (a tuple of
            ints) and the output's shape(s) as keyword ``out_shape``; returns the FLOP count.
    """
    namespace, name = op._qualname.split("::")
    register_flop_formula(getattr(getattr(torch.ops, namespace), name))(formula)
