"""The replacement forwards, one per op, shared by every family of the table.

Each is installed on one module instance (:func:`install`: ``module.forward = MethodType(fn,
module)``), shadowing its class's forward for that module only. Other models of the same class in
the process keep the stock forward, state-dict keys do not change, ``copy.deepcopy`` rebinds the
method to the copy, and :func:`restore` (``del module.forward``) undoes it. A forward built for a
family or style comes from a cached factory, so patching twice installs the same function object.

Rotary embedding and linear attention need one trick: transformers' forwards call *module-level*
functions of their modeling file (``apply_rotary_pos_emb``; ``causal_conv1d_fn`` and
``torch_chunk_gated_delta_rule``). Rebinding those globals would change every model of the family in
the process; instead :func:`rope_attention_forward` (and :mod:`.linear_forwards`) rebuild the
class's own forward (same code object) over a copy of its module namespace in which those names are
ours (:mod:`._rebuild`), and install the rebuilt function on the patched instances only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.ops.glu import geglu, swiglu
from lightning_sloth.ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, shift_labels
from lightning_sloth.ops.lora_groups import group_output
from lightning_sloth.ops.lora_layers import fused_lora_forward
from lightning_sloth.ops.rms_norm import add_rms_norm, rms_norm
from lightning_sloth.ops.rope import apply_rope
from lightning_sloth.patching._rebuild import rebuild_with_globals
from lightning_sloth.patching.families import Family, GluLayout, NormStyle, RopeForm, RopeLayout
from lightning_sloth.patching.mlp_chunks import (
    chunk_size_for,
    token_chunked,
    unread_chunked,
)
from lightning_sloth.quant.lora import lora_4bit_forward

log = logging.getLogger(__name__)

_OP_ATTR = "_sloth_op"
"""Attribute naming the op on every forward this module installs."""


def _op_forward(op: str) -> Callable[[Callable], Callable]:
    def mark(fn: Callable) -> Callable:
        setattr(fn, _OP_ATTR, op)
        return fn

    return mark


def patched_op(module: nn.Module) -> str | None:
    """The op whose forward is installed on ``module``, or None when it runs its class's forward."""
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "__func__", None), _OP_ATTR, None)


def has_foreign_forward(module: nn.Module) -> bool:
    """Whether another library gave ``module`` an instance forward (e.g. accelerate's device hooks)."""
    return "forward" in module.__dict__ and patched_op(module) is None


def install(module: nn.Module, forward: Callable) -> None:
    """Make ``forward`` (an op-marked function taking the module first) the forward of ``module``."""
    current = module.__dict__.get("forward")
    if getattr(current, "__func__", None) is not forward:
        module.forward = types.MethodType(forward, module)


def restore(module: nn.Module) -> bool:
    """Give ``module`` back its class's forward if one of ours is installed; True if it was."""
    if patched_op(module) is None:
        return False
    del module.forward
    return True


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


# ----------------------------------------------------------------------------------------- RMSNorm
def norm_eps(module: nn.Module, eps_attr: str) -> float:
    """``eps_attr``, or ``variance_epsilon`` where transformers renamed it (5.25: Gemma 4, Llama 4)."""
    eps = getattr(module, eps_attr, None)
    return module.variance_epsilon if eps is None else eps


@functools.cache
def rms_norm_forward(style: NormStyle) -> Callable:
    """RMSNorm forward for one :class:`NormStyle`."""
    eps_attr, offset = style.eps_attr, style.offset
    # The op takes the weight product in fp32 (one rounding) exactly when offset != 0.
    if style.fp32_product and offset == 0.0:
        # GPT-OSS rounds once without an offset: run it as ``(1 + (w - 1)) * x_hat``. For bf16/fp16
        # weights ``w - 1`` and the sum are exact in fp32; for fp32 weights within an ulp of 1.

        @_op_forward("rms_norm")
        def shifted(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            weight = self.weight.to(torch.float32) - 1.0
            return rms_norm(hidden_states, weight, norm_eps(self, eps_attr), 1.0)

        return shifted
    if not style.fp32_product and offset != 0.0:
        raise ValueError(f"rms_norm has no rounding order for {style}: an offset implies an fp32 product")

    @_op_forward("rms_norm")
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, norm_eps(self, eps_attr), offset)

    return forward


