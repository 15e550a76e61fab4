"""From a run of the app to checkpoints that load anywhere: ``lightning-sloth-export``.

::

    lightning-sloth-export RUN_DIR                   # RUN_DIR/adapter/ and RUN_DIR/merged/
    lightning-sloth-export RUN_DIR --dtype float32 --out exported/

writes, from the run's last checkpoint (``checkpoints/last.ckpt``):

- ``adapter/``: the LoRA adapter in PEFT's format (``PeftModel.from_pretrained(base, dir)``);
- ``merged/``: the adapter merged into the base weights, cast to 16 bits (``--dtype``), in
  transformers' ``save_pretrained`` layout with the tokenizer and a generation config. It loads
  with ``AutoModelForCausalLM.from_pretrained`` alone: nothing of lightning_sloth is in it.

The model is rebuilt *unpatched* from the run's saved config (``.hydra/config.yaml``) and the
checkpoint's weights are loaded into it, so none of the training-time changes (packed attention,
kernels, checkpointing) reach the export. ``export=merged`` in the app does the same at the end
of training through :class:`ExportMerged`, from the live weights.

Nothing a run directory holds can run code here: the checkpoint is loaded with
``weights_only=True`` (a file pickling any other type is refused, naming it), a merged export only
from ``model.safetensors``, and ``trust_remote_code`` stays off (the run's ``model.trust_remote_code``,
false unless the run set it).

A run with a 4-bit base (``precision.quantize`` = ``nf4``, ``nf4-dq`` or ``fp4``) is rebuilt
quantised the same way so its checkpoint loads (a mismatch is a clear error), then every 4-bit
weight (linear layers and MoE experts) is decoded as training decoded it, ``code[q] * absmax`` in
float32, the LoRA delta is merged in float32, and the result is rounded once to ``--dtype``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_sloth import build
from lightning_sloth.build import ADAPTER_DIR, CHECKPOINT_DIR, LAST_CHECKPOINT
from lightning_sloth.config import _SCHEMAS, TrainConfig, register_configs
from lightning_sloth.ops.nf4_formats import check_quant_type
from lightning_sloth.plugins.checkpoint import load_checkpoint_file
from lightning_sloth.quant import (
    check_checkpoint_quantization,
    dequantize_model,
    fp8_base_model,
    quantize_model,
)

log = logging.getLogger(__name__)

MERGED_DIR = "merged"
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def load_run_config(run_dir: str | Path) -> DictConfig:
    """The typed :class:`~lightning_sloth.config.TrainConfig` a run was composed with.

    Hydra saves the composed config as plain YAML (``.hydra/config.yaml``); each group is merged
    back into the first schema of that group whose fields hold all its keys, so the builders
    (which dispatch on the schema type) work on it.
    """
    register_configs()  # the sloth_asset resolver
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: not a lightning-sloth run directory (no .hydra/config.yaml)")
    raw = OmegaConf.load(path)
    cfg = OmegaConf.structured(TrainConfig)
    for group, schemas in _SCHEMAS.items():
        keys = set(raw[group].keys())
        for schema in schemas.values():
            if keys <= set(OmegaConf.structured(schema).keys()):
                cfg[group] = OmegaConf.merge(OmegaConf.structured(schema), raw[group])
                break
        else:
            raise ValueError(f"{path}: the {group!r} group matches no schema (keys {sorted(keys)})")
    for key in ("seed", "resume"):
        cfg[key] = raw[key]
    for key, value in raw.items():
        if key not in cfg:
            OmegaConf.set_struct(cfg, False)
            cfg[key] = value
    return cfg


def run_quantization(cfg: DictConfig) -> str | None:
    """The 4-bit format a run stored its base in (``precision.quantize``), or None."""
    quantize = OmegaConf.select(cfg, "precision.quantize", default=None)
    value = getattr(quantize, "value", quantize)
    if value in (None, False, "none", "off"):
        return None
    return check_quant_type(value)


def check_exportable(cfg: DictConfig) -> None:
    """Raise a ``ValueError`` for a run whose base format cannot be rebuilt (an unknown ``quantize``)."""
    run_quantization(cfg)


def build_base(cfg: DictConfig):
    """``(model, tokenizer)``: the run's unpatched base model, wrapped by PEFT when it trained LoRA.

    A 4-bit run's base is quantised as the run quantised it (``precision.quantize`` and
    ``quantize_skip``, after the adapters are made), an FP8 run's (``precision.base_dtype=fp8``)
    converted to FP8 the same way, so its checkpoint loads.
    """
    tokenizer = build.build_tokenizer(cfg.model)
    model = build.build_model(cfg.model, tokenizer)
    lora = build.build_lora_settings(cfg.lora)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora.to_peft())
    quantize = run_quantization(cfg)
    skip = tuple(OmegaConf.select(cfg, "precision.quantize_skip", default=["lm_head"]))
    if quantize is not None:
        quantize_model(model, quantize, skip)
    elif OmegaConf.select(cfg, "precision.base_dtype", default=None) == "fp8":
        fp8_base_model(model, skip)  # an FP8 run's frozen base, as it trained
    return model, tokenizer


def load_checkpoint_weights(model: nn.Module, checkpoint: str | Path) -> None:
    """Load the ``model.*`` weights of a ``CausalLMModule`` checkpoint into ``model`` (strict).

    4-bit weights load into a model quantised the same way; any other combination is a
    ``ValueError`` naming the mismatch. The file is read with ``weights_only=True``
    (:func:`~lightning_sloth.plugins.checkpoint.load_checkpoint_file`): one that pickles any other
    type is refused with an ``UnsafeCheckpointError`` before anything in it runs.
    """
    state = load_checkpoint_file(checkpoint, map_location="cpu")["state_dict"]
    weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    check_checkpoint_quantization(model, weights)
    model.load_state_dict(weights, strict=True)


def last_checkpoint(run_dir: str | Path) -> Path:
    """``RUN_DIR/checkpoints/last.ckpt``, or a clear error when the run saved none."""
    path = Path(run_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoint at {path} (did the run train a step?)")
    return path


def load_trained(run_dir: str | Path, checkpoint: str | Path | None = None):
    """``(model, tokenizer)``: the trained model of a run (PEFT-wrapped for LoRA), float32, eval mode.

    A 4-bit base comes back dequantised (:func:`~lightning_sloth.quant.dequantize_model`): the
    float32 weights training decoded, the adapter unmerged.
    """
    cfg = load_run_config(run_dir)
    check_exportable(cfg)
    model, tokenizer = build_base(cfg)
    load_checkpoint_weights(model, checkpoint or last_checkpoint(run_dir))
    dequantize_model(model)
    return model.float().eval(), tokenizer


def load_run_model(run_dir: str | Path):
    """The model to generate with: the run's merged export if present, else :func:`load_trained`.

    The merged export is read from safetensors only (never a pickled ``pytorch_model.bin``) and
    without remote code.
    """
    merged = Path(run_dir) / MERGED_DIR
    if (merged / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(merged, use_safetensors=True, trust_remote_code=False)
        return model.eval(), AutoTokenizer.from_pretrained(merged, trust_remote_code=False)
    return load_trained(run_dir)


def save_merged(model: nn.Module, tokenizer, out: str | Path, dtype: str = "bfloat16") -> Path:
    """Merge a PEFT model's adapter (a plain model is saved as is), cast and ``save_pretrained``.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer.
    ``model`` must be unpatched (see :func:`build_base`); it is merged in place. 4-bit base weights
    are dequantised to float32 first and the merge runs in float32, so the only rounding to
    ``dtype`` is the last one.
    """
    from transformers import GenerationConfig

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    if dequantize_model(model):
        model.float()
        _merge_bitsandbytes_wrappers(model)
        _forget_quantization(model)
    merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    merged = merged.to(getattr(torch, dtype))
    merged.config.use_cache = True
    merged.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        do_sample=False,
        max_new_tokens=256,
    )
    out = Path(out)
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def _merge_bitsandbytes_wrappers(model: nn.Module) -> None:
    """Merge PEFT's bitsandbytes LoRA layers (whose own merge re-quantises) into their dequantised base.

    After :func:`~lightning_sloth.quant.dequantize_model` the base of such a wrapper is a float32
    ``nn.Linear``: the active adapters' deltas are added to it in float32 and the wrapper gives way
    to it, so ``merge_and_unload`` only sees plain layers.
    """
    wrappers = [
        (n, m) for n, m in model.named_modules() if type(m).__module__.startswith("peft.tuners.lora.bnb")
    ]
    for name, module in wrappers:
        base = module.get_base_layer()
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                base.weight += module.get_delta_weight(adapter).to(base.weight.dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, base)


def _forget_quantization(model: nn.Module) -> None:
    """Drop transformers' record of a bitsandbytes load: the dequantised model saves as a plain one."""
    for module in model.modules():
        if hasattr(module, "hf_quantizer"):
            for attr in ("hf_quantizer", "quantization_method", "is_quantized", "is_loaded_in_4bit"):
                module.__dict__.pop(attr, None)
            module.config.__dict__.pop("quantization_config", None)
            module.config.__dict__.pop("_is_quantized", None)


