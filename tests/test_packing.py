"""Best-fit-decreasing packer, overlong policies and the packed collator (CPU, plain torch)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from lightning_sloth.data import (
    IGNORE_INDEX,
    PackedBatch,
    PackedCollator,
    apply_overlong_policy,
    pack_best_fit_decreasing,
    packing_efficiency,
)

LOGGER = "lightning_sloth.data.packing"


def lognormal_lengths(n: int, max_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max(1, round(rng.lognormvariate(4.5, 0.8))), max_tokens) for _ in range(n)]


def sequential_packing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Naive next-fit in dataset order: the baseline BFD must beat."""
    bins, room = [], 0
    for i, length in enumerate(lengths):
        if length > room:
            bins.append([])
            room = max_tokens
        bins[-1].append(i)
        room -= length
    return bins


def random_samples(rng: random.Random, n: int, low: int, high: int) -> list[tuple[list[int], list[int]]]:
    samples = []
    for _ in range(n):
        length = rng.randint(low, high)
        ids = [rng.randrange(4, 100) for _ in range(length)]
        prompt = rng.randint(0, length - 1)
        samples.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return samples


# --- best-fit decreasing -----------------------------------------------------------------------


def test_bfd_hand_example():
    # Sorted: 6(i1) 5(i3) 4(i0) 4(i4) 3(i2) 2(i5) into bins of 10.
    # 6 -> new A(4 left); 5 -> new B(5); 4(i0) -> A (best fit, 0 left); 4(i4) -> B (1 left);
    # 3 -> new C(7); 2 -> C (5 left).
    assert pack_best_fit_decreasing([4, 6, 3, 5, 4, 2], 10) == [[1, 0], [3, 4], [2, 5]]