@functools.cache
def unit_rms_norm_forward(eps_attr: str) -> Callable:
    """RMSNorm forward of a norm without a weight (Llama 4's L2 norm, Gemma 4's v norm):
    ``x_hat`` rounded once to x's dtype, the op with a zero weight and offset 1 (``x_hat * (1 + 0)``,
    exact in every style)."""

    @_op_forward("rms_norm")
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros(hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
        return rms_norm(hidden_states, zero, norm_eps(self, eps_attr), 1.0)

    return forward


def norm_forward_for(style: NormStyle) -> Callable[[nn.Module], Callable]:
    """``forward_for`` of the norms column: the style's forward, or the unit-weight one for a norm
    without a weight parameter."""
    weighted, unit = rms_norm_forward(style), unit_rms_norm_forward(style.eps_attr)
    return lambda module: weighted if isinstance(getattr(module, "weight", None), torch.Tensor) else unit


# ------------------------------------------------------------------------------ pre-norm decoder layer
_DECODER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def pre_norm_decoder_fits(module: nn.Module) -> bool:
    """Whether ``module`` is a pre-norm decoder layer :func:`pre_norm_decoder_forward` reproduces:
    its class's forward reads exactly the four parts, and the second norm is a Llama-order RMSNorm."""
    forward = inspect.unwrap(getattr(type(module), "forward", None))
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    norm = getattr(module, "post_attention_layernorm", None)
    return (
        all(part in names and isinstance(getattr(module, part, None), nn.Module) for part in _DECODER_PARTS)
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and isinstance(getattr(norm, "variance_epsilon", None), float)
    )


def _checkpoints_in_forward(module: nn.Module) -> bool:
    """transformers >= 5.23 checkpoints inside the class's ``forward`` (a wrapper around the layer's
    code), earlier versions in ``__call__``; an instance forward must then checkpoint itself."""
    code = getattr(type(module).forward, "__code__", None)
    return code is not None and code.co_name == "forward_with_checkpointing"


@_op_forward("add_rms_norm")
def pre_norm_decoder_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """Pre-norm decoder layer (Llama, Mistral, Qwen2/3) with the residual add after attention and
    the norm before the MLP in one ``add_rms_norm``: one pass over the hidden states instead of two,
    forward and backward.

    Checkpointing stays as transformers does it: where its layer class checkpoints inside
    ``forward`` (>= 5.23) this forward calls the layer's ``_gradient_checkpointing_func`` the same
    way (cache arguments dropped); else the checkpoint around ``__call__`` wraps this forward.
    Positional arguments beyond the hidden states run the class's forward.
    """
    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if self.gradient_checkpointing and self.training and _checkpoints_in_forward(self):
        kwargs["use_cache"] = False
        kwargs.pop("past_key_values", None)  # the cache argument's names before and after 5.24
        kwargs.pop("cache", None)
        return self._gradient_checkpointing_func(
            functools.partial(_pre_norm_layer, self, **kwargs), hidden_states
        )
    return _pre_norm_layer(self, hidden_states, **kwargs)


def _pre_norm_layer(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    kwargs.setdefault("attention_mask", None)
    kwargs.setdefault("position_embeddings", None)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    norm = self.post_attention_layernorm
    if (
        hidden_states.dtype == residual.dtype == norm.weight.dtype
        and hidden_states.shape == residual.shape
        and not (norm._forward_hooks or norm._forward_pre_hooks)
    ):
        hidden_states, residual = add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon)
    else:
        # Mixed dtypes (float32 residuals under bf16 autocast) or a hooked norm: the unfused steps.
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states)
    if getattr(_UNREAD, "output", False) and torch.is_grad_enabled():
        return _gated_mlp_for_gradients(self.mlp, hidden_states, residual)
    return residual + self.mlp(hidden_states)


_UNREAD = threading.local()  # .output: the decoder layers' outputs are unread (a recompute)


@contextlib.contextmanager
def layer_output_unread():
    """Within the block, pre-norm decoder layers (:func:`pre_norm_decoder_forward`) run for their
    gradients alone: nothing reads their output's values, as in a checkpoint's recompute, so the
    fused LoRA ``down_proj`` skips its base product (``[tokens, I] x [I, hidden]``, the layer's
    last) and the residual add; the backward is unchanged."""
    previous = getattr(_UNREAD, "output", False)
    _UNREAD.output = True
    try:
        yield
    finally:
        _UNREAD.output = previous


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )


