"""Hydra config of the app: every group composes, wrong keys/values fail clearly, ranges are validated."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import lightning_sloth
from lightning_sloth import build
from lightning_sloth.config import (
    ConfigError,
    HFDatasetDataConfig,
    JsonlDataConfig,
    LRSchedule,
    PrecisionMode,
    PretrainedModelConfig,
    RandomModelConfig,
    Switch,
    SyntheticDataConfig,
    TrainConfig,
    validate,
)


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        yield


def make(*overrides):
    return compose("train", overrides=list(overrides))


def composition_error(*overrides) -> str:
    """The composition error's message with its cause (what Hydra prints on the command line)."""
    with pytest.raises(ConfigCompositionException) as info:
        make(*overrides)
    return f"{info.value}\n{info.value.__cause__}"


def test_default_is_the_packaged_tiny_base_on_synthetic_data(hydra_conf):
    cfg = make()
    validate(cfg)
    assert OmegaConf.get_type(cfg) is TrainConfig
    assert OmegaConf.get_type(cfg.model) is PretrainedModelConfig
    assert OmegaConf.get_type(cfg.data) is SyntheticDataConfig
    assert Path(cfg.model.name_or_path) == Path(lightning_sloth.__file__).parent / "assets" / "tiny_base"
    assert cfg.model.tokenizer == cfg.model.name_or_path
    assert list(cfg.data.tasks) == ["reverse", "repeat"]
    tiny = make("model=tiny_llama").model
    assert OmegaConf.get_type(tiny) is RandomModelConfig
    assert (tiny.hidden_size, tiny.num_hidden_layers) == (128, 4)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (4, 2)
    assert tiny.tokenizer == "char" and tiny.vocab_size is None
    assert cfg.lora.enabled and cfg.lora.r == 16 and len(cfg.lora.target_modules) == 7
    assert cfg.precision.precision is PrecisionMode.auto
    assert cfg.sloth.packed_attention and cfg.sloth.gradient_checkpointing
    assert cfg.data.seed == cfg.seed == 0
    assert cfg.resume == "auto"


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        (["model=llama_3_2_1b"], "model.vocab_size", 128256),
        (["model=hf", "model.name_or_path=org/llama"], "model.tokenizer", "org/llama"),
        (["data=jsonl", f"data.train_path={__file__}"], "data.val_path", None),
        (["data=hf_dataset", "data.path=org/set", "data.val_split=test"], "data.train_split", "train"),
        (["lora=none"], "lora.enabled", False),
        (["trainer=cpu_debug"], "trainer.accelerator", "cpu"),
        (["sloth=off"], "sloth.packed_attention", False),
        (["sloth=off"], "sloth.kernels", Switch.off),
        (["optimizer=adamw", "optimizer.scheduler=constant"], "optimizer.scheduler", LRSchedule.constant),
        (["experiment=llama_1b_bench"], "model.hidden_size", 2048),
        (["experiment=llama_1b_bench"], "precision.precision", PrecisionMode.bf16_true),
        (["experiment=tiny_full_finetune"], "lora.enabled", False),
    ],
)
def test_each_group_option_composes_and_validates(hydra_conf, overrides, key, expected):
    cfg = make(*overrides)
    validate(cfg)
    assert OmegaConf.select(cfg, key) == expected


@pytest.mark.parametrize(
    ("option", "lightning"),
    [
        ("auto", "auto"),
        ("bf16_true", "bf16-true"),
        ("bf16_mixed", "bf16-mixed"),
        ("fp16_mixed", "16-mixed"),
        ("fp32", "32-true"),
    ],
)
def test_precision_options_map_to_lightning_strings(hydra_conf, option, lightning):
    assert make(f"precision={option}").precision.precision.value == lightning


def test_group_options_extend_their_schema(hydra_conf):
    assert OmegaConf.get_type(make("model=hf", "model.name_or_path=x").model) is PretrainedModelConfig
    assert OmegaConf.get_type(make("data=jsonl").data) is JsonlDataConfig
    assert OmegaConf.get_type(make("data=hf_dataset").data) is HFDatasetDataConfig


def test_wrong_key_fails_while_composing(hydra_conf):
    message = composition_error("model=tiny_llama", "model.hiden_size=3")
    assert "Key 'hiden_size' not in 'RandomModelConfig'" in message
    assert "full_key: model.hiden_size" in message


