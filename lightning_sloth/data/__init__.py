"""Data room: sources, tokenization, packing and the ``PackedDataModule``. Nothing here touches the GPU."""

from lightning_sloth.data.batch import IGNORE_INDEX, PackedBatch, host_cu_seqlens, inputs_to_device
from lightning_sloth.data.datamodule import (
    PackedBatchSampler,
    PackedDataModule,
    PackingStats,
    ResumableDataLoader,
)
from lightning_sloth.data.packing import (
    OverlongReport,
    PackedCollator,
    apply_overlong_policy,
    pack_best_fit_decreasing,
    packing_efficiency,
)
from lightning_sloth.data.sources import (
    SYNTHETIC_TASKS,
    SyntheticTask,
    hf_dataset_records,
    iter_records,
    read_jsonl,
    tokenize_record,
    tokenize_records,
)
from lightning_sloth.data.tokenizer import build_char_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "SYNTHETIC_TASKS",
    "OverlongReport",
    "PackedBatch",
    "host_cu_seqlens",
    "inputs_to_device",
    "PackedBatchSampler",
    "PackedCollator",
    "PackedDataModule",
    "PackingStats",
    "ResumableDataLoader",
    "SyntheticTask",
    "apply_overlong_policy",
    "build_char_tokenizer",
    "hf_dataset_records",
    "iter_records",
    "pack_best_fit_decreasing",
    "packing_efficiency",
    "read_jsonl",
    "tokenize_record",
    "tokenize_records",
]
