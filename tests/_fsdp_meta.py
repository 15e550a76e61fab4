"""Four-process ``SlothFSDPStrategy`` runs of models built on the meta device (CPU/gloo tests).

Imported as ``import _fsdp_meta`` (``tests/`` is on ``sys.path``). Each rank fills only its own
shards: from seeded random values, or from a safetensors checkpoint of the tiny model (saved by
each rank into its own directory, so no rank waits for another before training starts).
"""

from __future__ import annotations

import os
from pathlib import Path

import _fsdp

from lightning_sloth.data import build_char_tokenizer
from lightning_sloth.quant.loading import RandomWeights

WORLD = 4
# hidden 48: the k/v projections' 4-bit scales ([24, 48] weights: 18 blocks) split 5/5/5/3 over four
# ranks while their codes split 4.5 blocks each, so a rank's codes and scales cover different
# elements (the general case of quantize_rows).
HIDDEN = 48
RANDOM = RandomWeights(seed=3)


def _record(recorder) -> dict:
    return {
        "steps": recorder.steps,
        "losses": recorder.losses,
        "report": recorder.strategy_report,
        "stats": recorder.shard_stats,
        "codes_sharded": recorder.codes_sharded,
    }


def meta_runs(tmp: Path) -> dict:
    """A Qwen3-MoE with LoRA on attention and experts, built on the meta device: float32 with
    seeded random shards, and NF4 (projections and 3-D experts) quantised per rank from a
    checkpoint that stores the experts one by one (as transformers saves them)."""
    checkpoint = tmp / f"checkpoint_{os.environ['RANK']}"
    _fsdp.tiny_model("qwen3_moe", len(build_char_tokenizer()), hidden=HIDDEN).save_pretrained(checkpoint)
    settings = dict(hidden=HIDDEN, max_steps=1)
    return {
        "moe_random": _record(_fsdp.fit("qwen3_moe", True, meta_weights=RANDOM, **settings)),
        "moe_nf4_checkpoint": _record(
            _fsdp.fit("qwen3_moe", True, quantize="nf4", meta_weights=str(checkpoint), **settings)
        ),
    }
