"""Mixture-of-experts: sync-free routing, grouped expert GEMMs as ``sloth::`` ops, LoRA on the experts.

Rooms:

- :mod:`.routing`: per-family routers and :func:`group_by_expert` (sort, counts, int32 ends);
- :mod:`.router`: the softmax/top-k families' router as one ``sloth::moe_router_topk`` op (one Triton
  kernel on CUDA: the float32 logits, the top k and the weights; one for its backward);
- :mod:`.gemm`: the grouped GEMM ops, with and without per-expert LoRA;
- :mod:`.ops`: the other ``sloth::moe_*`` ops (gather, activations, combine);
- :mod:`.layouts`: how each family stores its experts, and the names the "sloth" experts go by;
- :mod:`.experts`: the "sloth" experts forward for transformers' ``ExpertsInterface``;
- :mod:`.peft`: PEFT ``target_parameters`` LoRA on the experts without delta weights;
- :mod:`.fused`: the fused permutation (the first GEMM reads token rows through the sort, the second
  writes through it into the combine);
- :mod:`.switch`: when the experts use it (the model's ``moe="fused"`` / ``"separate"``, else
  :func:`~.switch.set_fused_permutation`; by default where the rows are on CUDA);
- :mod:`.indexed`: the indexed grouped GEMMs under :mod:`.fused`, Triton and plain torch;
- :mod:`.quant`: 4-bit expert weights (``SlothPrecision(quantize=...)``) and the grouped GEMM
  that dequantises them into a reusable buffer, forward and backward;
- :mod:`.fp8`: FP8 e4m3 expert weights (``SlothPrecision(base_dtype="fp8")``) and the grouped GEMM
  on Hopper's FP8 tensor cores (``torch._scaled_grouped_mm``), activations quantised per row.

``SlothStrategy`` selects all of it for every family of :data:`LAYOUTS` (Qwen3-MoE, Mixtral, GPT-OSS,
Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE, GLM-4-MoE, DeepSeek-V3, Llama 4; ``moe=False`` keeps
transformers' experts); by hand::

    from lightning_sloth.patching import apply_experts
    apply_experts(model)   # registers "sloth", selects it, routes PEFT expert LoRA through it
"""

from lightning_sloth.moe.experts import LoraFactors, experts_forward, register
from lightning_sloth.moe.gemm import grouped_mm, lora_grouped_mm
from lightning_sloth.moe.layouts import ENDS_ATTR, EXPERTS_NAME, LAYOUTS, ExpertLayout, layout_of
from lightning_sloth.moe.ops import clamped_swiglu, moe_combine, moe_gather, moe_sum, weighted_swiglu
from lightning_sloth.moe.peft import (
    expert_lora_factors,
    experts_and_lora,
    install_lora_experts,
    uninstall_lora_experts,
)
from lightning_sloth.moe.routing import ROUTERS, Grouping, counts_from_ends, group_by_expert

__all__ = [
    "ENDS_ATTR",
    "EXPERTS_NAME",
    "LAYOUTS",
    "ROUTERS",
    "ExpertLayout",
    "Grouping",
    "LoraFactors",
    "clamped_swiglu",
    "expert_lora_factors",
    "experts_and_lora",
    "experts_forward",
    "counts_from_ends",
    "group_by_expert",
    "grouped_mm",
    "install_lora_experts",
    "layout_of",
    "lora_grouped_mm",
    "moe_combine",
    "moe_gather",
    "moe_sum",
    "register",
    "uninstall_lora_experts",
    "weighted_swiglu",
]
