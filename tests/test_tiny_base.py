"""The tiny pretrained base shipped in the package, and its deterministic recipe."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_sloth import tiny_base


def test_recipe_is_deterministic():
    assert tiny_base._documents(5, 4) == tiny_base._documents(5, 4) != tiny_base._documents(6, 4)
    first, _ = tiny_base.pretrain(steps=2, log_every=100)
    second, _ = tiny_base.pretrain(steps=2, log_every=100)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    fresh = tiny_base.build_base_model(tiny_base.build_char_tokenizer())
    assert not torch.equal(first.model.norm.weight, fresh.model.norm.weight)  # it trained


def test_shipped_base_loads_with_transformers_alone():
    path = tiny_base.TINY_BASE_DIR
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 800_384
    assert (path / "model.safetensors").stat().st_size < 4_000_000
    assert tokenizer.decode(tokenizer.encode("reverse: abc\n", add_special_tokens=False)) == "reverse: abc\n"
    assert tokenizer.chat_template and len(tokenizer) == model.config.vocab_size == 100
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 4
    assert tiny_base.weights_sha256(path).startswith("c8c24605")
