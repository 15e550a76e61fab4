"""Model patching: the ``sloth::`` ops in transformers models, per family, and regional compile.

Typical use (``SlothStrategy(kernels=..., compile=...)`` does this at ``setup``)::

    report = apply_kernels(model, KernelSettings(cross_entropy=False))  # in place, per instance
    print(report.counts)   # {'rms_norm': 5, 'rope': 2, 'glu': 2, 'cross_entropy': 0, 'lora': 14}
    compile_blocks(model, fullgraph=True)                               # each decoder layer

Which module class gets which op is one table, :data:`FAMILIES` (``families.py``); the replacement
forwards, one per op, are in ``_forwards.py``; the support matrix the docs show is generated from the
table and the tests (``support.py``). Other rooms read what is installed through
:func:`patched_op`, and tell the patched decoder layers that their output goes unread (a
checkpoint's recompute) with :func:`layer_output_unread`. :func:`chunk_mlps` runs the patched gated
MLPs over token chunks at long sequences (``mlp_chunks.py``).
"""

from lightning_sloth.patching._apply import (
    OPS,
    KernelSettings,
    PatchReport,
    apply_kernels,
    chunk_mlps,
    unpatch,
)
from lightning_sloth.patching._forwards import layer_output_unread, patched_op, takes_target_count
from lightning_sloth.patching.compile import compile_blocks, decoder_blocks
from lightning_sloth.patching.experts import (
    ExpertsReport,
    apply_experts,
    install_router,
    moe_families,
    uninstall_router,
)
from lightning_sloth.patching.families import FAMILIES, Family, NormStyle
from lightning_sloth.patching.support import SupportRow, read_test_sources, support_markdown, support_matrix

__all__ = [
    "FAMILIES",
    "OPS",
    "ExpertsReport",
    "Family",
    "KernelSettings",
    "NormStyle",
    "PatchReport",
    "SupportRow",
    "apply_experts",
    "apply_kernels",
    "chunk_mlps",
    "compile_blocks",
    "decoder_blocks",
    "install_router",
    "layer_output_unread",
    "moe_families",
    "patched_op",
    "read_test_sources",
    "support_markdown",
    "support_matrix",
    "takes_target_count",
    "uninstall_router",
    "unpatch",
]