def test_key_of_another_source_is_rejected(hydra_conf):
    # num_train belongs to the synthetic source only.
    assert "Key 'num_train' not in 'JsonlDataConfig'" in composition_error("data=jsonl", "data.num_train=5")


def test_appended_key_is_caught_by_validate(hydra_conf):
    # `+key=value` slips past the schema while composing; validate() names it.
    cfg = make("model=tiny_llama", "+model.hiden_size=3")
    with pytest.raises(
        ConfigError, match=r"model\.hiden_size: not a key of RandomModelConfig; did you mean 'hidden_size'"
    ):
        validate(cfg)


def test_wrong_enum_value_fails_while_composing(hydra_conf):
    message = composition_error("precision.precision=bf17")
    assert (
        "Invalid value 'bf17', expected one of [auto, bf16_mixed, bf16_true, fp16_mixed, fp16_true, fp32]"
        in message
    )
    assert "full_key: precision.precision" in message


def test_wrong_value_type_fails_while_composing(hydra_conf):
    message = composition_error("trainer.max_steps=many")
    assert "Value 'many' of type 'str' could not be converted to Integer" in message
    assert "full_key: trainer.max_steps" in message


def test_unknown_group_option_lists_the_options(hydra_conf):
    with pytest.raises(Exception, match=r"Could not find 'model/tiny_lama'(.|\n)*tiny_llama"):
        make("model=tiny_lama")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.max_tokens=0"], "data.max_tokens: must be > 0, got 0"),
        (["data.num_train=0"], "data.num_train: must be > 0, got 0"),
        (["data.tasks=[reverse,translate]"], "data.tasks: must be a non-empty subset of"),
        (["lora.r=0"], "lora.r: must be > 0, got 0"),
        (["lora.dropout=1.0"], r"lora.dropout: must be in \[0, 1\), got 1.0"),
        (["lora.target_modules=[]"], "lora.target_modules: empty together with lora.target_parameters"),
        (["optimizer.lr=-1e-3"], "optimizer.lr: must be > 0, got -0.001"),
        (["optimizer.betas=[0.9]"], "optimizer.betas: must be two values"),
        (["trainer.max_steps=0"], "trainer.max_steps: must be > 0"),
        (["trainer.devices=0"], "trainer.devices: must be >= 1 or -1"),
        (["trainer.val_check_interval=0"], "trainer.val_check_interval: must be > 0, got 0"),
        (
            ["model=tiny_llama", "model.num_key_value_heads=3"],
            r"model.num_key_value_heads: must divide num_attention_heads \(4\), got 3",
        ),
        (
            ["model=tiny_llama", "model.hidden_size=130"],
            "model.hidden_size: must be a multiple of num_attention_heads",
        ),
        (["data=jsonl"], "data.train_path: required for jsonl data"),
        (["data=hf_dataset"], "data.path: required for hf_dataset data"),
        (["model=hf"], "model.name_or_path: required for a pretrained model"),
        (
            ["sloth.memory_budget=lots"],
            "sloth.memory_budget: must be a positive number of bytes, 'auto' or null",
        ),
        (
            ["sloth.offload=on", "sloth.gradient_checkpointing=false"],
            "sloth.offload: needs sloth.gradient_checkpointing=true",
        ),
        (["sloth.checkpoint_impl=reentrant"], "sloth.checkpoint_impl: must be 'torch', 'node' or null"),
        (["sloth.mlp_chunk_tokens=0"], "sloth.mlp_chunk_tokens: must be a positive number of tokens"),
        (["sloth.cuda_graphs=true", "trainer.devices=2"], r"sloth.cuda_graphs: runs on one device"),
        (
            ["sloth.cuda_graphs=true", "sloth.gradient_checkpointing=false"],
            "sloth.cuda_graphs: needs sloth.gradient_checkpointing=true",
        ),
        (["sloth.cuda_graphs=true", "sloth.compile=true"], "sloth.cuda_graphs: excludes sloth.compile"),
        (["resume=''"], "resume: must be 'auto', a checkpoint path or null"),
    ],
)
def test_validate_names_the_key_out_of_range(hydra_conf, overrides, message):
    cfg = make(*overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_validate_reports_every_problem_at_once(hydra_conf):
    with pytest.raises(ConfigError) as info:
        validate(make("data.max_tokens=-5", "lora.r=0", "optimizer.lr=0"))
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid configuration:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["data.max_tokens", "lora.r", "optimizer.lr"]


def test_lora_none_and_max_steps_minus_one_with_epochs_are_valid(hydra_conf):
    validate(make("lora=none", "lora.r=0", "trainer.max_steps=-1", "trainer.max_epochs=2"))


def test_user_config_dir_adds_a_model(hydra_conf, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_model.yaml").write_text(
        "defaults:\n  - tiny_llama\n  - _self_\n\nhidden_size: 64\nnum_hidden_layers: 2\n"
    )
    cfg = make(f"hydra.searchpath=[file://{tmp_path}]", "model=my_model")
    validate(cfg)
    assert OmegaConf.get_type(cfg.model) is RandomModelConfig
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.num_attention_heads) == (64, 2, 4)
    # The built-in options stay available next to the user's.
    assert make(f"hydra.searchpath=[file://{tmp_path}]", "model=tiny_llama").model.hidden_size == 128


