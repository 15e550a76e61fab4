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

__all__ = ["NAMESPACE", "TRITON_OPS", "register_flops", "sloth_op", "use_triton"]

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
            return torch.library.triton_op(qualname, fn, mutates_args=mutates)
        return torch.library.custom_op(qualname, fn, mutates_args=mutates)

    return decorate


def register_flops(op: CustomOpDef, formula: Callable[..., int]) -> None:
    """Give ``op`` a FLOP formula; without one ``FlopCounterMode`` counts custom ops as 0 FLOPs.

    Args:
        op: An op returned by :func:`sloth_op`.
        formula: Called like the op, with every tensor argument replaced by its shape (a tuple of
            ints) and the output's shape(s) as keyword ``out_shape``; returns the FLOP count.
    """
    namespace, name = op._qualname.split("::")
    register_flop_formula(getattr(getattr(torch.ops, namespace), name))(formula)