def _gated_mlp_for_gradients(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + mlp(x)`` for a backward only (see :func:`layer_output_unread`)."""
    size = chunk_size_for(mlp, x) if patched_op(mlp) == "glu" else None
    if size is not None:  # token chunks: the recompute computes no MLP rows (mlp_chunks.py)
        return unread_chunked(mlp, x, residual, size, _gated_mlp_for_gradients)
    hidden = _GLU_HIDDEN.get(getattr(mlp.__dict__.get("forward"), "__func__", None))
    down = getattr(mlp, "down_proj", None)
    if hidden is None or _hooked(mlp) or patched_op(down) != "lora" or _hooked(down):
        return residual + mlp(x)
    act = hidden(mlp, x)
    out = fused_lora_forward(down, act, overwrite_input=True, unread_sum_with=residual)
    out = lora_4bit_forward(down, act, True, unread_sum_with=residual) if out is None else out
    return out if out is not None else residual + _project_fresh(down, act)


# -------------------------------------------------------------------------------------- gated MLP
def _project_fresh(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``x`` nothing else reads afterwards (the activation's output). A fused LoRA
    layer (our forward, no hooks; a 16-bit or 4-bit base) then writes x's gradient into x's memory in
    the backward; anything else is simply called."""
    if patched_op(module) == "lora" and not _hooked(module) and torch.is_grad_enabled():
        out = fused_lora_forward(module, x, overwrite_input=True)
        out = lora_4bit_forward(module, x, overwrite_input=True) if out is None else out
        if out is not None:
            return out
    return module(x)


_GLU_HIDDEN: dict[Callable, Callable] = {}
"""A gated MLP forward -> its ``hidden(mlp, x)``, the activation's output (down_proj's input)."""


def gated_mlp_forward(hidden: Callable, name: str) -> Callable:
    """The gated MLP forward ``down_proj(hidden(module, x))`` (token-chunked where set), named
    ``name``. ``hidden``'s output is read only by ``down_proj``, whose fused LoRA backward overwrites
    it with its gradient; a recompute whose output nothing reads skips the down product
    (:func:`_gated_mlp_for_gradients`)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _project_fresh(self.down_proj, hidden(self, x))

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = hidden.__doc__
    forward = _op_forward("glu")(token_chunked(forward))
    _GLU_HIDDEN[forward] = hidden
    return forward


def _glu_hidden(activation: Callable, fused: bool) -> Callable:
    def hidden(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1) if fused else (mlp.gate_proj(x), mlp.up_proj(x))
        return activation(gate, up, inplace_backward=True)

    # gate and up (or the halves of Phi-3's one gate_up output) are fresh outputs read by nothing
    # else: the activation's backward overwrites them with their gradients.
    layout = "gate, up = gate_up_proj(x).chunk(2)" if fused else "gate_proj(x), up_proj(x)"
    hidden.__doc__ = f"``down_proj({activation.__name__}(gate, up))``, {layout}, in-place backwards."
    return hidden


swiglu_mlp_forward = gated_mlp_forward(_glu_hidden(swiglu, False), "swiglu_mlp_forward")
geglu_mlp_forward = gated_mlp_forward(_glu_hidden(geglu, False), "geglu_mlp_forward")
fused_swiglu_mlp_forward = gated_mlp_forward(_glu_hidden(swiglu, True), "fused_swiglu_mlp_forward")
fused_geglu_mlp_forward = gated_mlp_forward(_glu_hidden(geglu, True), "fused_geglu_mlp_forward")

GLU_FORWARDS: dict[tuple[str, GluLayout], Callable] = {
    ("silu", "split"): swiglu_mlp_forward,
    ("swish", "split"): swiglu_mlp_forward,
    ("gelu_pytorch_tanh", "split"): geglu_mlp_forward,
    ("silu", "fused"): fused_swiglu_mlp_forward,
    ("swish", "fused"): fused_swiglu_mlp_forward,
    ("gelu_pytorch_tanh", "fused"): fused_geglu_mlp_forward,
}
"""``(config.hidden_act, glu_layout)`` -> the MLP forward; the activations are those whose ``ACT2FN``
function the fused ops compute exactly."""


# ------------------------------------------------------------------------------------------- RoPE
def _rope_function(layout: RopeLayout, form: RopeForm, original: Callable) -> Callable:
    def tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layout == "half_table":
            return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos, sin

    if form == "single":

        def apply_single(x, cos, sin, *args, **kwargs):
            unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
            if unsqueeze_dim != 2 or len(args) + len(kwargs) > 1 or x.dim() != 4:
                return original(x, cos, sin, *args, **kwargs)
            heads_first = x.transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D], a view
            # The op rotates q and k together; one head of x, detached, stands in for k (its
            # output is dropped and no gradient flows through it), so x is read once.
            out, _ = apply_rope(heads_first, heads_first[:, :1].detach(), *tables(cos, sin))
            return out.transpose(1, 2)

        return apply_single

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if unsqueeze_dim != 1 or len(args) + len(kwargs) > 1:
            return original(q, k, cos, sin, *args, **kwargs)
        return apply_rope(q, k, *tables(cos, sin))

    return apply_rotary_pos_emb


_ROPE_FORWARDS: dict[tuple[type, str, str], Callable | None] = {}


def rope_attention_forward(
    cls: type[nn.Module], layout: RopeLayout, form: RopeForm = "qk"
) -> Callable | None:
    """``cls.forward`` rebuilt so that its ``apply_rotary_pos_emb`` is ``sloth::rope``.

    Returns None when the forward is not a plain function that calls ``apply_rotary_pos_emb`` by its
    global name (then there is nothing this patch can safely replace).
    """
    key = (cls, layout, form)
    if key not in _ROPE_FORWARDS:
        replace = functools.partial(_rope_function, layout, form)
        rebuilt = rebuild_with_globals(cls.forward, {"apply_rotary_pos_emb": replace})
        _ROPE_FORWARDS[key] = None if rebuilt is None else _op_forward("rope")(rebuilt)
    return _ROPE_FORWARDS[key]


# ------------------------------------------------------------------------------------------- loss
def _fusable(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why the fused loss cannot replace this call's forward, or None if it can."""
    if args:
        return "positional arguments after input_ids"
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
        return "logits_to_keep is set"
    if not isinstance(model.lm_head, nn.Linear):
        return f"lm_head is a {type(model.lm_head).__name__}, not an nn.Linear"
    if model.loss_function is not ForCausalLMLoss:
        return "the model has a custom loss_function"
    return None


def takes_target_count(model: nn.Module) -> bool:
    """Whether the transformers model inside ``model`` (plain or PEFT-wrapped) computes its loss with
    the fused forward, which takes ``num_target_tokens`` (:func:`causal_lm_forward`)."""
    try:
        return patched_op(find_hf_model(model)) == "cross_entropy"
    except TypeError:  # no transformers model inside
        return False


def target_rows(
    hidden: torch.Tensor, targets: torch.Tensor, count: int, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` rows of ``hidden`` ``[..., H]`` whose target is not ``ignore_index``, with their
    targets (in position order): the loss needs no logits for the others, whose gradient is zero.

    ``count`` is a host int (``PackedBatch.num_target_tokens``), so nothing reads device memory: the
    rows come from a stable sort of the ignore mask. A ``count`` above the true number keeps some
    ignored rows (no effect on the loss); one below it would drop targets, which a device-side
    assert refuses (the next row in the order must be an ignored one). Where at most 1/64 of the rows
    are ignored, every row is kept: a few more logits rather than a ``[count, H]`` copy of hidden.
    """
    flat_targets = targets.reshape(-1)
    rows = flat_targets.numel()
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise TypeError(f"num_target_tokens must be a non-negative Python int, got {count!r}")
    if count >= rows - rows // 64:
        return hidden, targets
    order = torch.sort((flat_targets == ignore_index).to(torch.uint8), stable=True).indices
    # Every target row sorts first; the row after the kept ones must be an ignored one. (A 1-element
    # index_select, not ``[order[count]]``: a 0-d index tensor is read on the host.)
    torch._assert_async(
        flat_targets.index_select(0, order.narrow(0, count, 1)) == ignore_index,
        "num_target_tokens is below the number of targets (labels other than ignore_index after the shift)",
    )
    keep = order[:count]
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep), flat_targets.index_select(0, keep)


@functools.cache
def causal_lm_forward(family: Family) -> Callable:
    """CausalLM forward that computes the loss with ``linear_cross_entropy`` when labels are given.

    With labels the decoder runs as in transformers' forward, then the loss is taken from the final
    hidden states and the lm-head weight without building the ``[B, T, V]`` logits; the output's
    ``logits`` is None. ``num_items_in_batch``, ``ignore_index``, ``shift_labels``, Gemma's
    ``final_logit_softcapping`` and the MoE router loss keep their transformers meaning. Without
    labels, or in a case it does not handle, the class's forward runs.

    ``num_target_tokens`` (a host int: the targets after the shift, ``PackedBatch.num_target_tokens``)
    computes logits only for the rows that carry a loss (:func:`target_rows`); the per-row values
    are the same, the product smaller by the share of prompt and boundary positions.
    """
    load_balancing_loss = family.modeling().load_balancing_loss_func if family.moe else None

    @_op_forward("cross_entropy")
    def forward(self: nn.Module, input_ids=None, *args, labels=None, num_target_tokens=None, **kwargs):
        if labels is None or (reason := _fusable(self, args, kwargs)) is not None:
            if labels is not None:
                _log_once(f"fused cross-entropy: {reason}; {type(self).__name__} computes full logits")
            return type(self).forward(self, input_ids, *args, labels=labels, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        kwargs.pop("logits_to_keep", None)
        if family.moe and kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = self.config.output_router_logits
        # The decoder under the head: ``base_model_prefix`` names it, except where a text-only head
        # keeps its multimodal sibling's prefix (Llama 4: "language_model", the module is ``model``).
        decoder = getattr(self, self.base_model_prefix, None) or self.model
        outputs = decoder(input_ids=input_ids, **kwargs)

        hidden = outputs.last_hidden_state
        ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
        targets = kwargs.get("shift_labels")
        targets = shift_labels(labels, ignore_index) if targets is None else targets
        targets = targets.to(hidden.device)
        if num_target_tokens is not None:
            hidden, targets = target_rows(hidden, targets, num_target_tokens, ignore_index)
        if family.logits_divisor_attr is not None:
            # logits / s == (hidden / s) @ W^T: the division moves to the [rows, H] side.
            hidden = hidden / getattr(self.config, family.logits_divisor_attr)
        loss = linear_cross_entropy(
            hidden,
            self.lm_head.weight,
            targets,
            bias=self.lm_head.bias,
            ignore_index=ignore_index,
            softcap=getattr(self.config, "final_logit_softcapping", None),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
        )
        common = dict(
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        if family.moe:
            aux_loss = None
            if kwargs["output_router_logits"]:
                aux_loss = load_balancing_loss(
                    outputs.router_logits,
                    self.num_experts,
                    self.num_experts_per_tok,
                    kwargs.get("attention_mask"),
                )
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            output = MoeCausalLMOutputWithPast(
                loss=loss, aux_loss=aux_loss, router_logits=outputs.router_logits, **common
            )
        else:
            output = CausalLMOutputWithPast(loss=loss, **common)
        return output if return_dict else output.to_tuple()

    return forward


# ------------------------------------------------------------------------------------------- LoRA
@_op_forward("lora")
def lora_forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT ``lora.Linear`` forward through ``sloth::lora_linear``, falling back to PEFT's forward.

    The fallback is logged once per process (under ``torch.compile`` that log is a graph break, on
    the fallback path only).
    """
    if not args and not kwargs:
        out = group_output(self, x)  # inside a block that groups layers sharing an input
        if out is None:
            out = fused_lora_forward(self, x)
        if out is None:
            out = lora_4bit_forward(self, x)  # a 4-bit base (ours or bitsandbytes')
        if out is not None:
            return out
    _log_once(
        "fused LoRA: a lora.Linear is outside the fused op's plain case (dropout, DoRA, LoRA bias, "
        "quantized or merged base, several adapters, ...); those layers run PEFT's forward"
    )
    return type(self).forward(self, x, *args, **kwargs)


def lora_fuses_now(module: LoraLinear) -> bool:
    """Whether ``module`` in its current state takes the fused path (probed with zero rows)."""
    weight = module.get_base_layer().weight
    dtype = weight.dtype if weight.is_floating_point() else torch.float32  # 4-bit codes are uint8
    probe = torch.empty(0, module.in_features, dtype=dtype, device=weight.device)
    with torch.no_grad():
        return fused_lora_forward(module, probe) is not None or lora_4bit_forward(module, probe) is not None