def test_bfd_breaks_ties_by_index():
    assert pack_best_fit_decreasing([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    # Two bins with equal room: the older one gets the sample.
    assert pack_best_fit_decreasing([5, 5, 1], 6) == [[0, 2], [1]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfd_invariants_on_random_lengths(seed):
    max_tokens = 512
    lengths = lognormal_lengths(2000, max_tokens, seed)
    bins = pack_best_fit_decreasing(lengths, max_tokens)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max_tokens for b in bins)
    assert pack_best_fit_decreasing(lengths, max_tokens) == bins
    assert len(bins) >= -(-sum(lengths) // max_tokens)  # never below the volume bound
    naive = sequential_packing(lengths, max_tokens)
    bfd_eff = packing_efficiency(bins, lengths, max_tokens)
    naive_eff = packing_efficiency(naive, lengths, max_tokens)
    assert bfd_eff > naive_eff + 0.05, (bfd_eff, naive_eff)
    assert bfd_eff > 0.97


def test_packing_efficiency_value():
    assert packing_efficiency([[0, 1], [2]], [3, 4, 5], 8) == pytest.approx(12 / 16)
    assert packing_efficiency([], [], 8) == 0.0


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "message"),
    [
        ([3, 9, 2], 8, r"sample 1 has length 9, outside \[1, max_tokens=8\]"),
        ([3, 0], 8, r"sample 1 has length 0"),
        ([1], 0, "max_tokens must be a positive int"),
    ],
)
def test_bfd_rejects_bad_lengths(lengths, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        pack_best_fit_decreasing(lengths, max_tokens)


# --- overlong policies -------------------------------------------------------------------------


def overlong_samples() -> list[tuple[list[int], list[int]]]:
    rng = random.Random(7)
    lengths = [5, 12, 8, 20, 3]
    samples = []
    for length in lengths:
        ids = [rng.randrange(4, 100) for _ in range(length)]
        samples.append((ids, [IGNORE_INDEX] * 2 + ids[2:]))
    return samples


def test_overlong_truncate_warns_once(caplog):
    samples = overlong_samples()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out, report = apply_overlong_policy(samples, 8)
    assert [len(ids) for ids, _ in out] == [5, 8, 8, 8, 3]
    assert out[1] == (samples[1][0][:8], samples[1][1][:8])
    assert (report.samples, report.tokens, report.extra_chunks) == (2, 4 + 12, 0)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [
        (
            logging.WARNING,
            "2 of 5 samples are longer than max_tokens=8; truncated them, dropping 16 tokens "
            "(raise max_tokens or use overlong='split' to keep them)",
        )
    ]


def test_overlong_split_keeps_every_token(caplog):
    samples = overlong_samples()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out, report = apply_overlong_policy(samples, 8, overlong="split")
    assert [len(ids) for ids, _ in out] == [5, 8, 4, 8, 8, 8, 4, 3]
    assert out[1][0] + out[2][0] == samples[1][0] and out[1][1] + out[2][1] == samples[1][1]
    assert out[4][0] + out[5][0] + out[6][0] == samples[3][0]
    assert (report.samples, report.tokens, report.extra_chunks) == (2, 16, 3)
    assert len(caplog.records) == 1 and "split them into 3 extra chunks" in caplog.records[0].getMessage()
    # The collator masks each chunk's first position, like any document start.
    batch = PackedCollator(16, 0, pad_to_multiple_of=1)([out[1], out[2]])
    assert batch.labels[0, 8].item() == IGNORE_INDEX and batch.position_ids[0, 8].item() == 0


def test_overlong_error_and_noop(caplog):
    samples = overlong_samples()
    with pytest.raises(
        ValueError, match=r"2 of 5 samples are longer than max_tokens=8 \(first: sample 1 with 12 tokens\)"
    ):
        apply_overlong_policy(samples, 8, overlong="error")
    with pytest.raises(ValueError, match="overlong must be 'truncate', 'split' or 'error'"):
        apply_overlong_policy(samples, 8, overlong="drop")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out, report = apply_overlong_policy(samples, 20, overlong="error")
    assert out == samples and report.samples == 0 and not caplog.records


# --- collator ----------------------------------------------------------------------------------


def test_collator_hand_example():
    samples = [
        ([11, 12, 13], [IGNORE_INDEX, 12, 13]),
        ([21, 22], [21, 22]),
        ([31, 32, 33, 34], [IGNORE_INDEX, IGNORE_INDEX, 33, 34]),
    ]
    batch = PackedCollator(max_tokens=16, pad_token_id=0, pad_to_multiple_of=4)(samples)
    assert isinstance(batch, PackedBatch)
    x = IGNORE_INDEX
    torch.testing.assert_close(batch.input_ids, torch.tensor([[11, 12, 13, 21, 22, 31, 32, 33, 34, 0, 0, 0]]))
    torch.testing.assert_close(batch.labels, torch.tensor([[x, 12, 13, x, 22, x, x, 33, 34, x, x, x]]))
    torch.testing.assert_close(batch.position_ids, torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]))
    torch.testing.assert_close(batch.cu_seqlens, torch.tensor([0, 3, 5, 9, 12], dtype=torch.int32))
    assert (batch.input_ids.dtype, batch.labels.dtype, batch.position_ids.dtype) == (torch.int64,) * 3
    assert batch.cu_seqlens.dtype == torch.int32
    assert (batch.max_seqlen, batch.num_tokens, batch.num_target_tokens, batch.capacity) == (4, 9, 5, 12)
    assert type(batch.max_seqlen) is int and batch.num_documents == 4
    assert samples[1][1] == [21, 22]  # inputs are not modified
    kwargs = batch.model_inputs()
    assert (
        kwargs["cu_seq_lens_q"] is batch.cu_seqlens
        and kwargs["max_length_k"] == 4
        and kwargs["use_cache"] is False
    )


