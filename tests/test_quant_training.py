"""QLoRA end to end on CPU: ``Trainer`` + ``SlothStrategy`` + ``SlothPrecision(quantize=...)``, the
precision modes inside attention and MLP, bitsandbytes-loaded models, the adapter in PEFT format,
quantise-while-loading, the memory plan's count of 4-bit layers, the Hydra preset, and bad input."""

import copy

import pytest
import torch
from _models import LORA_TARGETS, add_lora, packed_batch, random_documents, tiny_llama, tiny_qwen3
from lightning.pytorch import Callback, Trainer, seed_everything
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sloth import CausalLMModule, LoraSettings, OptimizerSettings, SlothPrecision, SlothStrategy
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.quant import Linear4bit, load_quantized, quantize_model, random_quantized


class _Record(Callback):
    """Losses per step, whether every LoRA gradient was non-zero, and dtypes seen inside the layers."""

    def __init__(self):
        self.losses, self.lora_grads_nonzero, self.dtypes, self.int_inputs = [], [], {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for n, p in pl_module.named_parameters() if "lora_" in n]
        self.lora_grads_nonzero.append(
            bool(grads) and all(g is not None and g.abs().sum() > 0 for g in grads)
        )

    def on_fit_start(self, trainer, pl_module):
        model = find_hf_model(pl_module)
        layer = model.model.layers[0]

        def record(name):
            def hook(module, args, kwargs, output):
                out = output[0] if isinstance(output, tuple) else output
                self.dtypes[name] = out.dtype
                self.dtypes[name + "_input"] = (args[0] if args else kwargs["hidden_states"]).dtype

            return hook

        layer.self_attn.register_forward_hook(record("attention"), with_kwargs=True)
        layer.mlp.register_forward_hook(record("mlp"), with_kwargs=True)
        layer.mlp.down_proj.register_forward_hook(record("down_proj"), with_kwargs=True)

        def inputs(module, args, kwargs):
            for key in ("input_ids", "position_ids", "cu_seq_lens_q", "labels"):
                if torch.is_tensor(kwargs.get(key)):
                    self.int_inputs[key] = kwargs[key].dtype

        model.register_forward_pre_hook(inputs, with_kwargs=True)


def _fit(model, precision, steps=6, quantize="nf4", lr=2e-2, ckpt_path=None, save_to=None):
    seed_everything(0)
    tokenizer = build_char_tokenizer()
    data = PackedDataModule(tokenizer, train=SyntheticTask(64, seed=1), max_tokens=256)
    module = CausalLMModule(model, lora=LoraSettings(r=8), optimizer=OptimizerSettings(lr=lr))
    record = _Record()
    trainer = Trainer(
        plugins=[SlothPrecision(precision, quantize=quantize)],
        strategy=SlothStrategy(kernels=True),
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module, record


def _vocab(**overrides):
    return {"vocab_size": len(build_char_tokenizer()), **overrides}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_nf4_lora_trains_through_trainer(make):
    module, record = _fit(make(**_vocab(initializer_range=0.02)), "32-true", steps=8)
    model = find_hf_model(module)
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 14  # 7 projections x 2 layers; lm_head kept
    assert type(model.lm_head) is nn.Linear
    assert sum(record.losses[-2:]) < sum(record.losses[:2])
    assert all(record.lora_grads_nonzero[1:])  # step 1: lora_B starts at zero, so lora_A has no gradient yet
    assert all(not p.requires_grad for layer in layers for p in layer.parameters())


def test_base_weights_untouched_by_training():
    model = tiny_llama(**_vocab())
    reference = copy.deepcopy(model)
    quantize_model(reference, "nf4")
    module, _ = _fit(model, "32-true", steps=3)
    trained = dict(find_hf_model(module).named_modules())
    for name, layer in reference.named_modules():
        if isinstance(layer, Linear4bit):
            mine = trained[name + ".base_layer"]  # under PEFT's lora.Linear
            for key, value in layer.state_dict().items():
                if torch.is_tensor(value):
                    assert torch.equal(mine.state_dict()[key], value), (name, key)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("32-true", torch.float32),
        ("bf16-true", torch.bfloat16),
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
    ],
)
def test_precision_is_honoured_inside_attention_and_mlp(precision, dtype):
    _, record = _fit(tiny_llama(**_vocab()), precision, steps=1)
    assert record.dtypes["attention"] == dtype and record.dtypes["mlp"] == dtype
    assert record.dtypes["down_proj"] == dtype
    if precision == "32-true":
        assert record.dtypes["attention_input"] == torch.float32 == record.dtypes["mlp_input"]
    assert record.int_inputs["input_ids"] == torch.int64
    assert record.int_inputs["cu_seq_lens_q"] == torch.int32  # integer batch tensors never cast