def test_user_config_is_checked_against_the_schema(hydra_conf, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "typo.yaml").write_text("defaults:\n  - tiny_llama\n  - _self_\n\nhiden_size: 64\n")
    with pytest.raises(Exception, match="hiden_size"):
        make(f"hydra.searchpath=[file://{tmp_path}]", "model=typo")


def test_model_config_is_sized_to_the_tokenizer(hydra_conf):
    cfg = make("model=tiny_llama")
    config = build.build_model_config(cfg.model, vocab_size=100)
    assert config.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (128, 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 100)
    big = build.build_model_config(make("model=llama_3_2_1b").model, vocab_size=100)
    assert (big.vocab_size, big.head_dim, big.tie_word_embeddings) == (128256, 64, True)
    with pytest.raises(ConfigError, match="model.vocab_size: 50 is smaller than the tokenizer's 100 ids"):
        build.build_model_config(make("model=tiny_llama", "model.vocab_size=50").model, vocab_size=100)


def test_model_extra_reaches_the_transformers_config(hydra_conf):
    config = build.build_model_config(
        make("model=tiny_llama", "+model.extra.rms_norm_eps=1e-3").model, vocab_size=100
    )
    assert config.rms_norm_eps == pytest.approx(1e-3)


def test_settings_builders_follow_the_config(hydra_conf):
    cfg = make("lora.r=8", "lora.dropout=0.1", "optimizer.lr=3e-3", "optimizer.scheduler=constant")
    lora = build.build_lora_settings(cfg.lora)
    assert (lora.r, lora.alpha, lora.dropout) == (8, 32, 0.1)
    assert tuple(lora.target_modules) == tuple(cfg.lora.target_modules)
    optimizer = build.build_optimizer_settings(cfg.optimizer)
    assert (optimizer.lr, optimizer.scheduler, tuple(optimizer.betas)) == (3e-3, "constant", (0.9, 0.999))
    assert build.build_lora_settings(make("lora=none").lora) is None


