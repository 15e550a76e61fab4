"""``apply_kernels``: put the ``sloth::`` ops into a transformers model, per the family table."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from lightning_sloth.hf_model import base_model
from lightning_sloth.patching import _forwards, linear_forwards
from lightning_sloth.patching.families import FAMILIES, OP_COLUMNS, Family
from lightning_sloth.patching.gated_norm import gated_norm_fits, gated_norm_forward
from lightning_sloth.patching.glu_lora_forwards import GLU_LORA_FORWARDS
from lightning_sloth.patching.mla import mla_attention_fits, mla_attention_forward
from lightning_sloth.patching.mlp_chunks import set_mlp_chunk_tokens

log = logging.getLogger(__name__)

__all__ = ["OPS", "KernelSettings", "PatchReport", "apply_kernels", "unpatch"]

OPS = (
    "rms_norm",
    "rope",
    "glu",
    "cross_entropy",
    "lora",
    "add_rms_norm",
    "linear_attention",
    "rms_norm_gated",
    "mla",
)
"""The ops :func:`apply_kernels` can install, in report order (the :class:`KernelSettings` fields)."""
SETTINGS = (*OPS, "glu_lora")
"""Every field of :class:`KernelSettings`: the ops, and ``glu_lora`` (a modifier of ``glu``)."""


@dataclass(frozen=True)
class KernelSettings:
    """Which ops :func:`apply_kernels` installs; switch one off to measure what it buys.

    Attributes:
        rms_norm: RMSNorm modules (Qwen3/Gemma 3 per-head q/k norms included) -> ``sloth::rms_norm``.
        rope: rotary embedding inside the attention modules -> ``sloth::rope``.
        glu: gated MLPs -> ``sloth::swiglu`` / ``sloth::geglu``.
        cross_entropy: the causal LM's loss -> ``sloth::linear_cross_entropy`` (no logits).
        lora: PEFT ``lora.Linear`` layers -> ``sloth::lora_linear``.
        add_rms_norm: pre-norm decoder layers -> the residual add after attention and the norm
            before the MLP as one ``sloth::add_rms_norm`` (layers of another form keep their own
            forward; the report says which).
        linear_attention: Gated DeltaNet layers (Qwen3.5, Qwen3-Next) -> the short convolution and
            the delta rule over the packed row's segments (``lightning_sloth.linear_attention``);
            without it transformers refuses packed rows in these layers.
        rms_norm_gated: the gated RMSNorm after a Gated DeltaNet layer's delta rule (Qwen3.5,
            Qwen3-Next) -> ``sloth::rms_norm_gated`` (:mod:`lightning_sloth.patching.gated_norm`),
            exact to the module's forward (the Qwen3.5-9B step 1.13x faster on the H100,
            docs/benchmarks.md).
        mla: multi-head latent attention (DeepSeek-V3) -> packed rows build q, k and v in the flash
            varlen layout, each written once (``lightning_sloth.patching.mla``).
        glu_lora: a modifier of ``glu``: where gate and up are LoRA layers over FP8 bases, their
            LoRA parts are added inside the activation's kernel (``sloth::swiglu_lora``,
            :mod:`lightning_sloth.patching.glu_lora_forwards`) instead of into the two base products
            by passes of their own (the 8B FP8 step 1.03x faster on the H100, docs/benchmarks.md).
            Elsewhere it changes nothing. Not an op of :data:`OPS`: on unless a mapping sets it off
            (``{"glu_lora": False}``); ``False`` and op-name lists that leave out ``glu`` leave
            nothing for it to modify.
    """

    rms_norm: bool = True
    rope: bool = True
    glu: bool = True
    cross_entropy: bool = True
    lora: bool = True
    add_rms_norm: bool = True
    linear_attention: bool = True
    rms_norm_gated: bool = True
    mla: bool = True
    glu_lora: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"KernelSettings.{f.name} must be a bool, got {getattr(self, f.name)!r}")

    @classmethod
    def coerce(cls, value: Any) -> KernelSettings:
        """Settings from the forms a config may hold.

        Args:
            value: a ``KernelSettings``; ``True`` (the defaults: every op);
                ``False``/``None`` (none); a mapping of field names to bools
                (missing fields keep their defaults); or an iterable of op names to switch on (the
                others off).

        Raises:
            ValueError: on an unknown op name.
            TypeError: on any other type.
        """
        if isinstance(value, KernelSettings):
            return value
        if value is True:
            return cls()  # every op
        if value is None or value is False:
            return cls(**dict.fromkeys(OPS, False))
        if isinstance(value, Mapping):
            _check_names(value.keys())
            return cls(**value)
        if isinstance(value, Iterable) and not isinstance(value, str):
            names = list(value)
            _check_names(names)
            return cls(**{op: op in names for op in OPS})  # glu_lora: its default
        raise TypeError(
            f"kernel settings must be a KernelSettings, bool, mapping or list of op names, got {value!r}"
        )

    def enabled(self) -> tuple[str, ...]:
        """The ops switched on, in :data:`OPS` order."""
        return tuple(op for op in OPS if getattr(self, op))


def _check_names(names: Iterable[Any]) -> None:
    unknown = sorted(str(n) for n in names if n not in SETTINGS)
    if unknown:
        raise ValueError(f"unknown kernel op(s) {unknown}; choose from {list(SETTINGS)}")


@dataclass
class PatchReport:
    """What :func:`apply_kernels` left installed, per op, and why the others are not.

    Attributes:
        model_type: ``config.model_type`` of the model (None if it has no config).
        supported: Whether the family table has a row for it.
        modules: op -> qualified names (relative to the transformers model) of the modules running it.
        skipped: op -> why it is not installed (switched off; the family has no such module, or a
            form the op does not reproduce; the module is outside the op's case; no table row).
    """

    model_type: str | None
    supported: bool
    modules: dict[str, list[str]] = field(default_factory=lambda: {op: [] for op in OPS})
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """op -> number of modules running it."""
        return {op: len(names) for op, names in self.modules.items()}

    @property
    def installed(self) -> tuple[str, ...]:
        """The ops running in at least one module, in :data:`OPS` order."""
        return tuple(op for op in OPS if self.modules[op])

    def __str__(self) -> str:
        patched = ", ".join(f"{op} x{n}" for op, n in self.counts.items() if n) or "nothing"
        text = f"{self.model_type}: {patched}"
        if self.skipped:
            text += "; not patched: " + "; ".join(f"{op} ({why})" for op, why in self.skipped.items())
        return text.replace("\n", " ")


class _Row(NamedTuple):
    """One op of the plan: the classes it applies to and the forward a matching module gets."""

    op: str
    classes: tuple[type, ...]
    forward_for: Callable[[nn.Module], Callable | None]
    unavailable: str = ""  # why forward_for may return None


def _every(forward: Callable) -> Callable[[nn.Module], Callable]:
    """``forward_for`` giving every matching module the same forward."""
    return lambda _module: forward


def _family_rows(
    family: Family, config: Any, settings: KernelSettings, skipped: dict[str, str]
) -> list[_Row]:
    rows = []
    if settings.rms_norm:
        rows.append(
            _Row("rms_norm", family.classes(family.norms), _forwards.norm_forward_for(family.norm_style))
        )
    if settings.glu and family.mlps:
        activation = getattr(config, family.activation_attr, None)
        glu_forward = _forwards.GLU_FORWARDS.get((activation, family.glu_layout))
        if settings.glu_lora:
            glu_forward = GLU_LORA_FORWARDS.get((activation, family.glu_layout), glu_forward)
        if glu_forward is None:
            computed = sorted({name for name, _ in _forwards.GLU_FORWARDS})
            skipped["glu"] = (
                f"config.{family.activation_attr}={activation!r}; the fused ops compute {computed}"
            )
        else:
            rows.append(_Row("glu", family.classes(family.mlps), _every(glu_forward)))
    if settings.rope:
        rows.append(
            _Row(
                "rope",
                family.classes(family.attentions),
                lambda module: _forwards.rope_attention_forward(
                    type(module), family.rope_layout, family.rope_form
                ),
                "the attention forward does not call apply_rotary_pos_emb by name",
            )
        )
    if settings.linear_attention:
        rows.append(
            _Row(
                "linear_attention",
                family.classes(family.linear_attentions),
                lambda module: linear_forwards.linear_attention_forward(type(module)),
                "the forward does not call torch_chunk_gated_delta_rule and causal_conv1d_fn (or causal_conv1d_forward) by name",
            )
        )
    if settings.rms_norm_gated:
        rows.append(
            _Row(
                "rms_norm_gated",
                family.classes(family.gated_norms),
                lambda module: gated_norm_forward if gated_norm_fits(module) else None,
                "not the SiLU-gated RMSNorm with a weight and a float eps that the op computes",
            )
        )
    if settings.mla:
        rows.append(
            _Row(
                "mla",
                family.classes(family.mla_attentions),
                lambda module: mla_attention_forward if mla_attention_fits(module) else None,
                "not the interleaved-rotary MLA the forward reproduces (config.rope_interleave=False "
                "keeps transformers' forward)",
            )
        )
    if settings.add_rms_norm and family.decoder_layers:
        rows.append(
            _Row(
                "add_rms_norm",
                family.classes(family.decoder_layers),
                lambda module: (
                    _forwards.pre_norm_decoder_forward if _forwards.pre_norm_decoder_fits(module) else None
                ),
                "the decoder layer is not the pre-norm form add_rms_norm reproduces",
            )
        )
    if settings.cross_entropy:
        rows.append(
            _Row(
                "cross_entropy",
                family.classes(family.causal_lms),
                _every(_forwards.causal_lm_forward(family)),
            )
        )
    return rows


def _explain_missing(report: PatchReport, family: Family | None, model_type: str | None) -> None:
    """A reason for every op that runs nowhere and has none yet, and the family's other notes."""
    for op in OPS:
        if report.modules[op] or op in report.skipped:
            continue
        if op == "lora":
            report.skipped[op] = "no PEFT lora.Linear layer in the model"
        elif family is None:
            report.skipped[op] = f"no table row for {model_type!r}"
        else:
            column = getattr(family, OP_COLUMNS[op][0])
            report.skipped[op] = family.why_absent(op) or f"no {'/'.join(column)} module in the model"
    if family is not None:
        report.skipped.update((op, why) for op, why in family.absent if op not in OPS)


def apply_kernels(model: nn.Module, settings: KernelSettings | Any = None) -> PatchReport:
    """Install the ``sloth::`` ops in a transformers causal LM, in place, per instance.

    The family comes from ``config.model_type`` (:data:`~lightning_sloth.patching.FAMILIES`). Each
    matching module gets its own forward (see :mod:`lightning_sloth.patching._forwards`); classes,
    modeling modules and other models in the process are untouched, and state-dict keys do not change.
    The call is declarative and idempotent: afterwards exactly the ops ``settings`` switches on are
    installed (an op switched off is removed if an earlier call installed it). An architecture
    without a table row runs unpatched apart from LoRA (which does not depend on the family), with
    one warning. The report names every op that runs nowhere with the reason, and is logged as one
    INFO line.

    Call it before ``compile_blocks`` and before wrapping the model (DDP/FSDP). With the fused loss a
    forward given ``labels`` returns ``logits=None``.

    Args:
        model: a transformers ``PreTrainedModel``, a PEFT model around one, or a module holding one
            (e.g. a LightningModule): the outermost ``PreTrainedModel`` inside is patched.
        settings: :class:`KernelSettings` or anything :meth:`KernelSettings.coerce` takes; ``None``
            means the default ops (:class:`KernelSettings`).

    Returns:
        The :class:`PatchReport` (also logged at INFO).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` or ``settings`` has an unusable type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply_kernels takes an nn.Module (transformers or PEFT model), got {type(model).__name__}"
        )
    settings = KernelSettings() if settings is None else KernelSettings.coerce(settings)
    base = base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    report = PatchReport(model_type=model_type, supported=family is not None)

    rows = []
    if family is None:
        warnings.warn(
            f"lightning_sloth has no kernel table for model_type {model_type!r} "
            f"({type(base).__name__}); it trains with transformers' own modules (LoRA fusion still "
            f"applies). Supported: {sorted(FAMILIES)}",
            UserWarning,
            stacklevel=2,
        )
    else:
        rows = _family_rows(family, config, settings, report.skipped)
    if settings.lora:
        rows.append(_Row("lora", (LoraLinear, *_bnb_lora_classes()), _every(_forwards.lora_forward)))
    report.skipped.update((op, "switched off") for op in OPS if not getattr(settings, op))

    foreign, lora_fallbacks = 0, []
    for name, module in base.named_modules():
        row = next((row for row in rows if isinstance(module, row.classes)), None)
        forward = row.forward_for(module) if row is not None else None
        if forward is None:
            if _forwards.patched_op(module) not in ("moe_router", "moe_block"):  # apply_experts owns these
                _forwards.restore(module)
            if row is not None:
                report.skipped[row.op] = f"{type(module).__name__}: {row.unavailable}"
        elif _forwards.has_foreign_forward(module):
            foreign += 1
        else:
            _forwards.install(module, forward)
            # Installed either way (the state may change, e.g. on unmerge); reported as it is now.
            if row.op == "lora" and not _forwards.lora_fuses_now(module):
                lora_fallbacks.append(name)
            else:
                report.modules[row.op].append(name)
    if lora_fallbacks:
        report.skipped["lora"] = (
            f"{len(lora_fallbacks)} lora.Linear layer(s) outside the fused op's plain case (dropout, "
            f"DoRA, LoRA bias, quantized base, ...) run PEFT's forward, e.g. {lora_fallbacks[0]}"
        )
    if foreign:
        report.skipped["foreign"] = f"{foreign} module(s) already had another library's instance forward"
    _explain_missing(report, family, model_type)
    log.info("lightning_sloth kernels: %s", report)
    return report


def _bnb_lora_classes() -> tuple[type, ...]:
    """PEFT's LoRA layer over a bitsandbytes 4-bit linear, where bitsandbytes is installed."""
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:
        return ()
    return (Linear4bit,)


def unpatch(model: nn.Module) -> int:
    """Give every module patched by :func:`apply_kernels` its class's forward back.

    Returns:
        How many modules were restored.
    """
    return sum(_forwards.restore(module) for module in model.modules())


def chunk_mlps(model: nn.Module, tokens: int | str | None) -> int:
    """Run every patched gated MLP of ``model`` over token chunks (``tokens`` rows, ``"auto"`` or
    ``None`` for never; see :mod:`lightning_sloth.patching.mlp_chunks`); returns how many MLPs."""
    return set_mlp_chunk_tokens([m for m in model.modules() if _forwards.patched_op(m) == "glu"], tokens)
