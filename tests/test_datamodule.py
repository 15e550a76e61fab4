"""PackedDataModule and PackedBatchSampler (CPU, no models)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_sloth.data import (
    IGNORE_INDEX,
    PackedBatch,
    PackedBatchSampler,
    PackedDataModule,
    SyntheticTask,
    build_char_tokenizer,
    pack_best_fit_decreasing,
)

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def make_dm(tok, train=None, val=None, **kwargs) -> PackedDataModule:
    train = SyntheticTask(400, seed=1) if train is None else train
    dm = PackedDataModule(tok, train, val, max_tokens=MAX_TOKENS, seed=11, **kwargs)
    dm.setup("fit")
    return dm


def epoch_batches(dm: PackedDataModule, epoch: int) -> tuple[list[list[int]], list[PackedBatch]]:
    loader = dm.train_dataloader()
    loader.batch_sampler.set_epoch(epoch)
    return list(loader.batch_sampler), list(loader)


def test_one_epoch_covers_every_sample_once(tok):
    dm = make_dm(tok)
    samples = dm._samples["train"]
    bins, batches = epoch_batches(dm, 0)
    assert sorted(i for b in bins for i in b) == list(range(400))
    assert len(batches) == len(bins) == dm.packing_stats["train"].bins
    for indices, batch in zip(bins, batches):
        assert isinstance(batch, PackedBatch)
        assert batch.capacity <= MAX_TOKENS and batch.input_ids.shape == (1, batch.capacity)
        assert batch.num_tokens == sum(len(samples[i][0]) for i in indices)
        cu = batch.cu_seqlens.tolist()
        for k, i in enumerate(indices):
            assert batch.input_ids[0, cu[k] : cu[k + 1]].tolist() == samples[i][0]
    assert sum(b.num_tokens for b in batches) == dm.packing_stats["train"].tokens
    assert sum(b.num_target_tokens for b in batches) == dm.packing_stats["train"].target_tokens


def test_epochs_shuffle_differently_but_deterministically(tok):
    dm, twin = make_dm(tok), make_dm(tok)
    bins0, batches0 = epoch_batches(dm, 0)
    bins1, _ = epoch_batches(dm, 1)
    assert bins0 != bins1
    assert sorted(map(sorted, bins0)) != sorted(map(sorted, bins1))  # repacked, not only reordered
    assert sorted(i for b in bins1 for i in b) == list(range(400))
    assert epoch_batches(twin, 1)[0] == bins1
    again_bins, again_batches = epoch_batches(dm, 0)
    assert again_bins == bins0
    for a, b in zip(batches0, again_batches):
        torch.testing.assert_close(a.input_ids, b.input_ids)
        torch.testing.assert_close(a.labels, b.labels)
    other_seed = PackedDataModule(tok, SyntheticTask(400, seed=1), max_tokens=MAX_TOKENS, seed=12)
    other_seed.setup()
    assert epoch_batches(other_seed, 0)[0] != bins0


def test_validation_packing_is_fixed(tok):
    dm = make_dm(tok, val=SyntheticTask(60, seed=2))
    first, second = dm.val_dataloader(), dm.val_dataloader()
    second.batch_sampler.set_epoch(5)
    assert list(first.batch_sampler) == list(second.batch_sampler)
    assert list(first.batch_sampler) == pack_best_fit_decreasing(dm._lengths["val"], MAX_TOKENS)
    assert make_dm(tok).val_dataloader() == []


def test_unshuffled_training_equals_plain_bfd(tok):
    dm = make_dm(tok, shuffle=False)
    expected = pack_best_fit_decreasing(dm._lengths["train"], MAX_TOKENS)
    assert epoch_batches(dm, 0)[0] == expected == epoch_batches(dm, 3)[0]


def test_packing_stats_are_logged_once(tok, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_sloth.data.datamodule"):
        dm = make_dm(tok, val=SyntheticTask(50, seed=2))
        dm.setup("validate")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("train data: 400 records (0 skipped) -> 400 samples")
    stats = dm.packing_stats["train"]
    lengths = dm._lengths["train"]
    assert stats.tokens == sum(lengths) and stats.samples == 400 and stats.records == 400
    assert stats.efficiency == pytest.approx(sum(lengths) / (stats.bins * MAX_TOKENS))
    assert stats.efficiency > 0.95 and (stats.truncated, stats.split, stats.overlong_tokens) == (0, 0, 0)


def test_sources_of_every_kind(tok, tmp_path):
    records = list(SyntheticTask(30, seed=3))
    path = tmp_path / "train.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": r["prompt"], "response": r["response"]}) for r in records)
    )
    reference = make_dm(tok, train=SyntheticTask(30, seed=3))._samples["train"]
    assert make_dm(tok, train=path)._samples["train"] == reference
    assert make_dm(tok, train=str(path))._samples["train"] == reference
    assert make_dm(tok, train=records)._samples["train"] == reference
    datasets = pytest.importorskip("datasets")
    assert make_dm(tok, train=datasets.Dataset.from_list(records))._samples["train"] == reference


def test_overlong_and_bad_record_policies(tok):
    long_record = {"prompt": "p" * 150, "response": "r" * 100}
    records = [long_record, {"prompt": "a", "response": ""}, {"prompt": "b", "response": "c"}]
    with pytest.raises(ValueError, match="record 1: 'response' is empty"):
        make_dm(tok, train=records)
    truncated = make_dm(tok, train=records, on_bad_record="skip")
    stats = truncated.packing_stats["train"]
    assert (stats.records, stats.skipped, stats.samples, stats.truncated, stats.split) == (3, 1, 2, 1, 0)
    assert stats.overlong_tokens == 252 - MAX_TOKENS  # bos + 150 + 100 + eos
    split = make_dm(tok, train=records, on_bad_record="skip", overlong="split")
    stats = split.packing_stats["train"]
    assert (stats.samples, stats.truncated, stats.split, stats.tokens) == (3, 0, 1, 252 + 4)
    batches = list(split.train_dataloader())
    assert all(b.capacity <= MAX_TOKENS for b in batches)
    with pytest.raises(ValueError, match="longer than max_tokens=128"):
        make_dm(tok, train=records, on_bad_record="skip", overlong="error")
    with pytest.raises(ValueError, match="the train source has no usable records"):
        make_dm(tok, train=[{"prompt": "a"}], on_bad_record="skip")


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="needs a train source"):
        PackedDataModule(tok)
    with pytest.raises(ValueError, match="overlong must be"):
        PackedDataModule(tok, [], overlong="cut")
    with pytest.raises(ValueError, match="on_bad_record must be"):
        PackedDataModule(tok, [], on_bad_record="warn")


def test_tokenizer_access_and_loader_settings(tok, tmp_path):
    dm = make_dm(tok)
    assert dm.tokenizer is tok and dm.vocab_size == 100 and dm.pad_token_id == tok.pad_token_id
    default = PackedDataModule(train=SyntheticTask(5))
    assert default.tokenizer.get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    assert PackedDataModule(str(tmp_path), SyntheticTask(5)).tokenizer.encode("abc") == tok.encode("abc")
    loader = dm.train_dataloader()
    assert loader.pin_memory == torch.cuda.is_available()
    assert batch_padding_uses_pad_id(next(iter(loader)), tok.pad_token_id)


def batch_padding_uses_pad_id(batch: PackedBatch, pad_id: int) -> bool:
    padding = batch.input_ids[0, batch.num_tokens :]
    return bool((padding == pad_id).all() and (batch.labels[0, batch.num_tokens :] == IGNORE_INDEX).all())


def test_worker_processes_give_the_same_batches(tok):
    dm, workers = (
        make_dm(tok, train=SyntheticTask(80, seed=4)),
        make_dm(tok, train=SyntheticTask(80, seed=4), num_workers=1),
    )
    for a, b in zip(dm.train_dataloader(), workers.train_dataloader(), strict=True):
        torch.testing.assert_close(a.input_ids, b.input_ids)
        torch.testing.assert_close(a.cu_seqlens, b.cu_seqlens)


def test_sampler_shards_bins_across_ranks():
    lengths = [(7 * i) % 50 + 1 for i in range(101)]
    shards = []
    for rank in range(3):
        sampler = DistributedSampler(range(len(lengths)), num_replicas=3, rank=rank, shuffle=False)
        batch_sampler = PackedBatchSampler(sampler, lengths=lengths, max_tokens=64, seed=3)
        batch_sampler.set_epoch(2)
        shards.append(list(batch_sampler))
    assert len({len(s) for s in shards}) == 1  # same step count on every rank
    all_bins = pack_best_fit_decreasing(lengths, 64)
    assert sum(len(s) for s in shards) - len(all_bins) < 3  # at most R - 1 bins repeated
    assert sorted({i for s in shards for b in s for i in b}) == list(range(len(lengths)))


def test_lightning_injects_a_distributed_sampler(tok):
    """The path Lightning takes under DDP: re-create our batch sampler around a DistributedSampler."""
    from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
    from lightning.pytorch.utilities.data import _update_dataloader

    dm = make_dm(tok)
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = dm.train_dataloader()
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=True)
        sharded = _update_dataloader(loader, sampler)
        assert (
            isinstance(sharded.batch_sampler, PackedBatchSampler) and sharded.batch_sampler.sampler is sampler
        )
        _set_sampler_epoch(sharded, 4)
        assert sharded.batch_sampler.epoch == 4
        seen.append(list(sharded.batch_sampler))
    assert len(seen[0]) == len(seen[1])
    assert {i for bins in seen for b in bins for i in b} == set(range(400))


def test_state_dict_round_trip(tok, caplog):
    dm = make_dm(tok)
    state = dm.state_dict()
    assert state["seed"] == 11 and state["stats"]["train"]["samples"] == 400
    resumed = PackedDataModule(tok, SyntheticTask(400, seed=1), max_tokens=MAX_TOKENS, seed=99)
    resumed.setup()
    with caplog.at_level(logging.WARNING, logger="lightning_sloth.data.datamodule"):
        resumed.load_state_dict(state)
    assert resumed.seed == 11 and not caplog.records
    assert epoch_batches(resumed, 2)[0] == epoch_batches(dm, 2)[0]
    changed = make_dm(tok, train=SyntheticTask(300, seed=1))
    with caplog.at_level(logging.WARNING, logger="lightning_sloth.data.datamodule"):
        changed.load_state_dict(state)
    assert "the training data differs from the checkpoint's" in caplog.records[-1].getMessage()


def test_a_checkpoint_at_an_epochs_last_batch_resumes_the_next_epoch_from_its_start(tok):
    """The loader's skip belongs to the saved epoch: resumed in that epoch it skips the consumed
    bins; moved on to the next epoch (a checkpoint at the epoch's last batch) it starts at bin 0."""
    dm = make_dm(tok)
    full = [b.input_ids for b in epoch_batches(dm, 4)[1]]
    saved = {"epoch": 3, "consumed": len(full)}  # the whole of epoch 3
    loader = dm.train_dataloader()
    loader.load_state_dict(saved)
    loader.batch_sampler.set_epoch(4)  # what Lightning does when the next epoch starts
    resumed = [b.input_ids for b in loader]
    assert len(resumed) == len(full) and all(torch.equal(a, b) for a, b in zip(resumed, full))
    loader.load_state_dict({"epoch": 4, "consumed": 2})  # mid-epoch: the same epoch skips its first bins
    assert [b.input_ids.shape for b in loader] == [b.shape for b in full[2:]]
    assert loader.state_dict() == {"epoch": 4, "consumed": 2}