# --------------------------------------------------------------------- bitsandbytes-loaded models
def _bnb_loaded(tmp_path, make=tiny_llama):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    make(**_vocab()).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    return AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, device_map="cpu", dtype=torch.float32
    )


class _OpNames(TorchDispatchMode):
    """The names of the ops dispatched inside the block (forward and backward)."""

    def __enter__(self):
        self.names = []
        super().__enter__()
        return self.names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_bitsandbytes_model_matches_peft_and_trains_without_requantising(tmp_path):
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as BnbLoraLinear4bit

    from lightning_sloth.transform import transform_model

    theirs = add_lora(_bnb_loaded(tmp_path))
    ours = copy.deepcopy(theirs)
    report = transform_model(ours, kernels=True, packed_attention=True)
    assert report.kernels.counts["lora"] == 14
    batch = packed_batch(random_documents([13, 30, 7], vocab=64))
    inputs = batch.model_inputs() | {"labels": batch.labels}
    losses, grads = [], []
    for model in (ours, theirs):
        model.train()
        with _OpNames() as seen:
            loss = model(**inputs).loss
            loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        if model is ours:  # each down_proj writes its input's gradient where the input was
            assert seen.count("sloth.lora_linear_4bit_backward_.default") == 2
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    assert len(grads[0]) == 28
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-6)

    # Through Trainer: the bitsandbytes storage is trained through as it is (no Linear4bit of ours).
    packed = {n: m.weight.data.clone() for n, m in theirs.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    module, record = _fit(theirs, "32-true", steps=3, quantize="nf4")
    model = find_hf_model(module)
    assert not any(isinstance(m, Linear4bit) for m in model.modules())
    assert sum(isinstance(m, BnbLoraLinear4bit) for m in model.modules()) == 14
    for name, m in theirs.named_modules():
        if name in packed:
            assert torch.equal(m.weight.data, packed[name])
    assert all(record.lora_grads_nonzero[1:])  # step 1: lora_B starts at zero, so lora_A has no gradient yet


def test_adapter_saves_in_peft_format_and_reloads(tmp_path):
    from peft import PeftModel

    module, _ = _fit(tiny_llama(**_vocab()), "32-true", steps=2)
    peft_model = module.model
    peft_model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in key for key in saved)
    base = tiny_llama(**_vocab())
    quantize_model(base, "nf4")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    trained = dict(peft_model.named_parameters())
    for name, param in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, trained[name])


def test_resume_from_a_4bit_checkpoint_and_mismatches(tmp_path):
    ckpt = tmp_path / "nf4.ckpt"
    first, _ = _fit(tiny_llama(**_vocab()), "32-true", steps=2, save_to=ckpt)
    resumed, record = _fit(tiny_llama(**_vocab()), "32-true", steps=4, ckpt_path=ckpt)
    assert len(record.losses) == 2  # steps 3 and 4
    with pytest.raises(ValueError, match="resume with the same quantize setting"):
        _fit(tiny_llama(**_vocab()), "32-true", steps=4, quantize=None, ckpt_path=ckpt)
    with pytest.raises(ValueError, match="4-bit layers do not match"):
        _fit(tiny_llama(**_vocab()), "32-true", steps=4, quantize="fp4", ckpt_path=ckpt)
    dense = tmp_path / "dense.ckpt"
    _fit(tiny_llama(**_vocab()), "32-true", steps=1, quantize=None, save_to=dense)
    with pytest.raises(ValueError, match="written without quantisation"):
        _fit(tiny_llama(**_vocab()), "32-true", steps=2, ckpt_path=dense)


