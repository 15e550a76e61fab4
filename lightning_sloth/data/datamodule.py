"""``PackedDataModule``: records in, one :class:`PackedBatch` per step out.

``setup()`` tokenizes every source once (lists of ints, cheap) and handles overlong samples;
nothing else is materialized. Each epoch the :class:`PackedBatchSampler` shuffles the sample
order, packs the lengths with best-fit decreasing, and yields one bin of indices per step; the
DataLoader's :class:`PackedCollator` then builds the batch tensors for that bin only.

Resuming mid-epoch: the training loader is a :class:`ResumableDataLoader`. Lightning saves its
``state_dict`` (epoch and batches consumed by training steps) in every checkpoint and loads it
before creating the resumed epoch's iterator, which then skips the consumed bins of the same
packing: the resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_sloth.data.batch import IGNORE_INDEX
from lightning_sloth.data.packing import (
    OverlongPolicy,
    PackedCollator,
    Sample,
    apply_overlong_policy,
    pack_best_fit_decreasing,
    packing_efficiency,
)
from lightning_sloth.data.sources import BadRecordPolicy, iter_records, tokenize_records
from lightning_sloth.data.tokenizer import build_char_tokenizer

logger = logging.getLogger(__name__)


class _EpochCounter:
    """Holds the epoch where Lightning looks for it: ``dataloader.batch_sampler.sampler.set_epoch``."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def _replicas(sampler: Any) -> tuple[int, int]:
    """``(num_replicas, rank)``: from an injected ``DistributedSampler``, else the process group."""
    if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
        return sampler.num_replicas, sampler.rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class PackedBatchSampler(BatchSampler):
    """Yields one packed bin of sample indices per batch, repacked every epoch.

    For epoch ``e`` the sample order is shuffled with a generator seeded by ``(seed, e)``, the
    lengths are packed in that order with best-fit decreasing (so equal-length samples trade
    places between bins), and the bins are shuffled. Without ``shuffle`` the packing is the
    same every epoch. The epoch comes from ``set_epoch``, which Lightning calls every epoch on
    ``batch_sampler.sampler``.

    With several processes, rank ``r`` of ``R`` takes bins ``r, r + R, ...``, the list first
    wrapped around to a multiple of ``R`` so every rank runs the same number of steps. ``R`` and
    ``r`` come from the ``DistributedSampler`` Lightning injects as ``sampler`` (it subclasses
    ``BatchSampler`` so Lightning can), else from ``torch.distributed`` when initialized.

    Args:
        sampler: epoch holder; ``None`` for a private one (Lightning may pass a ``DistributedSampler``).
        lengths: token count of every sample, each in ``[1, max_tokens]``.
        max_tokens: token budget of one batch.
        shuffle: reshuffle and repack every epoch.
        seed: base seed of the shuffles.
    """

    def __init__(
        self,
        sampler: Any = None,
        *,
        lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        # BatchSampler.__init__ is skipped on purpose: batches here have no fixed size.
        self.sampler = _EpochCounter() if sampler is None else sampler
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        #: bins of the current epoch skipped by the next iteration (set when resuming mid-epoch).
        self.skip = 0
        self._cached: tuple[tuple[int, int, int], list[list[int]]] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next iteration packs for (0 until ``set_epoch`` is called)."""
        return getattr(self.sampler, "epoch", 0)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose packing the next iteration yields."""
        self.sampler.set_epoch(epoch)

    def _bins(self) -> list[list[int]]:
        num_replicas, rank = _replicas(self.sampler)
        key = (self.epoch if self.shuffle else 0, num_replicas, rank)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        order = list(range(len(self.lengths)))
        rng = random.Random(f"packing:{self.seed}:{key[0]}")
        if self.shuffle:
            rng.shuffle(order)
        bins = pack_best_fit_decreasing([self.lengths[i] for i in order], self.max_tokens)
        bins = [[order[j] for j in b] for b in bins]
        if self.shuffle:
            rng.shuffle(bins)
        if num_replicas > 1 and bins:
            total = math.ceil(len(bins) / num_replicas) * num_replicas
            bins = [bins[i % len(bins)] for i in range(total)][rank::num_replicas]
        self._cached = (key, bins)
        return bins

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        return iter(self._bins()[skip:])

    def __len__(self) -> int:
        return len(self._bins())


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`PackedBatchSampler` that can resume mid-epoch.

    Lightning treats a loader with ``state_dict``/``load_state_dict`` as stateful: it stores the
    state in every checkpoint and loads it before creating the resumed epoch's iterator. The
    state is ``{"epoch", "consumed"}``: ``consumed`` counts the batches training steps took this
    epoch (:class:`PackedDataModule` counts them as they reach the device, so batches Lightning
    prefetched but did not train on are not counted). After ``load_state_dict`` the next
    iteration packs the saved epoch and skips its first ``consumed`` bins (their samples are
    never collated). ``len()`` stays the whole epoch, as Lightning's progress counters expect.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self._resume_at = 0
        self._resume_epoch: int | None = None

    def __iter__(self):
        # The skip belongs to the saved epoch only: a checkpoint taken at an epoch's last batch
        # resumes in the next epoch (Lightning sets it on the sampler), which starts from its first bin.
        same_epoch = self._resume_epoch is None or self._resume_epoch == self.batch_sampler.epoch
        self.consumed = self._resume_at if same_epoch else 0
        self._resume_at, self._resume_epoch = 0, None
        self.batch_sampler.skip = self.consumed
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": packing epoch, "consumed": batches trained on in it}``."""
        return {"epoch": self.batch_sampler.epoch, "consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Make the next iteration continue the saved epoch after its consumed batches."""
        self.batch_sampler.set_epoch(state_dict["epoch"])
        self._resume_at, self._resume_epoch = state_dict["consumed"], state_dict["epoch"]


class _TokenizedSamples(Dataset):
    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


@dataclass(frozen=True)
class PackingStats:
    """What ``setup()`` made of one split.

    Attributes:
        records: records read from the source.
        skipped: malformed records dropped (``on_bad_record="skip"``).
        samples: samples after the overlong policy (split chunks count separately).
        tokens: real tokens over all samples.
        target_tokens: tokens that carry a loss (document starts excluded).
        bins: batches per epoch (per process before sharding).
        efficiency: ``tokens / (bins * max_tokens)``.
        truncated: samples cut to ``max_tokens`` (``overlong="truncate"``).
        split: samples cut into chunks (``overlong="split"``).
        overlong_tokens: tokens beyond ``max_tokens`` in those samples (dropped or moved).
    """

    records: int
    skipped: int
    samples: int
    tokens: int
    target_tokens: int
    bins: int
    efficiency: float
    truncated: int
    split: int
    overlong_tokens: int


def _resolve_tokenizer(
    tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None,
) -> PreTrainedTokenizerBase:
    if tokenizer is None:
        return build_char_tokenizer()
    if isinstance(tokenizer, str | os.PathLike):
        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


class PackedDataModule(L.LightningDataModule):
    """Tokenize, pack and batch training and validation records.

    Args:
        tokenizer: a Hugging Face tokenizer, a local path or hub name for
            ``AutoTokenizer.from_pretrained``, or ``None`` for :func:`build_char_tokenizer`.
        train: training source: a :class:`SyntheticTask`, a ``.jsonl`` path, a list of record
            dicts or a ``datasets.Dataset``.
        val: validation source (same kinds), or ``None`` for no validation.
        max_tokens: token budget of one packed batch (its ``[1, T]`` row has ``T <= max_tokens``).
        overlong: ``"truncate"`` | ``"split"`` | ``"error"`` for samples over ``max_tokens``.
        on_bad_record: ``"error"`` | ``"skip"`` for malformed records.
        num_workers: DataLoader workers (collation is cheap; 0 is usually enough).
        seed: base seed of the per-epoch shuffles.
        pad_to_multiple_of: row length is rounded up to this multiple (capped at ``max_tokens``).
        pad_to: ``"multiple"`` or ``"max_tokens"`` (always pad the row to the full budget).
        shuffle: reshuffle and repack the training split every epoch.
        segments_bucket: ``"exact"`` or ``"pow2"`` (``cu_seqlens`` padded with empty segments to
            a power-of-two length; with ``pad_to="max_tokens"`` the static shapes CUDA graphs need).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None = None,
        train: Any = None,
        val: Any = None,
        *,
        max_tokens: int = 2048,
        overlong: OverlongPolicy = "truncate",
        on_bad_record: BadRecordPolicy = "error",
        num_workers: int = 0,
        seed: int = 0,
        pad_to_multiple_of: int = 64,
        pad_to: Literal["multiple", "max_tokens"] = "multiple",
        shuffle: bool = True,
        segments_bucket: Literal["pow2", "exact"] = "exact",
    ) -> None:
        super().__init__()
        if train is None:
            raise ValueError("PackedDataModule needs a train source")
        if overlong not in ("truncate", "split", "error"):
            raise ValueError(f"overlong must be 'truncate', 'split' or 'error', got {overlong!r}")
        if on_bad_record not in ("error", "skip"):
            raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
        self._tokenizer = _resolve_tokenizer(tokenizer)
        self._sources = {"train": train, "val": val}
        self.max_tokens = max_tokens
        self.overlong = overlong
        self.on_bad_record = on_bad_record
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.collator = PackedCollator(
            max_tokens,
            self.pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_to=pad_to,
            segments_bucket=segments_bucket,
        )
        self.packing_stats: dict[str, PackingStats] = {}
        self._samples: dict[str, list[Sample]] = {}
        self._lengths: dict[str, list[int]] = {}

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer every split is encoded with."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (size a model's embedding with this)."""
        return len(self._tokenizer)

    @property
    def pad_token_id(self) -> int:
        """Id written into padding (its labels are -100, so any valid id works; falls back to eos, then 0)."""
        for token_id in (self._tokenizer.pad_token_id, self._tokenizer.eos_token_id):
            if token_id is not None:
                return token_id
        return 0

    def setup(self, stage: str | None = None) -> None:
        """Tokenize and pack-plan every split not prepared yet; logs each split's stats once."""
        for split, source in self._sources.items():
            if source is not None and split not in self._samples:
                self._prepare(split, source)

    def _prepare(self, split: str, source: Any) -> None:
        samples, skipped = tokenize_records(
            iter_records(source), self._tokenizer, on_bad_record=self.on_bad_record
        )
        if not samples:
            raise ValueError(f"the {split} source has no usable records")
        records = len(samples) + skipped
        samples, report = apply_overlong_policy(samples, self.max_tokens, self.overlong)
        lengths = [len(ids) for ids, _ in samples]
        bins = pack_best_fit_decreasing(lengths, self.max_tokens)
        stats = PackingStats(
            records=records,
            skipped=skipped,
            samples=len(samples),
            tokens=sum(lengths),
            target_tokens=sum(sum(label != IGNORE_INDEX for label in labels[1:]) for _, labels in samples),
            bins=len(bins),
            efficiency=packing_efficiency(bins, lengths, self.max_tokens),
            truncated=report.samples if self.overlong == "truncate" else 0,
            split=report.samples if self.overlong == "split" else 0,
            overlong_tokens=report.tokens,
        )
        self._samples[split], self._lengths[split], self.packing_stats[split] = samples, lengths, stats
        logger.info(
            "%s data: %d records (%d skipped) -> %d samples, %d tokens (%d targets) in %d batches of "
            "max_tokens=%d, packing efficiency %.1f%% (%d truncated, %d split)",
            split,
            stats.records,
            stats.skipped,
            stats.samples,
            stats.tokens,
            stats.target_tokens,
            stats.bins,
            self.max_tokens,
            100 * stats.efficiency,
            stats.truncated,
            stats.split,
        )

    def _dataloader(self, split: str, shuffle: bool) -> DataLoader:
        if split not in self._samples:
            self.setup()
        batch_sampler = PackedBatchSampler(
            lengths=self._lengths[split], max_tokens=self.max_tokens, shuffle=shuffle, seed=self.seed
        )
        if self.trainer is not None:
            batch_sampler.set_epoch(self.trainer.current_epoch)
        loader_class = ResumableDataLoader if split == "train" else DataLoader
        return loader_class(
            _TokenizedSamples(self._samples[split]),
            batch_sampler=batch_sampler,
            collate_fn=self.collator,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """One :class:`PackedBatch` per step; reshuffled and repacked every epoch."""
        return self._dataloader("train", shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in a fixed packing (an empty list when there is no val source)."""
        if self._sources["val"] is None:
            return []
        return self._dataloader("val", shuffle=False)

    def validation_examples(self, count: int) -> list[tuple[list[int], list[int]]]:
        """``(prompt_ids, response_ids)`` of ``count`` validation samples spread evenly over the split.

        The prompt is every token before the sample's first target (``bos`` included), the response
        the first run of target tokens without its closing ``eos``: what a greedy decode of the
        prompt should produce. Empty without a validation source.
        """
        if self._sources["val"] is None:
            return []
        if "val" not in self._samples:
            self.setup()
        samples = self._samples["val"]
        count = min(count, len(samples))
        examples = []
        for index in (i * len(samples) // count for i in range(count)):
            ids, labels = samples[index]
            start = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
            if start is None or start == 0:
                continue
            end = start
            while end < len(labels) and labels[end] != IGNORE_INDEX:
                end += 1
            response = list(ids[start:end])
            if response and response[-1] == self._tokenizer.eos_token_id:
                response.pop()
            examples.append((list(ids[:start]), response))
        return examples

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count a training batch as consumed once it reaches the device (see :class:`ResumableDataLoader`)."""
        trainer = self.trainer
        if trainer is not None and trainer.training:
            loader = trainer.train_dataloader
            if isinstance(loader, ResumableDataLoader):
                loader.consumed += 1
        return batch

    def _fingerprint(self) -> str | None:
        lengths = self._lengths.get("train")
        if lengths is None:
            return None
        return hashlib.sha256(array("q", lengths).tobytes()).hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """Seed and a fingerprint of the training lengths, saved in Lightning checkpoints."""
        return {
            "seed": self.seed,
            "train_fingerprint": self._fingerprint(),
            "stats": {k: asdict(v) for k, v in self.packing_stats.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the checkpoint's shuffle stream; warn if the training data changed since."""
        self.seed = state_dict["seed"]
        saved, current = state_dict.get("train_fingerprint"), self._fingerprint()
        if saved is not None and current is not None and saved != current:
            logger.warning(
                "the training data differs from the checkpoint's (length fingerprint %s != %s); "
                "the resumed epoch order will not match the original run",
                current,
                saved,
            )
