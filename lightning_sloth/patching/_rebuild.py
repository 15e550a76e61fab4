"""A class's forward rebuilt over a copy of its module namespace in which a few global names are ours.

transformers' modules call module-level functions of their modeling file by name
(``apply_rotary_pos_emb``, ``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``). Rebinding such a
global would change every model of the family in the process; instead :func:`rebuild_with_globals`
makes a new function from the forward's own code object over a copied namespace where those names
are replaced, and the patching installs it on chosen instances only. Decorators that keep the
function in a closure (``deprecate_kwarg``, ``force_accelerate_hooks``) are rebuilt around it, except
the ``kernels`` package's per-instance router (``use_kernelized_func``, on transformers' classes from
5.25) where every function it routes is replaced: it would have nothing left to route, and it sets a
context variable on each call, which Dynamo refuses inside activation checkpointing.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["rebuild_with_globals"]

Replacement = Callable[[Callable], Callable]
"""Builds the new global from the one it replaces (which it may call for the cases it leaves alone)."""


def rebuild_with_globals(forward: Any, replacements: Mapping[str, Replacement]) -> Callable | None:
    """``forward`` rebuilt so that each name of ``replacements`` is ``replacements[name](original)``.

    Returns None when the forward (under its decorators) is not a plain function that reads every one
    of those names as a global of its module: then there is nothing this can safely replace.
    """
    wrappers = []
    while hasattr(forward, "__wrapped__"):
        wrappers.append(forward)
        forward = forward.__wrapped__
    rebuilt = _rebuild_plain(forward, replacements)
    for wrapper in reversed(wrappers):
        if rebuilt is None:
            return None
        if not _routes_only(wrapper, [forward.__globals__[name] for name in replacements]):
            rebuilt = _rewrap(wrapper, wrapper.__wrapped__, rebuilt)
    return rebuilt


def _rebuild_plain(forward: Any, replacements: Mapping[str, Replacement]) -> Callable | None:
    code = getattr(forward, "__code__", None)
    if not isinstance(forward, types.FunctionType) or any(
        name not in code.co_names or name not in forward.__globals__ for name in replacements
    ):
        return None
    namespace = dict(forward.__globals__)
    for name, replace in replacements.items():
        namespace[name] = replace(namespace[name])
    # Without __name__, Dynamo guards on this dict itself; with it, Dynamo would re-import the
    # modeling module by name and guard on the stock globals instead.
    del namespace["__name__"]
    rebuilt = types.FunctionType(code, namespace, forward.__name__, forward.__defaults__, forward.__closure__)
    rebuilt.__kwdefaults__ = forward.__kwdefaults__
    functools.update_wrapper(rebuilt, forward, updated=())
    del rebuilt.__wrapped__  # introspection should see the rebuilt function, not the class's
    return rebuilt


def _routes_only(wrapper: Any, replaced: list[Any]) -> bool:
    """Whether ``wrapper`` is the ``kernels`` package's router for functions all of which are among
    ``replaced`` (the globals the rebuild replaces; the router holds its functions in its closure)."""
    if not str(getattr(wrapper, "__globals__", {}).get("__name__")).startswith("kernels."):
        return False
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            routed = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(routed, (list, tuple)) and routed and all(callable(f) for f in routed):
            return all(any(f is g for g in replaced) for f in routed)
    return False


def _rewrap(wrapper: Any, original: Any, replacement: Callable) -> Callable | None:
    """``wrapper`` rebuilt so that it calls ``replacement`` where it called ``original`` (found in
    its closure), or None when it holds ``original`` some other way."""
    cells = getattr(wrapper, "__closure__", None) or ()
    if not isinstance(wrapper, types.FunctionType) or not any(_holds(c, original) for c in cells):
        return None
    closure = tuple(types.CellType(replacement) if _holds(c, original) else c for c in cells)
    code = wrapper.__code__
    rebuilt = types.FunctionType(code, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, closure)
    rebuilt.__kwdefaults__ = wrapper.__kwdefaults__
    functools.update_wrapper(rebuilt, replacement, updated=())
    return rebuilt


def _holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
