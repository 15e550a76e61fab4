"""FSDP2 pieces of ``SlothFSDPStrategy``: sharding plan, precision policy, full state dicts.

The strategy transforms the model first (kernels, packed attention, checkpointing + offload
hooks, all of which replace forwards or set attributes and so must see the plain modules), then
:func:`convert_before_sharding` stores the frozen base weights in 4 bits and/or casts to a true
half dtype when the precision plugin asks, then :func:`shard_model` applies ``fully_shard`` to
every decoder layer and last to the transformers model as root::

    LlamaForCausalLM  (root unit: embed_tokens, norm, lm_head; tied weights stay one parameter)
      model.layers[0]  (one unit: attention, MLP, norms, and their LoRA A/B next to the frozen base)
      model.layers[1]  ...

Inside a unit's forward its parameters are plain, unsharded tensors again (FSDP2 all-gathers them
in a forward pre-hook), so the Triton ops, the fused LoRA and the fused linear cross-entropy
never see a ``DTensor``. transformers runs a layer's checkpoint inside the layer's ``forward``,
after FSDP2's pre-hook: the all-gather is outside the checkpoint and recomputation reuses the
parameters the backward pre-hook gathered.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.torch_version import TorchVersion

from lightning_sloth.hf_model import find_decoder_layers
from lightning_sloth.moe.quant import EXPERT_WEIGHTS, expert_storage
from lightning_sloth.quant import Linear4bit, quantize_model


class ShardingError(ValueError):
    """The model, precision or launch cannot be sharded by ``SlothFSDPStrategy``."""


def mixed_precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a ``SlothPrecision`` mode.

    ``bf16-mixed``: float32 sharded weights, all-gathered and computed in bfloat16, gradients
    reduced in float32 (the optimizer steps float32 weights). ``bf16-true``/``16-true``: the
    weights are half already (converted before sharding); gradients are reduced in float32.
    ``32-true``: no casting anywhere. ``16-mixed`` is refused: its loss scaler is not wired to
    sharded gradients.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision in ("bf16-true", "16-true"):
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if precision == "32-true":
        return MixedPrecisionPolicy()
    raise ShardingError(
        f"sloth_fsdp does not support precision {precision!r} (fp16 loss scaling over sharded "
        "gradients is not wired); use bf16-mixed, bf16-true or 32-true"
    )


def convert_before_sharding(precision_plugin, module: nn.Module, device: torch.device) -> int:
    """The precision plugin's in-place conversion, applied before ``fully_shard``; in place.

    4-bit base weights (``SlothPrecision(quantize=...)``) are quantised here, each weight on
    ``device`` as it is reached (the float weights stay where they are until sharding moves the
    rest). The packed ``uint8`` codes are ordinary frozen parameters, so ``fully_shard`` shards
    them like any other: dim 0 of the flat code array, all-gathered bit for bit before each
    forward (a unit mixing dtypes is all-gathered as bytes), never cast by the mixed-precision
    policy (it only casts floating-point parameters) and never reduced (frozen). Their block
    scales and code books are buffers, which FSDP2 keeps whole on every rank (about an eighth of
    the codes' size for NF4) until :func:`shard_4bit_scales` makes them frozen parameters too.
    ``*-true`` modes then cast the floating-point weights.

    A model on the meta device is quantised on the meta device (``device`` is ignored): the 4-bit
    layers are skeletons whose shards each rank makes later (:mod:`~lightning_sloth.plugins.shard_init`).

    Lightning's ``ModelParallelStrategy.setup`` calls ``convert_module`` again on the sharded
    model; both steps are idempotent (layers already in 4 bits are left as they are).

    Returns:
        The number of weight tensors stored in 4 bits.
    """
    quantize = getattr(precision_plugin, "quantize", None)
    quantized = 0
    if quantize is not None:
        if any(p.is_meta for p in module.parameters()):
            device = None  # skeletons on the meta device
        quantized = len(quantize_model(module, quantize, precision_plugin.quantize_skip, device=device))
    if quantize is not None or precision_plugin.precision.endswith("-true"):
        precision_plugin.convert_module(module)
    return quantized


def shard_4bit_scales(model: nn.Module) -> int:
    """Turn the block scales of every 4-bit weight into frozen parameters, so ``fully_shard`` shards
    them beside the packed codes; in place, idempotent.

    The scales (``absmax``: float32 bits as ``int32``, or ``uint8`` codes for ``nf4-dq``) are an
    eighth of the codes' bytes for NF4; as buffers every rank would hold the whole model's. As
    frozen integer parameters they are sharded on dim 0, all-gathered bit for bit with their
    unit, never cast and never reduced, like the codes. The state-dict keys do not change. The
    code books and ``nf4-dq``'s second-level scales (1/256 of the scales) stay buffers.

    Returns:
        The number of scale tensors made parameters now.
    """
    moved = 0
    for module in model.modules():
        names = ["absmax"] if isinstance(module, Linear4bit) else []
        names += [f"{w}_absmax" for w in EXPERT_WEIGHTS if expert_storage(module, w) is not None]
        for name in names:
            if name in module._buffers:
                scales = module._buffers.pop(name)
                module.register_parameter(name, nn.Parameter(scales, requires_grad=False))
                moved += 1
    return moved


def shardable_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers ``fully_shard`` wraps one by one (:func:`find_decoder_layers`)."""
    try:
        return find_decoder_layers(model)
    except TypeError as error:
        raise ShardingError(
            f"sloth_fsdp shards transformers decoder models layer by layer; {type(model).__name__} "
            "has no stack of decoder layers (nn.ModuleList of GradientCheckpointingLayer) to shard"
        ) from error


class _FrozenIntegerParameter(nn.Parameter):
    """``nn.Parameter`` for FSDP2 of torch < 2.13, which builds its sharded parameter as
    ``nn.Parameter(dtensor)`` (``requires_grad=True``) and sets the flag only afterwards: that
    raises for integer data (the packed NF4 codes). Integer data gets ``requires_grad=False`` at
    once (it can never require a gradient); anything else is built exactly as before."""

    def __new__(cls, data=None, requires_grad=True):
        if data is not None and not (data.is_floating_point() or data.is_complex()):
            requires_grad = False
        return nn.Parameter(data, requires_grad)


def allow_integer_parameters_in_fsdp2() -> list[str]:
    """Let FSDP2 shard frozen integer parameters (the packed 4-bit codes) on every torch this
    package admits. torch 2.13 does both of these itself; torch 2.11 does neither:

    - build the sharded parameter with the original ``requires_grad``: 2.11 builds it as
      ``nn.Parameter(dtensor)`` (``requires_grad=True``, which raises for integer data) and sets
      the flag after. FSDP2's parameter modules get a copy of ``torch.nn`` whose ``Parameter`` is
      :class:`_FrozenIntegerParameter`;
    - leave non-floating parameters out of the mixed-precision cast: 2.11 casts them to
      ``param_dtype`` like the weights (the codes would arrive as bf16 values).
      ``FSDPParam.init_dtype_attrs`` is wrapped to clear ``param_dtype`` for them.

    Applied the same way on every version (on 2.13 both changes are no-ops), so the CPU suite runs
    the code that torch 2.11 needs. Idempotent; returns what it patched now.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fsdp_param

    fsdp_param = _fsdp_param.FSDPParam
    patched = []
    if _fsdp_param.nn.Parameter is not _FrozenIntegerParameter:
        namespace = types.ModuleType("torch.nn")
        namespace.__dict__.update(vars(nn))
        namespace.Parameter = _FrozenIntegerParameter
        _fsdp_param.nn = _fsdp_init.nn = namespace
        patched.append("Parameter")
    original = fsdp_param.init_dtype_attrs
    if not getattr(original, "_sloth_integer_safe", False):

        def init_dtype_attrs(self, mp_policy) -> None:
            original(self, mp_policy)
            if not self.orig_dtype.is_floating_point:
                self.param_dtype = None  # never cast integer codes

        init_dtype_attrs._sloth_integer_safe = True
        fsdp_param.init_dtype_attrs = init_dtype_attrs
        patched.append("init_dtype_attrs")
    return patched


# ``layers_per_unit=None`` groups consecutive decoder layers into FSDP2 units of at most this many
# parameters (at least one layer each): a unit's hooks, copies and collectives cost host and GPU
# time of their own, which a small layer cannot hide (Llama-3.2-1B: four layers per unit; an
# 8B or 14B layer is a unit by itself).
AUTO_UNIT_PARAMETERS = 250_000_000


def check_layers_per_unit(layers_per_unit: object) -> int | None:
    """``layers_per_unit`` if it is ``None`` or a positive ``int``; else :class:`ShardingError`."""
    if layers_per_unit is None:
        return None
    if isinstance(layers_per_unit, bool) or not isinstance(layers_per_unit, int) or layers_per_unit < 1:
        raise ShardingError(
            f"layers_per_unit must be a positive integer (or None: automatic), got {layers_per_unit!r}"
        )
    return layers_per_unit


def grouped_units_take_partial_forwards() -> bool:
    """Whether this torch's FSDP2 finishes a unit of several layers only after all of them ran.

    The one-node checkpoint recomputes a unit's layers one at a time inside the backward, last
    first. torch 2.13's FSDP2 keeps such a grouped unit gathered until every layer's backward
    (its partial-group handling; bit for bit as one layer per unit on two CPU processes); torch
    2.11's registers the unit's post-backward on the first layer recomputed and reshards the unit
    after that layer's backward, before the others' recompute (found on four H200s:
    ``sloth.rms_norm got mixed torch.Tensor and DTensor``)."""
    return TorchVersion(torch.__version__) >= "2.13"


def auto_layers_per_unit(layers: nn.ModuleList) -> int:
    """Consecutive layers per FSDP2 unit for ``layers_per_unit=None``: as many of the largest
    layer as :data:`AUTO_UNIT_PARAMETERS` holds, at least one."""
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return max(1, AUTO_UNIT_PARAMETERS // max(largest, 1))


REPLICATE_FROZEN_SHARE = 0.25
"""``shard_frozen="auto"`` keeps the frozen weights whole on every GPU when they take at most this
share of its memory."""


def frozen_to_replicate(
    hf_model: nn.Module, device: torch.device, shard_frozen: bool | str, policy=None
) -> set[nn.Parameter]:
    """The frozen parameters of ``hf_model`` that every rank keeps whole instead of sharding.

    A LoRA (or QLoRA) base is frozen: it needs no gradient reduction and no optimizer state, only
    its all-gathers, once per layer in the forward and again in the backward. Where the whole base
    fits a GPU beside the step, replicating it leaves FSDP2 only the adapters to gather and reduce
    (little more communication than DDP), and the layers run on plain tensors; :func:`shard_model`
    then gives the decoder layers no unit of their own (the root's unit holds every adapter: one
    all-gather and one reduce-scatter per step instead of a unit's hooks and collectives per layer).

    Args:
        hf_model: the transformers model (inside PEFT's wrapper when LoRA is on).
        device: the rank's device.
        shard_frozen: ``True``: shard everything (none replicated). ``False``: replicate every
            frozen parameter. ``"auto"``: replicate them on a CUDA device when they take at most
            :data:`REPLICATE_FROZEN_SHARE` of its memory (floating weights counted in the policy's
            compute dtype, in which :func:`cast_replicated` stores them), else shard them (a
            meta-device model, built shard by shard, always shards).
        policy: :func:`mixed_precision_policy`'s result (``None``: weights counted as stored).

    Raises:
        ShardingError: an unknown ``shard_frozen``, or ``False`` for a model on the meta device.
    """
    if shard_frozen not in (True, False, "auto"):
        raise ShardingError(f"shard_frozen takes True, False or 'auto', got {shard_frozen!r}")
    frozen = [p for p in hf_model.parameters() if not p.requires_grad]
    if shard_frozen is True or not frozen:
        return set()
    meta = any(p.is_meta for p in frozen)
    if shard_frozen is False:
        if meta:
            raise ShardingError(
                "shard_frozen=False keeps the frozen weights whole on every rank, but the model is on the "
                "meta device (built shard by shard): use shard_frozen=True or 'auto'"
            )
        return set(frozen)
    if meta or device.type != "cuda":
        return set()
    if (
        _compute_bytes(frozen, policy)
        > REPLICATE_FROZEN_SHARE * torch.cuda.get_device_properties(device).total_memory
    ):
        return set()
    return set(frozen)


def _compute_bytes(params: list[nn.Parameter], policy) -> int:
    """Bytes of ``params`` with floating ones in the policy's ``param_dtype`` (what a gather or
    :func:`cast_replicated` makes) and integer ones (4-bit codes) at their own size."""
    dtype = getattr(policy, "param_dtype", None)
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else None

    def size(p: nn.Parameter) -> int:
        floating = p.is_floating_point() or p.is_complex()
        return p.numel() * (itemsize if floating and itemsize is not None else p.element_size())

    return sum(size(p) for p in params)


KEEP_GATHERED_SHARE = 0.25
"""``reshard_after_forward=None`` keeps a LoRA model's gathered weights from each layer's forward
to its backward when the whole model, gathered in the compute dtype, takes at most this share of
the GPU's memory."""


def check_reshard_after_forward(reshard_after_forward: object) -> bool | None:
    """``reshard_after_forward`` if it is ``True``, ``False`` or ``None``; else :class:`ShardingError`."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ShardingError(
            f"reshard_after_forward takes True, False or None (automatic), got {reshard_after_forward!r}"
        )
    return reshard_after_forward


def resolve_reshard_after_forward(
    hf_model: nn.Module,
    reshard_after_forward: bool | None,
    device_memory: int | None,
    policy=None,
) -> bool:
    """FSDP2's ``reshard_after_forward`` for the decoder-layer units of ``hf_model``.

    ``True`` frees each unit's gathered weights after its forward and gathers them again in the
    backward; ``False`` keeps them until the backward (one all-gather per unit and step, the whole
    model gathered at the peak). ``None`` (automatic) keeps them for a LoRA (or QLoRA) model —
    frozen weights outnumber the trainable ones, so the peak is the frozen base plus small
    adapters — on a CUDA device where the gathered model takes at most
    :data:`KEEP_GATHERED_SHARE` of its memory; otherwise, and always for a model built on the meta
    device (one no card holds) or full fine-tuning, it reshards. Measured on four H200s (LoRA
    r=16, 16k tokens per GPU, with the one-node checkpoint the strategy pairs with it): Llama-3.1-8B
    91.3% of one GPU's tokens/s per GPU (81.4% resharding, under torch's checkpoint), at 25.3 GiB
    instead of 15.2; Llama-3.2-1B 87.8% (78.7%).

    Args:
        hf_model: the transformers model (inside PEFT's wrapper when LoRA is on), before sharding.
        reshard_after_forward: ``True``/``False`` (returned as given) or ``None`` (automatic).
        device_memory: the GPU's total bytes; ``None`` off CUDA (where it reshards).
        policy: :func:`mixed_precision_policy`'s result: floating weights count at its
            ``param_dtype`` (what a gather makes), integer ones (4-bit codes) at their own size.

    Raises:
        ShardingError: anything but ``True``, ``False`` or ``None``.
    """
    if check_reshard_after_forward(reshard_after_forward) is not None:
        return reshard_after_forward
    params = list(hf_model.parameters())
    if device_memory is None or any(p.is_meta for p in params):
        return True
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    if trainable == 0 or trainable >= frozen:
        return True
    return _compute_bytes(params, policy) > KEEP_GATHERED_SHARE * device_memory


@torch.no_grad()
def cast_replicated(replicate: set[nn.Parameter], policy) -> None:
    """Store the replicated frozen parameters in the policy's compute dtype, in place.

    FSDP2 casts the weights it manages to ``param_dtype`` when it gathers them and casts each
    unit's floating inputs to it; a weight it does not manage would meet those bfloat16 inputs in
    its own dtype. Stored in ``param_dtype`` it holds what the gathered copy would have held.
    """
    dtype = getattr(policy, "param_dtype", None)
    if dtype is None:
        return
    for param in replicate:
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def shard_model(
    lightning_module: nn.Module,
    hf_model: nn.Module,
    mesh,
    policy,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    layers_per_unit: int | None = None,
    replicate: set[nn.Parameter] = frozenset(),
) -> tuple[int, int]:
    """``fully_shard`` the decoder layers of ``hf_model`` (one unit per ``layers_per_unit``
    consecutive layers), then ``hf_model`` itself; in place.

    Args:
        lightning_module: the module being trained; every trainable parameter must live in
            ``hf_model`` (one outside would train unsynchronised on each rank).
        hf_model: the transformers ``PreTrainedModel`` (inside PEFT's wrapper when LoRA is on).
        mesh: the 1-D data-parallel ``DeviceMesh``.
        policy: :func:`mixed_precision_policy`'s result.
        reshard_after_forward: free each layer's gathered weights after its forward (ZeRO-3);
            ``False`` keeps them until the backward (ZeRO-2: more memory, fewer all-gathers).
        cpu_offload: keep the sharded weights, gradients and optimizer states in host memory.
        layers_per_unit: consecutive decoder layers in one FSDP2 unit (``fully_shard`` of the
            list): gathered, resharded and reduced together, with one set of FSDP2 hooks. Fewer,
            larger collectives and less host time per step, for more gathered weights at once.
            ``None``: :func:`auto_layers_per_unit`. ``0``: the layers get no unit of their own and
            the root's unit holds their trainable parameters (one all-gather and one
            reduce-scatter per step); only where every frozen parameter of theirs is in
            ``replicate`` (a LoRA base kept whole: what remains are the adapters).
        replicate: parameters every rank keeps whole (FSDP2's ``ignored_params``; see
            :func:`frozen_to_replicate`): frozen only, placed on the device by the strategy.

    Returns:
        The number of decoder layers sharded, and the layers per unit (``0``: in the root's unit).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise ShardingError(
            "sloth_fsdp needs an initialised torch.distributed process group: launch through "
            "Trainer(strategy='sloth_fsdp', devices=N) (or torchrun/SLURM), not a bare process"
        )
    if any(isinstance(m, FSDPModule) for m in lightning_module.modules()):
        raise ShardingError(
            "the model is already sharded (fully_shard was applied, e.g. in configure_model); "
            "SlothFSDPStrategy shards it itself: leave configure_model to build the model"
        )
    inside = {id(p) for p in hf_model.parameters()}
    outside = [n for n, p in lightning_module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ShardingError(
            f"sloth_fsdp shards the transformers model only; trainable parameters outside it "
            f"would not be synchronised: {outside[:5]}"
        )
    codes = [p for p in hf_model.parameters() if not (p.is_floating_point() or p.is_complex())]
    if any(p not in replicate for p in codes):  # packed 4-bit codes FSDP2 shards: their scales too
        allow_integer_parameters_in_fsdp2()
        shard_4bit_scales(hf_model)
    layers = shardable_layers(hf_model)
    if layers_per_unit == 0:
        sharded_frozen = [
            n for n, p in layers.named_parameters() if not p.requires_grad and p not in replicate
        ]
        if sharded_frozen:
            raise ShardingError(
                f"layers_per_unit=0 leaves the decoder layers to the root's unit, which suits adapters "
                f"only: these frozen weights would be gathered whole for the step: {sharded_frozen[:3]}"
            )
        per_unit = 0
    else:
        per_unit = min(check_layers_per_unit(layers_per_unit) or auto_layers_per_unit(layers), len(layers))
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=policy,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    if any(p.requires_grad for p in replicate):
        raise ShardingError("only frozen parameters can be replicated instead of sharded")
    cast_replicated(replicate, policy)

    def ignored(modules: list[nn.Module]) -> set[nn.Parameter] | None:
        kept = {p for m in modules for p in m.parameters() if p in replicate}
        return kept or None

    for start in range(0, len(layers) if per_unit else 0, per_unit or 1):
        unit = list(layers[start : start + per_unit])
        fully_shard(
            unit if len(unit) > 1 else unit[0],
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored(unit),
            **kwargs,
        )
    # The root's weights (embedding, final norm, lm_head) are needed again at once by the
    # backward: never reshard them after the forward.
    fully_shard(hf_model, reshard_after_forward=False, ignored_params=ignored([hf_model]), **kwargs)
    return len(layers), per_unit


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state dict with every ``DTensor`` gathered, in host memory, on global rank 0.

    A collective: every rank calls it; other ranks get ``{}``. Outside FSDP2 it is the plain
    ``state_dict`` (on every rank). Whether FSDP2 manages the module is read from its units, not from
    the parameters' types: FSDP2 registers a unit's unsharded tensors as the parameters while the
    unit is gathered (a unit that keeps its weights from forward to backward stays gathered after a
    validation pass), and its state dict gives the sharded ``DTensor`` s all the same.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        return module.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options)
