"""Packed hybrid linear attention: the short causal convolution and the gated delta rule of Gated
DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), with no state crossing a document boundary.

A packed row holds several documents end to end (``B == 1``, boundaries in ``cu_seqlens``, as for
the packed softmax attention). A linear-attention layer carries state along the row twice: the
depthwise convolution reads the ``W - 1`` positions before each token, and the delta rule's
``[Dk, Dv]`` state runs from the first position to the last. Both restart at zero at every segment
here, so each document is computed as if it ran alone::

    cu_seqlens = [0, 3, 5]     a0 a1 a2 | b0 b1
    conv window (W = 4)        b1 sees b0 b1 (and zeros), never a1 a2
    delta-rule state           S = 0 at a0 and again at b0

Backends (:func:`set_linear_attention_backend`):

* ``"auto"`` (default): on CUDA flash-linear-attention's Triton kernels (``fla-core``, the optional
  extra ``pip install 'lightning-sloth[linear]'``; an ``ImportError`` naming it when it is missing),
  with the batch's chunk table built once and shared by every layer (:mod:`.fla_kernels`); on the
  CPU the reference.
* ``"reference"``: plain torch, one segment at a time, the same operations as transformers' own
  fallbacks (:mod:`.reference`); the CPU test oracle.

The model side — which transformers modules get these, through the family table — is in
:mod:`lightning_sloth.patching` (the ``linear_attention`` op).
"""

from lightning_sloth.linear_attention.fla_kernels import EXTRA, fla_available
from lightning_sloth.linear_attention.packed import (
    BACKENDS,
    get_linear_attention_backend,
    packed_causal_conv1d,
    packed_gated_delta_rule,
    set_linear_attention_backend,
)
from lightning_sloth.linear_attention.reference import causal_conv1d_reference, gated_delta_rule_reference

__all__ = [
    "BACKENDS",
    "EXTRA",
    "causal_conv1d_reference",
    "fla_available",
    "gated_delta_rule_reference",
    "get_linear_attention_backend",
    "packed_causal_conv1d",
    "packed_gated_delta_rule",
    "set_linear_attention_backend",
]
