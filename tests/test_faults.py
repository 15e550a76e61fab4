"""Faults that lose nothing: a step whose loss or gradients are not finite is skipped (the
optimizer and the schedule not advanced) and counted, too many in a row stop the run naming the
batch's documents; an out-of-memory step explains what would fit; a full disk during a save
leaves the previous checkpoint loadable and stops the run naming the path and the error; the
memory plan leaves room for the longest step."""

import os
import sys
from pathlib import Path

import _processes
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_export import run_app
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sloth.data import PackedCollator, build_char_tokenizer
from lightning_sloth.module import CausalLMModule, LoraSettings, OptimizerSettings
from lightning_sloth.plugins.callbacks import (
    GradientFlowGuard,
    LongestStepHeadroom,
    NonFiniteStepError,
    StepOutOfMemoryError,
)
from lightning_sloth.plugins.checkpoint import AtomicCheckpointIO, load_checkpoint_file

TOKENIZER = build_char_tokenizer()
POISON = TOKENIZER.convert_tokens_to_ids("~")  # its embedding row is set to NaN: a crafted batch


def batch(text: str):
    ids = TOKENIZER.encode(text)
    return PackedCollator(max_tokens=64, pad_token_id=0)([(ids, ids)])


def fit(kinds: str, guard: GradientFlowGuard, tmp_path: Path):
    """Train one step per letter of ``kinds``: ``g`` a good batch, ``n`` one that contains the
    poisoned token. Returns (module, trainer, parameters before the first step)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    module = CausalLMModule(
        model, lora=LoraSettings(r=4, alpha=8), optimizer=OptimizerSettings(lr=1e-2, warmup_steps=2)
    )
    texts = {"g": "reverse: abc\ncba", "n": "upper: ~q~\n~Q~"}
    batches = [batch(texts[k]) for k in kinds]
    trainer = Trainer(
        accelerator="cpu",
        max_steps=len(kinds),
        callbacks=[guard, ModelCheckpoint(tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)],
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return module, trainer, before


def test_non_finite_steps_are_skipped_and_counted(tmp_path):
    guard = GradientFlowGuard(every_n_steps=100, max_nonfinite_steps=2, tokenizer=TOKENIZER)
    module, trainer, _ = fit("gnngng", guard, tmp_path)
    assert guard.skipped_steps == 3 and trainer.global_step == 6
    assert trainer.callback_metrics["train/skipped_steps"] == 3
    optimizer = trainer.optimizers[0]
    # Three real updates: AdamW's step count and the schedule advanced only on the good batches.
    assert {int(optimizer.state[p]["step"]) for p in optimizer.state} == {3}
    (scheduler,) = trainer.lr_scheduler_configs
    assert scheduler.scheduler.last_epoch == 3
    assert all(torch.isfinite(p).all() for p in module.parameters() if p.requires_grad)


def test_a_skipped_step_changes_nothing(tmp_path):
    guard = GradientFlowGuard(every_n_steps=100, max_nonfinite_steps=1)
    module, trainer, before = fit("n", guard, tmp_path)
    after = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not trainer.optimizers[0].state and trainer.lr_scheduler_configs[0].scheduler.last_epoch == 0


def test_too_many_in_a_row_stop_naming_the_documents(tmp_path):
    guard = GradientFlowGuard(every_n_steps=100, max_nonfinite_steps=2, tokenizer=TOKENIZER)
    with pytest.raises(
        NonFiniteStepError, match=r"(?s)step 3: .*3 steps in a row.*document 0: 15 tokens, '.*upper: ~q~"
    ):
        fit("gnnng", guard, tmp_path)
    assert guard.skipped_steps == 2
    saved = load_checkpoint_file(tmp_path / "last.ckpt")  # the checkpoint of step 3, written before it
    assert saved["global_step"] == 3
    assert all(torch.isfinite(v).all() for k, v in saved["state_dict"].items() if "lora" in k)


# A few steps of a small random Llama, a checkpoint every 2 steps.
APP = [
    "model=tiny_llama",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "data.num_train=32",
    "data.num_val=4",
    "data.max_tokens=128",
    "trainer=cpu_debug",
    "trainer.max_steps=6",
    "trainer.val_check_interval=6",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.samples=0",
    "trainer.enable_progress_bar=false",
]


def test_out_of_memory_names_the_step_and_what_fits(tmp_path, monkeypatch):
    step = CausalLMModule.training_step

    def allocator_fails_at_step_3(self, batch, batch_idx):
        if self.trainer.global_step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return step(self, batch, batch_idx)

    monkeypatch.setattr(CausalLMModule, "training_step", allocator_fails_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(StepOutOfMemoryError) as error:
        run_app(out, APP)
    message = str(error.value)
    assert "out of memory in training step 3 (" in message and "real tokens in a 128-token row" in message
    for hint in (
        "sloth.offload=on",
        "sloth.memory_budget=auto",
        "data.max_tokens=64",
        "precision.quantize=nf4",
    ):
        assert hint in message
    assert f"The last checkpoint, {out / 'checkpoints' / 'last.ckpt'}, is intact" in message
    assert load_checkpoint_file(out / "checkpoints" / "last.ckpt")["global_step"] == 2


FULL_DISK = """
import os, sys
from pathlib import Path
from lightning_sloth.plugins import checkpoint
sys.path.insert(0, {tests!r})
from test_export import run_app

