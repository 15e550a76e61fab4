"""A data-parallel step's loss normalised by the global number of target tokens.

Each rank packs its own batches with the same token budget, so ranks (and micro-batches of one
accumulation window) carry different numbers of target tokens. Averaging per-rank means would
weight a token of a short batch more than one of a long batch; one process on the whole global
batch takes ``sum of token losses / all target tokens``. :class:`GlobalTokenLoss` gives exactly
that gradient with one all-reduce of a count per optimizer step::

    micro-batch (rank r, i of k):  backward of  S_ri            (S = sum of token losses)
    data parallel + Lightning:     grad  = sum_ri dS_ri / (W k)  (mean over W ranks, / k)
    before the optimizer step:     grad *= W k / N,  N = all-reduce(sum_i n_ri)
                                   grad  = sum_ri dS_ri / N

The loss returned for the backward keeps the value of the micro-batch's own mean (what the
logs and progress bar show); only its gradient is the sum's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor


class GlobalTokenLoss:
    """Accumulates target-token counts over one optimizer step and rescales the gradients.

    Call :meth:`loss` on every micro-batch and :meth:`rescale_gradients` once after the step's
    last backward and before clipping and the optimizer step.
    """

    def __init__(self) -> None:
        self.local_tokens = 0

    def loss(self, mean_loss: Tensor, num_target_tokens: int) -> Tensor:
        """The value of ``mean_loss`` with the gradient of its sum over ``num_target_tokens`` tokens.

        Args:
            mean_loss: scalar, the micro-batch's loss averaged over its target tokens.
            num_target_tokens: the micro-batch's target tokens on this rank (a host int).
        """
        self.local_tokens += num_target_tokens
        total = mean_loss * num_target_tokens
        return mean_loss.detach() + (total - total.detach())

    def rescale_gradients(
        self, parameters: Iterable[Tensor], world_size: int, accumulate_grad_batches: int
    ) -> Tensor:
        """Scale every gradient by ``world_size * accumulate_grad_batches / N``; returns ``N``.

        ``N`` is the step's target tokens summed over micro-batches and ranks (one all-reduce when
        a process group is initialised; no host sync). Resets the count for the next step.
        """
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        distributed = dist.is_available() and dist.is_initialized() and world_size > 1
        device = grads[0].device if grads else torch.device("cpu")
        if distributed and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        count = torch.tensor(float(self.local_tokens), device=device, dtype=torch.float64)
        self.local_tokens = 0
        if distributed:
            dist.all_reduce(count)
        scale = (world_size * accumulate_grad_batches / count.clamp(min=1)).float()
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].device))
        return count


def _local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (a view sharing its memory), or ``tensor`` itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
