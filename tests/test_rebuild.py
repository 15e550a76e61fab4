"""``rebuild_with_globals``: a forward rebuilt over a namespace where chosen globals are ours, its
decorators rebuilt around it, and the ``kernels`` package's router (transformers 5.25 on) dropped
where every function it routes is replaced."""

import functools
import types

from lightning_sloth.patching._rebuild import rebuild_with_globals

MODELING = """
import functools

def apply_rotary_pos_emb(x):
    return ("stock rope", x)

def other(x):
    return ("stock other", x)

def wrap(fn):  # a decorator that keeps the function in its closure (deprecate_kwarg's way)
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x)
    return wrapper

def make(router):
    class RopeOnly:
        @wrap
        def forward(self, x):
            return apply_rotary_pos_emb(x)

    class RopeAndOther:
        def forward(self, x):
            return apply_rotary_pos_emb(other(x))

    return router(apply_rotary_pos_emb)(RopeOnly), router(apply_rotary_pos_emb, other)(RopeAndOther)
"""

ROUTER = """
import functools

CALLS = []

def use_kernelized_func(*routed):  # the shape of kernels' per-instance router
    def decorator(cls):
        orig_forward = cls.forward

        @functools.wraps(orig_forward)
        def new_forward(self, *args, **kwargs):
            CALLS.append([f.__name__ for f in routed])
            return orig_forward(self, *args, **kwargs)

        cls.forward = new_forward
        return cls
    return decorator
"""


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def ours(original):
    return functools.partial(lambda original, x: ("ours", x), original)


def test_the_router_goes_where_the_rebuild_replaces_all_it_routes_and_stays_otherwise():
    router = _module("kernels._internals.layer.fake", ROUTER)
    rope_only, rope_and_other = _module("fake_modeling", MODELING).make(router.use_kernelized_func)
    assert rope_only.forward(None, 1) == ("stock rope", 1) and router.CALLS == [["apply_rotary_pos_emb"]]
    router.CALLS.clear()

    rebuilt = rebuild_with_globals(rope_only.forward, {"apply_rotary_pos_emb": ours})
    assert rebuilt(None, 2) == ("ours", 2)
    assert router.CALLS == []  # the router is gone, the decorator under it kept

    rebuilt = rebuild_with_globals(rope_and_other.forward, {"apply_rotary_pos_emb": ours})
    assert rebuilt(None, 3) == ("ours", ("stock other", 3))
    assert router.CALLS == [["apply_rotary_pos_emb", "other"]]  # `other` is still routed


def test_a_wrapper_from_elsewhere_is_rebuilt_around_the_forward():
    not_kernels = _module("some_other_package.layer", ROUTER)
    rope_only, _ = _module("fake_modeling", MODELING).make(not_kernels.use_kernelized_func)
    rebuilt = rebuild_with_globals(rope_only.forward, {"apply_rotary_pos_emb": ours})
    assert rebuilt(None, 4) == ("ours", 4)
    assert not_kernels.CALLS == [["apply_rotary_pos_emb"]]