out, mode = Path(sys.argv[1]), sys.argv[2]
save, saves = checkpoint.AtomicCheckpointIO.save_checkpoint, []

def save_then_fill_the_disk(self, state, path, storage_options=None):
    saves.append(path)
    if len(saves) == 2 and mode == "inject":  # no tmpfs to fill: the write fails as on a full disk
        checkpoint.torch.save = lambda obj, handle: (handle.write(b"x" * 4096), os.write(-1, b""))
    save(self, state, path, storage_options)
    if len(saves) == 1 and mode == "tmpfs":  # another process fills the disk after the first save
        with open(out.parent / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\\0" * 65536)
            except OSError:
                pass
        os.truncate(out.parent / "filler", os.path.getsize(out.parent / "filler") - 16384)

checkpoint.AtomicCheckpointIO.save_checkpoint = save_then_fill_the_disk
try:
    run_app(out, {overrides!r})
finally:  # inside the namespace, where the tmpfs is
    step = checkpoint.load_checkpoint_file(out / "checkpoints" / "last.ckpt")["global_step"]
    print("previous checkpoint loads, step", step, flush=True)
"""


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_path(tmp_path):
    """The output directory on a small tmpfs (a mount namespace of its own) that fills up after
    the first checkpoint; where mount namespaces are not allowed, the write fails by injection."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    code = FULL_DISK.format(tests=str(Path(__file__).parent), overrides=[*APP, "trainer.max_steps=4"])
    script = tmp_path / "child.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mount = f"mount -t tmpfs -o size=64m tmpfs {disk} && exec {sys.executable} {script} {out} tmpfs"
    tmpfs = _processes.run(["unshare", "-rm", "true"], timeout=60).returncode == 0
    command = (
        ["unshare", "-rm", "sh", "-c", mount] if tmpfs else [sys.executable, str(script), str(out), "inject"]
    )
    result = _processes.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    last = out / "checkpoints" / "last.ckpt"
    assert "CheckpointWriteError" in result.stderr, result.stderr[-3000:]
    if tmpfs:
        assert f"could not write the checkpoint {last}: No space left on device" in result.stderr
    assert "the previous checkpoint there is intact" in result.stderr
    assert "previous checkpoint loads, step 2" in result.stdout


def test_the_memory_plan_is_made_for_the_longest_step():
    class Layers:
        memory_budget, budget_bytes, activation_bytes = "auto", 1000, [1, 2]
        planned = None

        def replan(self, budget):
            self.planned = budget

    class Report:
        checkpointing = Layers()

    class Strategy:
        sloth_report = Report()

    class FakeTrainer:
        strategy, datamodule = Strategy(), None

    class Batch:
        capacity = 256

    headroom = LongestStepHeadroom(max_tokens=1024)
    headroom.on_train_batch_end(FakeTrainer(), None, None, Batch(), 0)
    assert Report.checkpointing.planned == 250 and headroom.done
    Report.checkpointing.planned = None
    headroom.on_train_batch_end(FakeTrainer(), None, None, Batch(), 1)  # once only
    assert Report.checkpointing.planned is None
