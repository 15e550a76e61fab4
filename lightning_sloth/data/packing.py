"""Packing: which samples share a row (best-fit decreasing), and the collator that builds the row.

Packing works on lengths only: :func:`pack_best_fit_decreasing` returns bins of sample indices,
and :class:`PackedCollator` turns the samples of one bin into a :class:`PackedBatch`. Samples
longer than the budget are handled first by :func:`apply_overlong_policy`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_sloth.data.batch import IGNORE_INDEX, PackedBatch

logger = logging.getLogger(__name__)

Sample = tuple[list[int], list[int]]
OverlongPolicy = Literal["truncate", "split", "error"]


def _check_budget(max_tokens: int) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")


def pack_best_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack samples into as few bins of ``max_tokens`` as best-fit decreasing finds.

    Samples are taken longest first (ties: lower index first); each goes into the open bin
    with the least room that still fits it (ties: the older bin), or opens a new bin. The
    result depends only on ``lengths`` and ``max_tokens``. ``O(n log n)`` search.

    Args:
        lengths: token count of every sample, each in ``[1, max_tokens]``.
        max_tokens: capacity of one bin.

    Returns:
        Bins in the order they were opened; each is a list of sample indices, longest first.
        Every index appears exactly once.

    Raises:
        ValueError: a length is not in ``[1, max_tokens]``.
    """
    _check_budget(max_tokens)
    for index, length in enumerate(lengths):
        if not 1 <= length <= max_tokens:
            raise ValueError(f"sample {index} has length {length}, outside [1, max_tokens={max_tokens}]")
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin id), kept sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        slot = bisect.bisect_left(open_bins, (length, -1))
        if slot == len(open_bins):
            bins.append([index])
            room, bin_id = max_tokens - length, len(bins) - 1
        else:
            room, bin_id = open_bins.pop(slot)
            bins[bin_id].append(index)
            room -= length
        if room > 0:
            bisect.insort(open_bins, (room, bin_id))
    return bins


def packing_efficiency(bins: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int) -> float:
    """Fraction of the bins' capacity filled with real tokens (0.0 for no bins)."""
    if not bins:
        return 0.0
    used = sum(lengths[i] for b in bins for i in b)
    return used / (len(bins) * max_tokens)


@dataclass(frozen=True)
class OverlongReport:
    """What :func:`apply_overlong_policy` did.

    Attributes:
        samples: number of samples longer than ``max_tokens``.
        tokens: tokens beyond ``max_tokens`` in those samples (dropped by ``"truncate"``, moved to
            continuation chunks by ``"split"``).
        extra_chunks: continuation chunks added by ``"split"`` (0 otherwise).
    """

    samples: int = 0
    tokens: int = 0
    extra_chunks: int = 0


def apply_overlong_policy(
    samples: Sequence[Sample], max_tokens: int, overlong: OverlongPolicy = "truncate"
) -> tuple[list[Sample], OverlongReport]:
    """Make every sample fit in ``max_tokens``.

    ``"truncate"`` keeps each sample's first ``max_tokens`` tokens and logs one warning with the
    counts; ``"split"`` cuts it into consecutive ``max_tokens`` chunks (each chunk is then its
    own document: its first label is masked like any document start) and logs the counts at
    info level; ``"error"`` raises.

    Args:
        samples: ``(input_ids, labels)`` pairs of equal-length int lists.
        max_tokens: the token budget of one packed row.
        overlong: the policy.

    Returns:
        ``(samples, report)``; samples keep their order, chunks of a split sample stay adjacent.

    Raises:
        ValueError: a sample is too long under ``"error"``, or the policy is unknown.
    """
    _check_budget(max_tokens)
    if overlong not in ("truncate", "split", "error"):
        raise ValueError(f"overlong must be 'truncate', 'split' or 'error', got {overlong!r}")
    long_ones = [i for i, (ids, _) in enumerate(samples) if len(ids) > max_tokens]
    if not long_ones:
        return list(samples), OverlongReport()
    excess = sum(len(samples[i][0]) - max_tokens for i in long_ones)
    first = long_ones[0]
    if overlong == "error":
        raise ValueError(
            f"{len(long_ones)} of {len(samples)} samples are longer than max_tokens={max_tokens} "
            f"(first: sample {first} with {len(samples[first][0])} tokens); raise max_tokens or "
            "use overlong='truncate' or 'split'"
        )
    out: list[Sample] = []
    extra = 0
    for ids, labels in samples:
        if len(ids) <= max_tokens:
            out.append((ids, labels))
        elif overlong == "truncate":
            out.append((ids[:max_tokens], labels[:max_tokens]))
        else:
            chunks = [
                (ids[s : s + max_tokens], labels[s : s + max_tokens]) for s in range(0, len(ids), max_tokens)
            ]
            out.extend(chunks)
            extra += len(chunks) - 1
    if overlong == "truncate":
        logger.warning(
            "%d of %d samples are longer than max_tokens=%d; truncated them, dropping %d tokens "
            "(raise max_tokens or use overlong='split' to keep them)",
            len(long_ones),
            len(samples),
            max_tokens,
            excess,
        )
    else:
        logger.info(
            "%d of %d samples are longer than max_tokens=%d; split them into %d extra chunks (%d tokens moved)",
            len(long_ones),
            len(samples),
            max_tokens,
            extra,
            excess,
        )
    return out, OverlongReport(samples=len(long_ones), tokens=excess, extra_chunks=extra)


