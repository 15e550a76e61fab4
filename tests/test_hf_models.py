"""Real checkpoints in and out: ``model=hf model.name_or_path=DIR`` end to end on tiny local model
directories (``save_pretrained`` with a tokenizer that has a chat template) of four families:
train, save the adapter, reload it with PEFT on the unpatched model, same logits."""

import pytest
import torch
from peft import PeftModel
from test_export import run_app
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lightning_sloth import export
from lightning_sloth.data import build_char_tokenizer

SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {}),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, {"sliding_window": 16}),
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": None}),
}
IDS = [[1, 72, 73, 86, 73, 30, 5, 69, 70, 71, 4, 71, 70, 69, 2]]


def make_model_dir(path, family: str):
    model_class, config_class, extra = FAMILIES[family]
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=len(tokenizer), **SHAPE, **extra))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert tokenizer.chat_template
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_train_then_reload_the_adapter_on_the_unpatched_model(tmp_path, family):
    model_dir = make_model_dir(tmp_path / family, family)
    out = tmp_path / "run"
    summary = run_app(
        out,
        [
            "model=hf",
            f"model.name_or_path={model_dir}",
            "trainer=cpu_debug",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "trainer.samples=2",
            "trainer.sample_max_new_tokens=4",
            "trainer.enable_progress_bar=false",
            "data.num_train=16",
            "data.num_val=4",
            "data.max_tokens=128",
            "optimizer.lr=0.05",
        ],
    )
    assert summary["steps"] == 2 and summary["val"]["generated_exact_match"] is not None

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(base).__name__ == FAMILIES[family][0].__name__
    reloaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    trained, _ = export.load_trained(out)
    with torch.no_grad():
        got = reloaded(torch.tensor(IDS)).logits
        expected = trained(torch.tensor(IDS)).logits
        plain = AutoModelForCausalLM.from_pretrained(model_dir)(torch.tensor(IDS)).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (got - plain).abs().max() > 1e-4  # the adapter trained
