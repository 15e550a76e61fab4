"""From a run to checkpoints that load anywhere: the PEFT adapter, the merged transformers
checkpoint (loaded in a process where lightning_sloth cannot be imported), the export callback,
and ``lightning-sloth-generate``."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import _processes
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from lightning_sloth import export, train
from lightning_sloth.generation import encode_prompt, generation_mode, greedy_generate

BIN = Path(sys.executable).parent
INPUT_IDS = [[1, 72, 73, 86, 73, 86, 87, 73, 30, 5, 69, 70, 71, 4, 71, 70]]
SHORT_RUN = [
    "trainer=cpu_debug",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.samples=2",
    "trainer.sample_max_new_tokens=8",
    "trainer.enable_progress_bar=false",
    "data.num_train=32",
    "data.num_val=8",
    "data.max_tokens=256",
]

# Runs in a fresh interpreter where `import lightning_sloth` fails: only transformers reads the export.
LOAD_WITHOUT_SLOTH = """
import sys
sys.modules["lightning_sloth"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
try:
    import lightning_sloth
except ImportError:
    pass
else:
    raise SystemExit("lightning_sloth was importable")
path, ids, out = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path).eval()
AutoTokenizer.from_pretrained(path)
with torch.no_grad():
    torch.save(model(torch.tensor(ids)).logits, out)
print(type(model).__name__, model.dtype, model.generation_config.eos_token_id)
"""


def run_app(out: Path, overrides: list[str]) -> dict:
    """The app in-process, as the console script runs it (the composed config saved under .hydra/)."""
    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    (out / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / ".hydra" / "config.yaml")
    return train.run(cfg, out)


def logits_of(model, ids=INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    summary = run_app(out, [*SHORT_RUN, "export=merged", "export_dtype=float32"])
    assert summary["steps"] == 3
    return out


def cli(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = _processes.run(
        [str(BIN / name), *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_merged_export_loads_without_lightning_sloth_with_the_trained_logits(run_dir, tmp_path):
    cli("lightning-sloth-export", str(run_dir), "--dtype", "float32", "--out", str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = tmp_path / "merged"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (merged / name).is_file(), name
    probe = _processes.run(
        [sys.executable, "-c", LOAD_WITHOUT_SLOTH, str(merged), repr(INPUT_IDS), str(tmp_path / "logits.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["LlamaForCausalLM", "torch.float32", "2"]

    trained, _ = export.load_trained(run_dir)
    expected = logits_of(trained)
    got = torch.load(tmp_path / "logits.pt")
    # Merging rounds W + s·BA once instead of adding x·W and s·x·B·A: float32 rounding of the logits' scale.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # The adapter moved the logits: the export is not just the base.
    base = AutoModelForCausalLM.from_pretrained(trained.peft_config["default"].base_model_name_or_path)
    assert (logits_of(base) - expected).abs().max() > 1e-3


def test_export_callback_writes_what_the_cli_writes(run_dir, tmp_path):
    """``export=merged`` merges the live weights at the end of training; the CLI merges the final
    checkpoint: the same model, so the final checkpoint holds the trained weights."""
    from_callback = AutoModelForCausalLM.from_pretrained(run_dir / "merged")
    from_cli = AutoModelForCausalLM.from_pretrained(
        export.export_run(run_dir, tmp_path, dtype="float32")["merged"]
    )
    torch.testing.assert_close(logits_of(from_callback), logits_of(from_cli), rtol=1e-6, atol=1e-6)


def test_sixteen_bit_export(run_dir, tmp_path):
    merged = export.export_run(run_dir, tmp_path)["merged"]  # bfloat16 by default
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert model.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16
    trained, _ = export.load_trained(run_dir)
    expected = logits_of(trained)
    # bfloat16 weights keep 8 bits of mantissa: errors of a few percent of the logits' scale.
    torch.testing.assert_close(logits_of(model), expected, rtol=0.05, atol=0.03 * float(expected.abs().max()))


def test_generate_cli_prints_the_greedy_continuation(run_dir, tmp_path):
    result = cli(
        "lightning-sloth-generate", str(run_dir), "reverse: abc\\n", "--max-new-tokens", "6", cwd=tmp_path
    )
    model, tokenizer = export.load_run_model(run_dir)
    with generation_mode(model):
        (ids,) = greedy_generate(
            model,
            [encode_prompt(tokenizer, "reverse: abc\n")],
            eos_token_id=tokenizer.eos_token_id,
            max_new_tokens=6,
        )
    assert result.stdout.strip() == f"reverse: abc\\n -> {tokenizer.decode(ids, skip_special_tokens=True)}"


def test_run_directory_is_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a lightning-sloth run directory"):
        export.load_trained(tmp_path)


# ------------------------------------------------------------------------------- 4-bit bases
@pytest.fixture(scope="module")
def nf4_run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export_nf4") / "run"
    overrides = [
        *SHORT_RUN,
        "precision=qlora_nf4",
        "export=merged",
        "export_dtype=float32",
        "trainer.samples=0",
    ]
    summary = run_app(out, overrides)
    assert summary["steps"] == 3
    return out


def quantized_trained(run_dir: Path):
    """The run's model as it trained: 4-bit base layers (our op) under the unmerged adapter."""
    cfg = export.load_run_config(run_dir)
    model, _ = export.build_base(cfg)
    export.load_checkpoint_weights(model, export.last_checkpoint(run_dir))
    return model.eval()