def test_collator_padding_modes_and_buckets():
    samples = [([5] * 70, [5] * 70), ([6] * 30, [6] * 30)]
    multiple = PackedCollator(max_tokens=256, pad_token_id=0)(samples)
    assert multiple.capacity == 128 and multiple.cu_seqlens.tolist() == [0, 70, 100, 128]
    assert multiple.max_seqlen == 128  # 70 -> 128, capped at T = 128
    full = PackedCollator(max_tokens=256, pad_token_id=0, pad_to="max_tokens")(samples)
    assert full.capacity == 256 and full.cu_seqlens.tolist() == [0, 70, 100, 256]
    assert full.max_seqlen == 256  # the padding segment (156) is the longest
    exact = PackedCollator(max_tokens=256, pad_token_id=0, pad_to_multiple_of=50, seqlen_bucket="exact")(
        samples
    )
    assert exact.capacity == 100 and exact.cu_seqlens.tolist() == [0, 70, 100]  # no padding segment
    assert exact.max_seqlen == 70
    capped = PackedCollator(max_tokens=110, pad_token_id=0)(samples)
    assert capped.capacity == 110  # rounding to 128 would exceed the budget
    small = PackedCollator(max_tokens=256, pad_token_id=0, pad_to_multiple_of=1)(
        [([1] * 9, [1] * 9), ([2] * 3, [2] * 3)]
    )
    assert small.max_seqlen == 12  # 9 -> 16, capped at T = 12


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_collator_invariants_on_random_samples(seed):
    rng = random.Random(seed)
    max_tokens = 300
    collate = PackedCollator(max_tokens=max_tokens, pad_token_id=0, pad_to_multiple_of=64)
    samples = random_samples(rng, 40, 1, 60)
    lengths = [len(ids) for ids, _ in samples]
    for indices in pack_best_fit_decreasing(lengths, max_tokens):
        docs = [samples[i] for i in indices]
        batch = collate(docs)
        total = sum(len(ids) for ids, _ in docs)
        row = batch.capacity
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (1, row)
        assert row == min(-(-total // 64) * 64, max_tokens) and total <= row <= max_tokens
        cu = batch.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == row and all(a < b for a, b in zip(cu, cu[1:]))
        assert len(cu) == len(docs) + 1 + (row > total)
        for k, (ids, labels) in enumerate(docs):
            start, end = cu[k], cu[k + 1]
            assert batch.input_ids[0, start:end].tolist() == ids
            assert batch.labels[0, start:end].tolist() == [IGNORE_INDEX] + labels[1:]
            assert batch.position_ids[0, start:end].tolist() == list(range(end - start))
        assert (batch.labels[0, total:] == IGNORE_INDEX).all() and (batch.input_ids[0, total:] == 0).all()
        assert batch.num_tokens == total
        expected_targets = sum(sum(y != IGNORE_INDEX for y in labels[1:]) for _, labels in docs)
        assert batch.num_target_tokens == expected_targets
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        assert longest <= batch.max_seqlen <= row
        assert batch.max_seqlen == row or batch.max_seqlen & (batch.max_seqlen - 1) == 0


def test_collator_accepts_tensors():
    ids = torch.tensor([7, 8, 9])
    batch = PackedCollator(8, 0, pad_to_multiple_of=8)([(ids, ids.clone())])
    assert batch.input_ids[0, :3].tolist() == [7, 8, 9] and batch.labels[0, :3].tolist() == [
        IGNORE_INDEX,
        8,
        9,
    ]


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([], "PackedCollator got no samples"),
        ([([1] * 5, [1] * 5), ([2] * 4, [2] * 4)], "2 samples hold 9 tokens, over max_tokens=8"),
        ([([1, 2], [1])], r"sample 0: input_ids and labels must be non-empty 1-D and equal in length"),
        ([([1], [1]), ([], [])], "sample 1: input_ids and labels must be non-empty"),
    ],
)
def test_collator_rejects_bad_input(samples, message):
    with pytest.raises(ValueError, match=message):
        PackedCollator(8, 0)(samples)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive int"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be >= 1"),
        ({"pad_to": "longest"}, "pad_to must be 'multiple' or 'max_tokens'"),
        ({"seqlen_bucket": "log"}, "seqlen_bucket must be 'pow2' or 'exact'"),
    ],
)
def test_collator_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackedCollator(**{"max_tokens": 8, "pad_token_id": 0, **kwargs})
