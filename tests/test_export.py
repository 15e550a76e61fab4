"""From a run to checkpoints that load anywhere: the PEFT adapter, the merged transformers
checkpoint (loaded in a process where lightning_sloth cannot be imported), the export callback,
and ``lightning-sloth-generate``."""

import os
import subprocess
import sys
from pathlib import Path

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
    result = subprocess.run(
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
    probe = subprocess.run(
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


def test_quantized_bases_are_not_exported_yet():
    with pytest.raises(NotImplementedError, match="quantize='nf4'"):
        export.check_exportable(OmegaConf.create({"precision": {"quantize": "nf4"}}))
    export.check_exportable(OmegaConf.create({"precision": {"precision": "auto"}}))