def test_nf4_run_exports_merged_weights_with_the_4bit_models_logits(nf4_run_dir, tmp_path):
    from lightning_sloth.quant import Linear4bit

    cli(
        "lightning-sloth-export", str(nf4_run_dir), "--dtype", "float32", "--out", str(tmp_path), cwd=tmp_path
    )
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.float32
    assert all(type(m).__name__ != "Linear4bit" for m in merged.modules())

    ours = quantized_trained(nf4_run_dir)
    layers = ours.config.num_hidden_layers
    assert sum(isinstance(m, Linear4bit) for m in ours.modules()) == 7 * layers  # lm_head kept
    expected = logits_of(ours)  # float32: the base dequantised inside sloth::lora_linear_4bit
    torch.testing.assert_close(
        logits_of(merged), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )
    # The callback merged the live weights at the end of training: the same model.
    from_callback = AutoModelForCausalLM.from_pretrained(nf4_run_dir / "merged")
    torch.testing.assert_close(logits_of(from_callback), logits_of(merged), rtol=1e-6, atol=1e-6)
    # The adapter moved the logits, and the merged weights are the decoded 4-bit ones plus it.
    base = quantized_trained(nf4_run_dir)
    with base.disable_adapter():
        assert (logits_of(base) - expected).abs().max() > 1e-3
    sixteen = AutoModelForCausalLM.from_pretrained(
        export.export_run(nf4_run_dir, tmp_path / "bf16")["merged"]
    )
    assert sixteen.dtype == torch.bfloat16
    torch.testing.assert_close(
        logits_of(sixteen), expected, rtol=0.05, atol=0.03 * float(expected.abs().max())
    )


def test_checkpoint_quantization_mismatch_is_named_by_the_export(nf4_run_dir):
    cfg = export.load_run_config(nf4_run_dir)
    cfg.precision.quantize = "fp4"
    model, _ = export.build_base(cfg)
    with pytest.raises(ValueError, match="4-bit layers do not match"):
        export.load_checkpoint_weights(model, export.last_checkpoint(nf4_run_dir))
    cfg.precision.quantize = "int3"
    with pytest.raises(ValueError, match="unknown 4-bit quantisation 'int3'"):
        export.check_exportable(cfg)
    export.check_exportable(OmegaConf.create({"precision": {"precision": "auto"}}))


def _saved_logits(model, tmp_path, ids) -> torch.Tensor:
    from lightning_sloth.data import build_char_tokenizer

    export.save_merged(model, build_char_tokenizer(), tmp_path / "merged", "float32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(n.endswith(("_absmax", "_code")) for n in loaded.state_dict())
    return logits_of(loaded, ids)


@pytest.mark.parametrize("quant_type", ["nf4-dq", "fp4"])
def test_save_merged_dequantises_every_format(quant_type, tmp_path):
    from _models import add_lora, tiny_llama

    from lightning_sloth.quant import quantize_model

    model = add_lora(tiny_llama(vocab_size=128))
    assert len(quantize_model(model, quant_type)) == 14
    ids = [[5, 9, 17, 3, 99, 42, 7]]
    expected = logits_of(model, ids)
    torch.testing.assert_close(
        _saved_logits(model, tmp_path, ids), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )


def test_save_merged_dequantises_4bit_moe_experts_with_lora(tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model
    from test_moe import EXPERT_LORA, VOCAB, tiny_moe

    from lightning_sloth.moe.quant import expert_storage
    from lightning_sloth.patching import apply_experts
    from lightning_sloth.quant import quantize_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_LORA, init_lora_weights=False
    )
    model = get_peft_model(tiny_moe("qwen3_moe", experts=4), config).eval()
    names = quantize_model(model, "nf4", skip=("lm_head", "self_attn"))
    assert sum("experts" in n for n in names) == 4
    ours = copy.deepcopy(model)
    apply_experts(ours)  # 4-bit experts compute through the sloth experts only
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0)).tolist()
    expected = logits_of(ours, ids)
    got = _saved_logits(model, tmp_path, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    experts = model.base_model.model.model.layers[0].mlp.experts
    assert expert_storage(experts, "gate_up_proj") is None  # dequantised in place


def test_save_merged_takes_a_bitsandbytes_loaded_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    from _models import add_lora, tiny_llama
    from transformers import BitsAndBytesConfig

    tiny_llama(vocab_size=128).save_pretrained(tmp_path / "base")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=quantization, device_map="cpu", dtype=torch.float32
    )
    model = add_lora(loaded)
    ids = [[5, 9, 17, 3, 99, 42, 7]]
    # The reference: the same model with each 4-bit layer a float32 linear over bitsandbytes' own
    # dequantisation (its CPU 4-bit forward may run another precision, depending on the processor).
    import bitsandbytes as bnb

    reference = copy.deepcopy(model)
    for name, module in list(reference.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if module.bias is not None:
                    linear.bias.copy_(module.bias.float())
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, linear)
    expected = logits_of(reference, ids)
    got = _saved_logits(model, tmp_path, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