class PackedCollator:
    """Build a :class:`PackedBatch` from the samples of one bin (on the host, plain torch).

    Documents are laid end to end; ``labels`` is ``-100`` at every document's first position
    (on top of the sample's own ``-100`` prompt labels), ``position_ids`` restart at 0 per
    document, and the row is padded with ``pad_token_id`` as one trailing segment::

        samples     ([a0 a1 a2], [-100 a1 a2]), ([b0 b1], [b0 b1])
        input_ids   [a0 a1 a2 b0 b1 p p p]        (pad_to_multiple_of=8)
        labels      [-100 a1 a2 -100 b1 -100 -100 -100]
        position_ids[0 1 2 0 1 0 1 2]
        cu_seqlens  [0 3 5 8]                     int32

    Args:
        max_tokens: the budget; a bin's total length must not exceed it.
        pad_token_id: id written into padding positions.
        pad_to_multiple_of: with ``pad_to="multiple"``, the row length is the total rounded up
            to this multiple, capped at ``max_tokens``.
        pad_to: ``"multiple"`` (few distinct shapes, little padding) or ``"max_tokens"`` (one
            fixed shape, e.g. for ``torch.compile`` with static shapes).
        seqlen_bucket: ``"pow2"`` rounds ``max_seqlen`` up to a power of two (capped at the
            row length) so compiled code sees few distinct values; ``"exact"`` keeps it exact.
        segments_bucket: ``"pow2"`` appends empty segments (repeated ``T`` at the end of
            ``cu_seqlens``) up to a power-of-two segment count, so ``cu_seqlens`` takes few shapes
            (with ``pad_to="max_tokens"``, what CUDA graphs of the layers need); ``"exact"`` (the
            default) adds none. Attention skips empty segments; they hold no tokens.
    """

    def __init__(
        self,
        max_tokens: int,
        pad_token_id: int,
        pad_to_multiple_of: int = 64,
        pad_to: Literal["multiple", "max_tokens"] = "multiple",
        seqlen_bucket: Literal["pow2", "exact"] = "pow2",
        segments_bucket: Literal["pow2", "exact"] = "exact",
    ) -> None:
        _check_budget(max_tokens)
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if pad_to not in ("multiple", "max_tokens"):
            raise ValueError(f"pad_to must be 'multiple' or 'max_tokens', got {pad_to!r}")
        if seqlen_bucket not in ("pow2", "exact"):
            raise ValueError(f"seqlen_bucket must be 'pow2' or 'exact', got {seqlen_bucket!r}")
        if segments_bucket not in ("pow2", "exact"):
            raise ValueError(f"segments_bucket must be 'pow2' or 'exact', got {segments_bucket!r}")
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to = pad_to
        self.seqlen_bucket = seqlen_bucket
        self.segments_bucket = segments_bucket

    def padded_length(self, num_tokens: int) -> int:
        """Row length ``T`` for ``num_tokens`` real tokens."""
        if self.pad_to == "max_tokens":
            return self.max_tokens
        multiple = self.pad_to_multiple_of
        return min(-(-num_tokens // multiple) * multiple, self.max_tokens)

    def bucket_seqlen(self, longest: int, row_length: int) -> int:
        """``max_seqlen`` reported for a longest segment of ``longest`` tokens."""
        if self.seqlen_bucket == "exact":
            return longest
        return min(1 << (longest - 1).bit_length(), row_length)

    def __call__(
        self, samples: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]]
    ) -> PackedBatch:
        """Pack ``samples`` (``(input_ids, labels)`` pairs, 1-D, equal lengths >= 1) into one row."""
        if not samples:
            raise ValueError("PackedCollator got no samples")
        ids = [torch.as_tensor(s[0], dtype=torch.long) for s in samples]
        labels = [torch.as_tensor(s[1], dtype=torch.long) for s in samples]
        for i, (x, y) in enumerate(zip(ids, labels)):
            if x.ndim != 1 or x.numel() == 0 or x.shape != y.shape:
                raise ValueError(
                    f"sample {i}: input_ids and labels must be non-empty 1-D and equal in length, "
                    f"got shapes {tuple(x.shape)} and {tuple(y.shape)}"
                )
        lengths = [x.numel() for x in ids]
        num_tokens = sum(lengths)
        sum_sq_seqlens = sum(n * n for n in lengths)
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"{len(samples)} samples hold {num_tokens} tokens, over max_tokens={self.max_tokens}"
            )
        row_length = self.padded_length(num_tokens)
        padding = row_length - num_tokens
        if padding:
            ids.append(torch.full((padding,), self.pad_token_id, dtype=torch.long))
            labels.append(torch.full((padding,), IGNORE_INDEX, dtype=torch.long))
            lengths.append(padding)

        segment_lengths = torch.tensor(lengths, dtype=torch.long)
        cu_seqlens = torch.nn.functional.pad(segment_lengths.cumsum(0), (1, 0))
        starts = cu_seqlens[:-1]
        empty = 0
        if self.segments_bucket == "pow2":
            empty = (1 << (len(lengths) - 1).bit_length()) - len(lengths)
            cu_seqlens = torch.nn.functional.pad(cu_seqlens, (0, empty), value=row_length)
        label_row = torch.cat(labels)
        label_row[starts] = IGNORE_INDEX  # no target crosses into a document from the one before
        position_ids = torch.arange(row_length) - torch.repeat_interleave(starts, segment_lengths)
        return PackedBatch(
            input_ids=torch.cat(ids).unsqueeze(0),
            labels=label_row.unsqueeze(0),
            position_ids=position_ids.unsqueeze(0),
            cu_seqlens=cu_seqlens.to(torch.int32),
            max_seqlen=self.bucket_seqlen(max(lengths), row_length),
            num_tokens=num_tokens,
            num_target_tokens=int((label_row != IGNORE_INDEX).sum()),
            capacity=row_length,
            sum_sq_seqlens=sum_sq_seqlens,
            empty_segments=empty,
        )
