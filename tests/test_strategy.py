"""SlothStrategy, transform_model and the callbacks, driven through a real Lightning Trainer."""

import json

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sloth import (
    CausalLMModule,
    GradientFlowGuard,
    LoraSettings,
    OptimizerSettings,
    SaveAdapter,
    SlothPrecision,
    SlothStrategy,
    SlothThroughputMonitor,
)
from lightning_sloth.data import PackedDataModule, SyntheticTask, build_char_tokenizer
from lightning_sloth.hf_model import find_hf_model
from lightning_sloth.plugins import GradientFlowError
from lightning_sloth.transform import transform_model


def _tiny_llama(vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


@pytest.fixture
def datamodule():
    tokenizer = build_char_tokenizer()
    return PackedDataModule(
        tokenizer, train=SyntheticTask(64, seed=1), val=SyntheticTask(16, seed=2), max_tokens=512
    )


def _trainer(tmp_path, **kwargs) -> Trainer:
    defaults = dict(
        plugins=[SlothPrecision("32-true")],
        max_steps=4,
        val_check_interval=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    return Trainer(**(defaults | kwargs))


def test_registered_name_trains_and_transforms_the_model(tmp_path, datamodule):
    seed_everything(0)
    module = CausalLMModule(_tiny_llama(100), lora=LoraSettings(r=4), optimizer=OptimizerSettings(lr=1e-2))
    trainer = _trainer(
        tmp_path,
        strategy="sloth",
        callbacks=[
            SlothThroughputMonitor(),
            GradientFlowGuard(every_n_steps=1),
            SaveAdapter(tmp_path / "adapter"),
        ],
    )
    trainer.fit(module, datamodule=datamodule)
    model = find_hf_model(module)
    assert isinstance(trainer.strategy, SlothStrategy)
    assert model.config._attn_implementation == "sloth"
    assert model.config.use_cache is False
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert trainer.global_step == 4
    metrics = trainer.callback_metrics
    assert {"train/loss", "val/loss", "val/token_acc", "val/exact_match"} <= set(metrics)
    assert torch.isfinite(metrics["val/loss"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and (tmp_path / "adapter" / "adapter_model.safetensors").exists()


class _MovedUnderInferenceMode(CausalLMModule):
    """Copies every batch as a move to an accelerator does: Lightning's validation moves batches
    inside ``torch.inference_mode``, so there they arrive as inference tensors (on a CPU ``.to``
    returns the same tensor, and the validation path never met one)."""

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        return batch._map_tensors(torch.Tensor.clone)


def test_validation_batches_moved_under_inference_mode_give_the_same_metrics(tmp_path, datamodule):
    results = []
    for module_class in (CausalLMModule, _MovedUnderInferenceMode):
        seed_everything(0)
        module = module_class(_tiny_llama(100), lora=LoraSettings(r=4))
        trainer = _trainer(tmp_path, strategy=SlothStrategy(kernels=True), limit_val_batches=2)
        results.append(trainer.validate(module, datamodule=datamodule, verbose=False)[0])
    assert results[0]["val/loss"] == pytest.approx(results[1]["val/loss"], rel=1e-6)
    assert results[0]["val/token_acc"] == results[1]["val/token_acc"]


def test_loss_decreases_on_a_fixed_batch(tmp_path, datamodule):
    """The plugins train: repeated steps on one packed batch drive its loss down."""
    seed_everything(0)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    module = CausalLMModule(_tiny_llama(100), lora=LoraSettings(r=8), optimizer=OptimizerSettings(lr=1e-2))

    class OneBatch(torch.utils.data.Dataset):
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            return batch

    loader = torch.utils.data.DataLoader(OneBatch(), batch_size=None)
    losses = []

    class Record(GradientFlowGuard):
        def on_train_batch_end(self, trainer, pl_module, outputs, *_):
            losses.append(float(outputs["loss"]))

    trainer = _trainer(tmp_path, strategy=SlothStrategy(), max_steps=12, callbacks=[Record()])
    trainer.fit(module, train_dataloaders=loader)
    assert losses[-1] < 0.9 * losses[0]


def test_gradient_flow_guard_stops_a_run_with_zero_gradients(tmp_path, datamodule):
    class Frozen(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _tiny_llama(100)
            self.scale = torch.nn.Parameter(torch.ones(()))

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch.model_inputs(), labels=batch.labels).loss
            return loss.detach() * self.scale * 0  # reaches the parameter with a zero gradient

        def configure_optimizers(self):
            return torch.optim.SGD([self.scale], lr=0.1)

    module = Frozen()
    module.model.requires_grad_(False)
    trainer = _trainer(
        tmp_path, strategy=SlothStrategy(), limit_val_batches=0, callbacks=[GradientFlowGuard()]
    )
    with pytest.raises(GradientFlowError, match="step 0: all 1 trainable gradients are zero"):
        trainer.fit(module, datamodule=datamodule)


def test_strategy_needs_a_transformers_model():
    with pytest.raises(TypeError, match="needs a transformers PreTrainedModel"):
        find_hf_model(torch.nn.Linear(2, 2))


def test_transform_model_validates_offload_settings():
    model = _tiny_llama(100)
    with pytest.raises(ValueError, match="offload must be"):
        transform_model(model, offload="sometimes")
    with pytest.raises(ValueError, match="offload needs gradient_checkpointing=True"):
        transform_model(model, offload="on", gradient_checkpointing=False)


def test_offload_on_cpu_matches_plain_checkpointing(datamodule):
    """offload='on' with a CPU stand-in device runs the offload bookkeeping; gradients are identical."""
    import copy

    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    torch.manual_seed(0)
    plain = _tiny_llama(100)
    offloaded = copy.deepcopy(plain)
    transform_model(plain)
    report = transform_model(offloaded, offload="on")
    report.offloader.min_offload_bytes = 0  # tiny model: offload every checkpointed input
    grads = []
    for model in (plain, offloaded):
        model.train()
        model(**batch.model_inputs(), labels=batch.labels).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert report.offloader.stats()["offloaded_bytes_per_step"] > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_float32_is_honoured(tmp_path, datamodule):
    module = CausalLMModule(_tiny_llama(100), lora=LoraSettings(r=4))
    trainer = _trainer(tmp_path, strategy=SlothStrategy(), max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=datamodule)
    assert all(p.dtype == torch.float32 for p in module.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_host_gap_defaults_give_the_earlier_defaults_step_bit_for_bit(family):
    """kernels=True today (GQA without the K/V copy, the residual add fused into the norm, each
    checkpointed layer one autograd node) gives the loss and gradients of the earlier default (K/V
    copied, add and norm unfused, torch's checkpoint) on a packed LoRA step, bit for bit (CPU float32:
    the packed attention runs SDPA here, so the fused norm and the checkpoint are what differ)."""
    import copy

    import _models

    from lightning_sloth.attention import set_varlen_kv_repeat

    make = _models.tiny_llama if family == "llama" else _models.tiny_qwen3
    master = _models.add_lora(make(), r=4).train()
    now, before = copy.deepcopy(master), copy.deepcopy(master)
    report = transform_model(now, kernels=True)
    assert report.kernels.counts["add_rms_norm"] > 0 and report.checkpointing.checkpoint_impl == "node"
    transform_model(before, kernels={"add_rms_norm": False}, checkpoint_impl="torch")
    batch = _models.packed_batch(_models.random_documents([37, 5, 60, 18], seed=3))

    def step(model, repeat):
        set_varlen_kv_repeat(repeat)
        try:
            model.zero_grad(set_to_none=True)
            loss = model(**batch.model_inputs(), labels=batch.labels).loss
            loss.backward()
        finally:
            set_varlen_kv_repeat(False)
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(now, False)
    want_loss, want = step(before, True)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want.keys() and grads
    for name in want:
        assert torch.equal(grads[name], want[name]), name
