"""Generation from a model prepared for packed training: the KV cache, and everything stepping aside."""

import copy

import pytest
import torch
from _models import LORA_TARGETS, packed_batch, random_documents, tiny_llama
from peft import LoraConfig, get_peft_model

from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.generation import encode_prompt, generation_mode, greedy_generate
from lightning_sloth.transform import transform_model

PROMPTS = [[1, 17, 33, 5, 60], [1, 9], [1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]


def lora_llama():
    model = get_peft_model(tiny_llama(seed=3), LoraConfig(r=4, target_modules=list(LORA_TARGETS)))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero adapters, so the adapter takes part in what is generated
            torch.nn.init.normal_(param, std=0.2)
    return model.train()


def test_cached_generation_equals_uncached_and_the_plain_model():
    plain = lora_llama()
    model = copy.deepcopy(plain)
    transform_model(model, packed_attention=True, gradient_checkpointing=True, kernels=True)
    hf = model.get_base_model()
    assert hf.config._attn_implementation == "sloth" and hf.config.use_cache is False

    with generation_mode(model):
        cached = greedy_generate(model, PROMPTS, eos_token_id=None, max_new_tokens=12, use_cache=True)
        uncached = greedy_generate(model, PROMPTS, eos_token_id=None, max_new_tokens=12, use_cache=False)
        assert hf.config._attn_implementation == "sdpa" and hf.config.use_cache is True
    with generation_mode(plain):
        reference = greedy_generate(plain, PROMPTS, eos_token_id=None, max_new_tokens=12, use_cache=True)

    assert cached == uncached == reference
    assert all(len(ids) == 12 for ids in cached)
    assert len({tuple(ids) for ids in cached}) > 1  # the prompts lead somewhere different


def test_training_state_comes_back_after_generation():
    model = lora_llama()
    transform_model(model, packed_attention=True, gradient_checkpointing=True)
    hf = model.get_base_model()
    batch = packed_batch(random_documents([7, 12, 5], seed=1))
    before = model(**batch.model_inputs(), labels=batch.labels).loss

    with generation_mode(model):
        greedy_generate(model, PROMPTS[:1], eos_token_id=None, max_new_tokens=4)
    assert model.training and hf.config.use_cache is False
    assert hf.config._attn_implementation == "sloth"
    after = model(**batch.model_inputs(), labels=batch.labels).loss
    assert torch.equal(before, after)
    after.backward()  # the graph is intact: checkpointed layers recompute as before


def test_generation_mode_restores_on_error():
    model = lora_llama()
    transform_model(model, packed_attention=True, gradient_checkpointing=False)
    with pytest.raises(RuntimeError, match="boom"), generation_mode(model):
        raise RuntimeError("boom")
    assert model.training and model.get_base_model().config._attn_implementation == "sloth"


def test_validation_examples_are_prompt_and_response_of_the_records():
    tokenizer = build_char_tokenizer()
    train, val = SyntheticTask.splits(16, 10, seed=5, tasks=["reverse", "add"])
    data = PackedDataModule(tokenizer, train, val, max_tokens=128)
    examples = data.validation_examples(4)
    assert len(examples) == 4
    for (prompt, response), index in zip(examples, (0, 2, 5, 7)):
        record = val[index]
        assert prompt == encode_prompt(tokenizer, record["prompt"])
        assert tokenizer.decode(response) == record["response"]
    assert PackedDataModule(tokenizer, train, None).validation_examples(4) == []


def test_a_model_without_sdpa_generates_with_its_eager_attention():
    # GPT-OSS (attention sinks) has no SDPA path: generation falls back to eager, cache or not.
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(5)
    config = GptOssConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        attn_implementation="eager",
    )
    plain = GptOssForCausalLM(config).train()
    model = copy.deepcopy(plain)
    transform_model(model, packed_attention=True, gradient_checkpointing=True, kernels=True)
    hf_config = model.config
    assert hf_config._attn_implementation == "sloth"
    with generation_mode(model):
        assert hf_config._attn_implementation == "eager"
        cached = greedy_generate(model, PROMPTS, eos_token_id=None, max_new_tokens=6, use_cache=True)
        uncached = greedy_generate(model, PROMPTS, eos_token_id=None, max_new_tokens=6, use_cache=False)
    with generation_mode(plain):
        reference = greedy_generate(plain, PROMPTS, eos_token_id=None, max_new_tokens=6, use_cache=True)
    assert hf_config._attn_implementation == "sloth"
    assert cached == uncached == reference
