"""Regional compilation: ``torch.compile`` each decoder layer in place.

A decoder stack is N copies of one block, so compiling the block (not the whole model) costs a
trace and an Inductor build per distinct input signature, not per layer (typically two: layer 0,
whose input needs no gradient when the embeddings are frozen, and the rest), and keeps the
embedding, the loss and the Python between layers eager. ``nn.Module.compile`` compiles the module's ``_call_impl`` in place:
the layer object, its parameters and the state-dict keys stay as they were (``torch.compile(layer)``
would wrap it in an ``OptimizedModule`` and prefix every key with ``_orig_mod.``).

Order and activation checkpointing:

1. ``apply_kernels`` first: the compiled call reads the patched forwards when it first traces.
2. transformers' own checkpointing (``model.gradient_checkpointing_enable()``) may come before or
   after, and works both ways on both transformers versions the package supports:

   - transformers 5.17 checkpoints in ``GradientCheckpointingLayer.__call__``, around
     ``nn.Module.__call__``: the checkpoint stays eager *outside* the compiled region and the
     backward's recompute re-runs the compiled forward.
   - transformers 5.23 checkpoints inside the class's ``forward``: the compiled region contains
     ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (transformers' default), which Dynamo
     captures as a region of the graph that the compiled backward recomputes (no graph break).

   Both are tested (``tests/test_compile.py``, on 5.23 here and 5.17 on the GPU machine).
   Train with ``use_cache=False`` (as ``PackedBatch.model_inputs()`` does): a KV cache object makes
   every layer recompile.

3. lightning_sloth's own checkpointing with the activation offloader
   (``lightning_sloth.offload.apply_checkpointing``) keeps its saved-tensor hooks eager and compiles
   the layer inside its checkpoint itself (``compile_layers=...``): use that instead of this function
   when offloading (``SlothStrategy`` does).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = ["compile_blocks", "decoder_blocks"]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformers ``GradientCheckpointingLayer`` modules (decoder layers) of ``model``, in order.

    Args:
        model: a transformers model or a PEFT model around one.

    Raises:
        TypeError: if ``model`` has none.
    """
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise TypeError(
            f"{type(model).__name__} has no transformers GradientCheckpointingLayer (decoder layer) to compile"
        )
    return blocks


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (``nn.Module.compile``).

    Idempotent: a layer that is already compiled is left as it is. Module and parameter names, and so
    checkpoints and PEFT adapters, are unchanged.

    Args:
        model: a transformers model or a PEFT model around one; patch it with ``apply_kernels`` first.
        **compile_kwargs: passed to ``torch.compile`` (e.g. ``fullgraph=True``, ``dynamic=False``,
            ``mode="max-autotune-no-cudagraphs"``, ``backend="aot_eager"``).

    Returns:
        The number of compiled decoder layers.

    Raises:
        TypeError: if ``model`` has no decoder layers.
    """
    blocks = decoder_blocks(model)
    for block in blocks:
        # nn.Module.compile stores the compiled call here; compiling again would discard its cache.
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**compile_kwargs)
    return len(blocks)
