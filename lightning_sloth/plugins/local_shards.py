r"""FSDP2's sharded gradients and optimizer states worked on through their local shards.

FSDP2 makes every parameter a ``DTensor`` sharded on dim 0, and its gradient and optimizer states
too. ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim`` take them as they are: every per-tensor
norm, every foreach/fused update is a ``DTensor`` operation with its own sharding propagation on
the host. A LoRA model has hundreds of small adapter tensors, so that host time is a visible part
of a short step (two CPU processes, 224 adapter-shaped tensors: clipping about 13 ms, a fused AdamW
step about 13 ms, against about 4 and 3 ms through the local shards). Where every tensor is sharded
(``Shard`` placements only, the layout FSDP2 gives a parameter):

- the squared norms of the local shards add up to the global one, so one ``all_reduce`` of one
  scalar per mesh gives the gradient norm (:func:`sharded_grad_norm`, accumulated in float32;
  torch rounds a bf16 tensor's norm to bf16 first) and the clipping multiplies the local shards in
  place (:func:`clip_sharded_grads_`), without a host sync;
- an elementwise optimizer (AdamW, Adam, SGD: each element's update reads only that element's
  parameter, gradient and states) steps the local shards as plain tensors and gives what the
  ``DTensor`` step gives (:func:`stepping_local_shards`): states it creates are stored back as
  ``DTensor``\ s with their parameter's layout, so checkpoints are unchanged. Other optimizers (a
  norm over a whole parameter, factored moments) are left to the ``DTensor`` path.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor


def _local_shards(grads: list[Tensor]) -> tuple[list[Tensor], list] | None:
    """The local tensors of ``grads`` and their meshes when every one is a ``DTensor`` sharded on
    every mesh dimension; ``None`` otherwise (plain tensors, or replicated / partial placements).

    Read from each ``DTensor``'s spec and local tensor directly, as FSDP2 does: ``to_local()`` is an
    autograd function, and hundreds of calls of it cost milliseconds of host time."""
    from torch.distributed.tensor import DTensor, Shard

    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    specs = [g._spec for g in grads]
    if not all(all(isinstance(p, Shard) for p in spec.placements) for spec in specs):
        return None
    return [g._local_tensor for g in grads], [spec.mesh for spec in specs]


def sharded_grad_norm(grads: Iterable[Tensor]) -> Tensor | None:
    """The 2-norm of all ``grads`` together as a plain float32 scalar on their device, computed
    from the local shards with one ``all_reduce`` per distinct mesh; ``None`` where the gradients
    are not all sharded ``DTensor``\\ s (the caller takes torch's own path)."""
    grads = list(grads)
    found = _local_shards(grads)
    if found is None:
        return None
    locals_, meshes = found
    device = locals_[0].device
    squares: dict[int, Tensor] = {}
    groups = {id(mesh): mesh for mesh in meshes}
    for key, mesh in groups.items():
        mine = [t for t, m in zip(locals_, meshes) if id(m) == key and t.numel()]
        total = torch.zeros((), dtype=torch.float32, device=device)
        if mine:
            norms = torch._foreach_norm(mine, 2, dtype=torch.float32)  # accumulated in float32, no copies
            total = torch.stack(norms).square().sum()
        for dim in range(mesh.ndim):  # the shards of every mesh dimension add up
            dist.all_reduce(total, group=mesh.get_group(dim))
        squares[key] = total
    return torch.stack(list(squares.values())).sum().sqrt()


def clip_sharded_grads_(parameters: Iterable[Tensor], max_norm: float) -> Tensor | None:
    """Scale the sharded gradients of ``parameters`` in place so their total 2-norm is at most
    ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``: coefficient ``max_norm / (norm + 1e-6)``,
    clamped to 1); returns the norm before clipping, or ``None`` (nothing done) where the
    gradients are not all sharded ``DTensor``\\ s."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = sharded_grad_norm(grads)
    if norm is None:
        return None
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g._local_tensor)
    for tensors in by_dtype.values():
        torch._foreach_mul_(tensors, coefficient)
    return norm


ELEMENTWISE_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
r"""Optimizers whose update of an element reads only that element's parameter, gradient and states:
stepping the local shards equals stepping the ``DTensor``\ s."""


def steps_on_local_shards(optimizer) -> bool:
    r"""Whether :func:`stepping_local_shards` applies to ``optimizer``: one of
    :data:`ELEMENTWISE_OPTIMIZERS` (exactly: a subclass may change the update) whose parameters are
    all sharded ``DTensor``\ s."""
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return _local_shards(params) is not None


@contextlib.contextmanager
def stepping_local_shards(optimizer) -> Iterator[None]:
    """Inside, ``optimizer`` holds the local shards of its ``DTensor`` parameters, their gradients
    and their states as plain tensors (the same storage: updates land in the shards); on leaving,
    its parameter groups and states are its own again, and a state the step created is stored as a
    ``DTensor`` with its parameter's mesh, placements and global shape (tensors of another shape,
    such as the step count, as they are). Use with :func:`steps_on_local_shards`."""
    from torch.distributed.tensor import DTensor

    groups = optimizer.param_groups
    own_params = [group["params"] for group in groups]
    own_state = optimizer.state
    local_state: defaultdict = defaultdict(dict)
    pairs = []
    for group in groups:
        local_params = []
        for param in group["params"]:
            local = param._local_tensor
            local.grad = None if param.grad is None else param.grad._local_tensor
            if param in own_state:
                local_state[local] = {
                    k: v._local_tensor if isinstance(v, DTensor) else v for k, v in own_state[param].items()
                }
            local_params.append(local)
            pairs.append((param, local))
        group["params"] = local_params
    optimizer.state = local_state
    try:
        yield
    finally:
        for group, params in zip(groups, own_params):
            group["params"] = params
        optimizer.state = own_state
        for param, local in pairs:
            local.grad = None
            new = local_state.get(local)
            if not new:
                continue
            old = own_state.get(param, {})
            state = {}
            for key, value in new.items():
                before = old.get(key)
                if isinstance(before, DTensor) and before._local_tensor is value:
                    state[key] = before  # updated in place
                elif isinstance(value, Tensor) and value.shape == local.shape and value.dim() > 0:
                    spec = param._spec
                    state[key] = DTensor.from_local(
                        value,
                        spec.mesh,
                        spec.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                else:
                    state[key] = value
            own_state[param] = state
