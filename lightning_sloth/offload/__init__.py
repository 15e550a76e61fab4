"""Activation offloading around per-layer checkpointing, and the per-layer memory plan.

One room per job:

- :mod:`~lightning_sloth.offload.host_pool`: the reusable pool of pinned host blocks;
- :mod:`~lightning_sloth.offload.hooks`: the saved-tensor hooks that move checkpointed layer
  inputs to the host and prefetch them back one layer ahead of the backward
  (:class:`ActivationOffloader`; its Lightning callback is ``lightning_sloth.plugins.OffloadStatsCallback``);
- :mod:`~lightning_sloth.offload.checkpoint`: the per-layer checkpoint wrapper
  (:func:`apply_checkpointing`, :class:`CheckpointedLayers`), which measures each layer for the plan;
- :mod:`~lightning_sloth.offload.planner`: keep / recompute / offload per layer within a budget
  (:func:`plan_layers`, :func:`plan_peak_bytes`).
"""

from lightning_sloth.offload.checkpoint import CheckpointedLayers, apply_checkpointing
from lightning_sloth.offload.hooks import ActivationOffloader, OffloadPolicy
from lightning_sloth.offload.host_pool import HostBufferPool, _block_bytes, _cuda_get_last_error
from lightning_sloth.offload.planner import LayerMode, plan_layers, plan_peak_bytes

__all__ = [
    "ActivationOffloader",
    "CheckpointedLayers",
    "HostBufferPool",
    "LayerMode",
    "OffloadPolicy",
    "_block_bytes",
    "_cuda_get_last_error",
    "apply_checkpointing",
    "plan_layers",
    "plan_peak_bytes",
]