def test_sloth_settings_are_the_strategy_arguments(hydra_conf):
    cuda = torch.cuda.is_available()
    assert build.sloth_settings(make().sloth) == {
        "packed_attention": True,
        "gradient_checkpointing": True,
        "kernels": True if cuda else None,  # kernels: auto
        "offload": "off",
        "memory_budget": None,
        "compile": False,
        "moe": True,
        "checkpoint_impl": None,  # the strategy's default (node; torch's under sloth_fsdp)
        "cuda_graphs": False,
        "mlp_chunk_tokens": "auto",
    }
    assert build.sloth_settings(make("sloth=off").sloth) == {
        "packed_attention": False,
        "gradient_checkpointing": False,
        "kernels": None,
        "offload": "off",
        "memory_budget": None,
        "compile": False,
        "moe": False,
        "checkpoint_impl": None,
        "cuda_graphs": False,
        "mlp_chunk_tokens": "auto",
    }
    tuned = make(
        "sloth.kernels=on",
        "sloth.kernel_ops.rms_norm=false",
        "sloth.offload=auto",
        "sloth.memory_budget=8000000000",
        "sloth.compile=true",
        "+sloth.compile_options.dynamic=false",
    )
    validate(tuned)
    settings = build.sloth_settings(tuned.sloth)
    assert settings["kernels"] == {
        "rms_norm": False,
        "rope": True,
        "glu": True,
        "cross_entropy": True,
        "lora": True,
        "add_rms_norm": True,
    }
    assert (settings["offload"], settings["memory_budget"], settings["compile"]) == (
        "auto",
        8_000_000_000,
        {"dynamic": False},
    )
    assert build.sloth_settings(make("sloth.kernels=on").sloth)["kernels"] is True  # the default set
    assert build.sloth_settings(make("sloth.checkpoint_impl=torch").sloth)["checkpoint_impl"] == "torch"
    assert build.sloth_settings(make("sloth.cuda_graphs=true").sloth)["cuda_graphs"] is True
    assert build.sloth_settings(make("sloth.moe=fused").sloth)["moe"] == "fused"
    validate(make("sloth.moe=fused"))
    assert build.sloth_settings(make("sloth.moe=separate").sloth)["moe"] == "separate"
    validate(make("sloth.moe=separate"))
    with pytest.raises(ValueError, match="sloth.moe: must be true, false, fused or separate, got 'yes'"):
        validate(make("sloth.moe=yes"))
    assert build.sloth_settings(make("sloth.mlp_chunk_tokens=8192").sloth)["mlp_chunk_tokens"] == 8192
    assert build.sloth_settings(make("sloth.mlp_chunk_tokens=null").sloth)["mlp_chunk_tokens"] is None
    assert build.sloth_settings(make("sloth.kernels=on", "sloth.kernel_ops.add_rms_norm=false").sloth)[
        "kernels"
    ] == dict.fromkeys(["rms_norm", "rope", "glu", "cross_entropy", "lora"], True) | {"add_rms_norm": False}
    assert (
        build.sloth_settings(make("sloth.memory_budget=auto", "sloth.kernels=on").sloth)["memory_budget"]
        == "auto"
    )


def test_synthetic_sources_split_train_and_val(hydra_conf):
    train, val = build.build_data_sources(make("data.num_train=12", "data.num_val=5", "seed=3").data)
    assert (len(train), len(val)) == (12, 5)
    assert train.seed == 3 and val.seed != train.seed
    _, no_val = build.build_data_sources(make("data.num_val=0").data)
    assert no_val is None


def test_resume_resolution(tmp_path):
    assert build.resolve_resume(None, tmp_path) is None
    assert build.resolve_resume("auto", tmp_path) is None
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"")
    assert build.resolve_resume("auto", tmp_path) == str(last)
    assert build.resolve_resume(str(last), "/elsewhere") == str(last)
    with pytest.raises(FileNotFoundError, match="resume: checkpoint '/no/such.ckpt' does not exist"):
        build.resolve_resume("/no/such.ckpt", tmp_path)


@pytest.mark.parametrize(("offload", "expected"), [("off", False), ("on", True), ("auto", True)])
def test_offload_adds_its_statistics_callback(hydra_conf, tmp_path, offload, expected):
    from lightning_sloth.build import build_callbacks, offload_enabled
    from lightning_sloth.plugins import OffloadStatsCallback

    cfg = make(f"sloth.offload={offload}")
    callbacks = build_callbacks(cfg.trainer, tmp_path, offload_enabled(cfg))
    assert any(isinstance(c, OffloadStatsCallback) for c in callbacks) is expected


def test_missing_files_are_named_while_validating(hydra_conf, tmp_path):
    cfg = make(
        "data=jsonl",
        f"data.train_path={tmp_path / 'nope.jsonl'}",
        "model=hf",
        "model.name_or_path=/no/such/model",
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert f"data.train_path: no such file '{tmp_path / 'nope.jsonl'}'" in message
    assert "model.name_or_path: no such directory '/no/such/model'" in message


def test_cuda_graphs_give_the_datamodule_static_shapes(hydra_conf):
    from lightning_sloth.data import build_char_tokenizer

    cfg = make("sloth.cuda_graphs=true")
    tokenizer = build_char_tokenizer()
    static = build.build_datamodule(cfg.data, tokenizer, static_shapes=cfg.sloth.cuda_graphs).collator
    assert (static.pad_to, static.segments_bucket) == ("max_tokens", "pow2")
    plain = build.build_datamodule(make().data, tokenizer).collator
    assert (plain.pad_to, plain.segments_bucket) == ("multiple", "exact")
