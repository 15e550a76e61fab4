"""LoRA on the experts from PEFT's ``target_parameters``, computed without delta weights.

``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])`` (peft 0.21) wraps a
layer's experts module in nested ``lora.ParamWrapper`` modules, one per targeted 3-D parameter. On
each forward PEFT folds ``W + s * lhs @ rhs`` into the weight through a parametrization: a new
tensor the size of the whole expert stack, and its backward. The forward installed here on the
outermost wrapper reads the same factors and passes them to
:func:`~lightning_sloth.moe.experts.experts_forward`, which applies them as rank-r grouped GEMMs.

PEFT's factor layout for a 3-D parameter with E experts and rank r, read exactly as its
``get_delta_factors`` does::

    lora_A.weight [r * E, in]  -> view (E, r, in)                       A_e
    lora_B.weight [out, r * E] -> view (out, r, E) -> permute (E, out, r) B_e

with ``in``/``out`` the projection's input and output sizes (PEFT swaps the stored ``[E, out, in]``
of Qwen3-MoE/Mixtral; GPT-OSS stores ``[E, in, out]``). Both give ``delta_e = B_e A_e`` in
``[out, in]`` terms, i.e. ``x -> x W_e + s (x A_e^T) B_e^T``. PEFT decides the orientation from the
module's ``is_transposed`` flag; Llama 4's experts store ``[E, in, out]`` without the flag, so PEFT
reads them as ``[E, out, in]`` and its delta is ``B_e A_e`` over the stored ``[in, out]``: there
the factors swap roles (``x -> x W_e + s (x B_e) A_e``), which :func:`expert_lora_factors` does. The adapter's parameters, names and
saved format are PEFT's own, so ``save_pretrained``/``PeftModel.from_pretrained`` work unchanged.

Anything outside the plain case (several or no active adapters, merged or disabled adapters, a
non-3-D parameter) runs PEFT's own forward.
"""

from __future__ import annotations

import types
from typing import Any

from torch import Tensor, nn

from lightning_sloth.moe.experts import LoraFactors, experts_forward
from lightning_sloth.moe.fp8 import expert_fp8_storage
from lightning_sloth.moe.layouts import LAYOUTS, experts_model_type, layout_of
from lightning_sloth.moe.quant import expert_storage

__all__ = [
    "expert_lora_factors",
    "experts_and_lora",
    "install_lora_experts",
    "lora_experts_forward",
    "uninstall_lora_experts",
]

_MARK = "_sloth_lora_experts"


def _param_wrapper_class() -> type | None:
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return None
    return ParamWrapper


def _chain(wrapper: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The nested ParamWrappers from ``wrapper`` inwards, and the experts module they wrap."""
    param_wrapper = _param_wrapper_class()
    chain, module = [], wrapper
    while param_wrapper is not None and isinstance(module, param_wrapper):
        chain.append(module)
        module = module.base_layer
    return chain, module


def expert_lora_factors(wrapper: nn.Module, transposed: bool | None = None) -> LoraFactors | None:
    """The factors of one ``ParamWrapper`` in the plain case, else None.

    Plain: adapters enabled and unmerged, exactly one active adapter present on this wrapper, a
    3-D parameter with more than one expert.

    Args:
        wrapper: the ``ParamWrapper``.
        transposed: the experts' true layout (:class:`~lightning_sloth.moe.layouts.ExpertLayout`);
            where PEFT read the weight the other way round, A and B swap roles (module docstring).
    """
    if wrapper.disable_adapters or wrapper.merged or getattr(wrapper, "num_experts", 1) <= 1:
        return None
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(adapters) != 1 or len(wrapper.active_adapters) != 1:
        return None
    adapter = adapters[0]
    experts = wrapper.num_experts
    weight_a = wrapper.lora_A[adapter].weight
    weight_b = wrapper.lora_B[adapter].weight
    a = weight_a.view(experts, -1, weight_a.shape[-1])
    b = weight_b.view(weight_b.shape[0], -1, experts).permute(2, 0, 1)
    # PEFT swaps in/out (reads [E, out, in]) exactly when the base module is not flagged transposed.
    peft_read_out_in = getattr(
        wrapper, "_did_swap_in_out_features", not getattr(wrapper.get_base_layer(), "is_transposed", False)
    )
    if transposed is not None and peft_read_out_in == transposed:
        a, b = b.transpose(1, 2).contiguous(), a.transpose(1, 2)  # the GEMMs take A [E, r, in] row-major
    return LoraFactors(a=a, b=b, scale=float(wrapper.scaling[adapter]))


def experts_and_lora(module: nn.Module) -> tuple[nn.Module, dict[str, LoraFactors] | None]:
    """The experts module inside PEFT's ``ParamWrapper`` chain (or ``module`` itself) and its LoRA factors.

    Returns:
        ``(experts, {parameter_name: LoraFactors})`` (an empty dict without adapters), or
        ``(experts, None)`` outside the plain case (see :func:`expert_lora_factors`).

    Raises:
        ValueError: LoRA outside the plain case on a weight stored in 4 bits or FP8 (nothing else can run it).
    """
    chain, experts = _chain(module)
    transposed = layout_of(experts).transposed if chain else None
    lora = {}
    for wrapper in chain:
        factors = expert_lora_factors(wrapper, transposed)
        if factors is None or wrapper.parameter_name in lora:
            name = wrapper.parameter_name
            if expert_storage(experts, name) is not None or expert_fp8_storage(experts, name) is not None:
                raise ValueError(
                    f"PEFT LoRA on {name} of {type(experts).__name__}, whose expert weight is "
                    "stored in 4 bits or FP8, is not in the plain case (one active, unmerged adapter made on the dense "
                    "3-D weight): apply the adapters before quantising and keep one active adapter"
                )
            return experts, None
        lora[wrapper.parameter_name] = factors
    return experts, lora


def lora_experts_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Forward of the outermost ``ParamWrapper`` around an experts module (instance method).

    Falls back to PEFT's forward outside the plain case (see :func:`expert_lora_factors`).
    """
    experts, lora = experts_and_lora(self)
    if lora is None or len(args) + len(kwargs) != 2:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    top_k_index, top_k_weights = (*args, *kwargs.values())
    return experts_forward(experts, hidden_states, top_k_index, top_k_weights, lora)


setattr(lora_experts_forward, _MARK, True)


def install_lora_experts(model: nn.Module) -> list[str]:
    """Give every outermost ``ParamWrapper`` around a supported experts module :func:`lora_experts_forward`.

    In place, per instance (``del module.forward`` undoes it: :func:`uninstall_lora_experts`).

    Returns:
        Qualified names of the wrappers that got it.
    """
    param_wrapper = _param_wrapper_class()
    if param_wrapper is None:
        return []
    names = []
    inner = set()
    for name, module in model.named_modules():
        if isinstance(module, param_wrapper) and id(module) not in inner:
            chain, experts = _chain(module)
            inner.update(id(m) for m in chain[1:])
            # Experts dispatched through ExpertsInterface only (Llama 4's block calls experts_forward
            # itself, with the factors from experts_and_lora).
            dispatched = hasattr(experts, "is_transposed")
            if dispatched and experts_model_type(experts) in LAYOUTS and hasattr(experts, "gate_up_proj"):
                module.forward = types.MethodType(lora_experts_forward, module)
                names.append(name)
    return names


def uninstall_lora_experts(model: nn.Module) -> int:
    """Remove :func:`lora_experts_forward` wherever it is installed; returns how many."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if getattr(getattr(forward, "__func__", None), _MARK, False):
            del module.forward
            count += 1
    return count