# --------------------------------------------------------------------------- loading, memory plan
def test_load_quantized_shard_by_shard_equals_quantising_the_loaded_model(tmp_path):
    model = tiny_qwen3(**_vocab())
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_quantized(tmp_path, "nf4-dq", device="cpu", dtype=torch.float32)
    reference = copy.deepcopy(model)
    quantize_model(reference, "nf4-dq")
    assert sum(isinstance(m, Linear4bit) for m in loaded.modules()) == 14
    mine, theirs = loaded.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        if torch.is_tensor(value):
            assert torch.equal(mine[key], value), key
    ids = torch.randint(0, 64, (1, 17))
    torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_random_quantized_builds_in_four_bits():
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = random_quantized(config, "nf4", device="cpu", dtype=torch.float32)
    assert sum(isinstance(m, Linear4bit) for m in model.modules()) == 14
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.isfinite(model(input_ids=torch.randint(0, 64, (1, 9))).logits).all()


def test_memory_plan_counts_4bit_layers_like_dense_ones():
    """The block scales and code books a 4-bit layer saves are its buffers, not activations: the
    measured bytes per layer equal those of the same model with dense weights."""
    from lightning_sloth.offload import apply_checkpointing

    measured = []
    for quantize in (False, True):
        model = add_lora(tiny_llama())
        if quantize:
            quantize_model(model, "nf4")
        ckpt = apply_checkpointing(model, memory_budget=1 << 30)
        batch = packed_batch(random_documents([20, 33], vocab=64))
        model.train()
        model(**batch.model_inputs(), labels=batch.labels).loss.backward()
        measured.append((ckpt.activation_bytes, ckpt.input_bytes))
    assert measured[0] == measured[1]


# ----------------------------------------------------------------------------- config, bad input
def test_hydra_preset_and_override():
    from hydra import compose, initialize_config_module

    from lightning_sloth import build
    from lightning_sloth.config import ConfigError, validate

    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        cfg = compose("train", overrides=["precision=qlora_nf4"])
        validate(cfg)
        plugin = build.build_precision(cfg.precision)
        assert plugin.quantize == "nf4" and plugin.quantize_skip == ("lm_head",)
        cfg = compose("train", overrides=["precision=fp32", "precision.quantize=nf4-dq"])
        plugin = build.build_precision(cfg.precision)
        assert plugin.quantize == "nf4-dq" and plugin.precision == "32-true"
        assert build.build_precision(compose("train").precision).quantize is None
        with pytest.raises(ConfigError, match="precision.quantize"):
            validate(compose("train", overrides=["precision.quantize=int3"]))


def test_precision_plugin_bad_input():
    with pytest.raises(ValueError, match="given twice"):
        SlothPrecision("nf4", quantize="nf4")
    assert SlothPrecision("nf4").quantize == "nf4"
    with pytest.raises(ValueError, match="unknown 4-bit quantisation"):
        SlothPrecision("32-true", quantize="int4")
    with pytest.raises(ValueError, match="contradicts"):
        SlothPrecision("32-true", quantize="nf4", compute_dtype=torch.bfloat16)
    assert (
        SlothPrecision("bf16-true", quantize="nf4", compute_dtype="bfloat16").compute_dtype == torch.bfloat16
    )
    plugin = SlothPrecision("32-true", quantize="nf4")
    with pytest.raises(ValueError, match="no nn.Linear layer to quantise"):
        plugin.convert_module(nn.Sequential(nn.Embedding(4, 4)))
    model = tiny_llama()
    assert plugin.convert_module(model) is model  # in place
    assert sum(isinstance(m, Linear4bit) for m in model.modules()) == 14
    assert LORA_TARGETS