def export_run(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    dtype: str = "bfloat16",
    checkpoint: str | Path | None = None,
) -> dict[str, Path]:
    """Write ``adapter/`` (LoRA runs) and ``merged/`` under ``out`` (default: the run directory).

    Returns:
        ``{"adapter": path, "merged": path}`` (no ``adapter`` for a full fine-tune).
    """
    out = Path(out or run_dir)
    model, tokenizer = load_trained(run_dir, checkpoint)
    written = {}
    if hasattr(model, "peft_config"):
        model.save_pretrained(out / ADAPTER_DIR)
        written["adapter"] = out / ADAPTER_DIR
    written["merged"] = save_merged(model, tokenizer, out / MERGED_DIR, dtype)
    return written


class ExportMerged(Callback):
    """At the end of training, write the merged 16-bit model (as ``lightning-sloth-export`` does).

    The live model carries the training-time patches, so its weights are copied into a freshly
    built unpatched model first.

    Args:
        build_base: zero-argument callable returning the unpatched model, PEFT-wrapped like the
            trained one, and its tokenizer (the app passes :func:`build_base` of the run config).
        out: the directory to write.
        dtype: ``bfloat16``, ``float16`` or ``float32``.
    """

    def __init__(self, build_base: Any, out: str | Path, dtype: str = "bfloat16") -> None:
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
        self.build_base = build_base
        self.out = Path(out)
        self.dtype = dtype

    @rank_zero_only
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        live = pl_module.model
        weights = {k: _to_cpu_float32(v) for k, v in live.state_dict().items()}
        model, tokenizer = self.build_base()
        check_checkpoint_quantization(model, weights)
        model.load_state_dict(weights, strict=True)
        save_merged(model, tokenizer, self.out, self.dtype)
        log.info("saved the merged model to %s", self.out)


def _to_cpu_float32(value: Any) -> Any:
    """A state-dict entry on the CPU, floating-point tensors in float32; 4-bit codes, the int32
    bits of block scales and quantisation records (dicts) exactly as they are."""
    if not torch.is_tensor(value):
        return value
    value = value.detach().to("cpu")
    return value.float() if value.is_floating_point() else value


def main(argv: list[str] | None = None) -> None:
    """``lightning-sloth-export RUN_DIR [--out DIR] [--dtype bfloat16|float16|float32]``."""
    parser = argparse.ArgumentParser(
        prog="lightning-sloth-export",
        description="Export a lightning-sloth run: the PEFT adapter and a merged transformers checkpoint.",
    )
    parser.add_argument("run_dir", help="the run's output directory (holds .hydra/ and checkpoints/)")
    parser.add_argument("--out", default=None, help="where adapter/ and merged/ go (default: RUN_DIR)")
    parser.add_argument("--dtype", default="bfloat16", choices=EXPORT_DTYPES)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint other than checkpoints/last.ckpt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    written = export_run(args.run_dir, args.out, dtype=args.dtype, checkpoint=args.checkpoint)
    for kind, path in written.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
