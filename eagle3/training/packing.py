"""Which `train.total_seq_len` keeps every supervised token, read from speculators' batching.

speculators 0.9 batches records with `MultipackDistributedBatchSamplerV2`, which packs whole records
into batches of at most `total_seq_len` tokens (by `seq_len`), and `CollateFn`, which copies each
batch into a buffer of `total_seq_len` positions. A record longer than that is not dropped: the
sampler clips its length to `total_seq_len`, so it fills a batch alone, and the collate keeps its
first `total_seq_len` positions after `shift_batch` dropped the first token (original positions
1..total_seq_len). The rest is lost, and in a chat record the rest is the assistant's turn: its
supervised (`loss_mask == 1`) tokens. With `train.total_seq_len=16` every step had loss 0.0. Records
within `total_seq_len` lose nothing: the sampler never packs past the budget. So a value cuts
supervised tokens exactly when some record has one past that position, and the smallest value that
cuts none is the last supervised position over the dataset (`supervised_extent`).

Such a setting is refused before training (`check_total_seq_len`). The out-of-memory back-off
halves `total_seq_len` but never below that value (`LosslessBackoff`: it tries that value last, then
fails naming the record): dropping supervised tokens to fit memory would train on other data than
the dataset the manifest names, so lowering `dataset.max_seq_len` stays the user's decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.config import ConfigError, TrainConfig
from eagle3.data.prepare_dataset import DatasetManifest, load_dataset_table
from eagle3.runtime.attempts import BatchBackoff, OutOfMemory

__all__ = ["LosslessBackoff", "SupervisedExtent", "check_total_seq_len", "supervised_extent"]


@dataclass(frozen=True)
class SupervisedExtent:
    """Where the dataset's supervised tokens end, and what a given `total_seq_len` cuts of them."""

    tokens: int  # the smallest total_seq_len that cuts no supervised token
    record: int  # the record whose last supervised token sets it
    record_id: str
    seq_len: int  # that record's length
    num_records: int
    cut_tokens: int = 0  # supervised tokens the `total_seq_len` asked about cuts
    cut_records: int = 0  # records it cuts them from


def supervised_extent(dataset: DatasetManifest, total_seq_len: int | None = None) -> SupervisedExtent:
    """Where `dataset`'s supervised tokens end, and what `total_seq_len` (if given) cuts. Position 0
    is never a target (`shift_batch` drops it). Read a few thousand records at a time: a whole
    dataset's masks as numbers would take gigabytes."""
    import numpy as np
    import pyarrow.compute as pc

    table = load_dataset_table(dataset).select(["record_id", "loss_mask", "seq_len"])
    last = np.zeros(table.num_rows, dtype=np.int64)  # [records] last supervised position
    cut_tokens = cut_records = first = 0
    for batch in table.to_batches(max_chunksize=4096):
        mask = batch.column("loss_mask")
        offsets = np.concatenate([[0], np.cumsum(pc.list_value_length(mask).to_numpy(zero_copy_only=False))])
        supervised = np.flatnonzero(mask.flatten().to_numpy(zero_copy_only=False))
        records = np.searchsorted(offsets, supervised, side="right") - 1
        positions = supervised - offsets[records]
        ends = np.flatnonzero(np.diff(records, append=-1))  # each record's last supervised token (records ascend)
        last[first + records[ends]] = positions[ends]
        if total_seq_len is not None:
            lost = positions > total_seq_len
            cut_tokens += int(lost.sum())
            cut_records += int(np.unique(records[lost]).size)
        first += batch.num_rows
    record = int(np.argmax(last)) if table.num_rows else 0
    return SupervisedExtent(
        tokens=int(last.max(initial=0)),
        record=record,
        record_id=str(table.column("record_id")[record].as_py()) if table.num_rows else "",
        seq_len=int(table.column("seq_len")[record].as_py()) if table.num_rows else 0,
        num_records=table.num_rows,
        cut_tokens=cut_tokens,
        cut_records=cut_records,
    )


def _max_seq_len(dataset: DatasetManifest) -> str:
    value = (dataset.config.get("cfg") or {}).get("max_seq_len")
    return "dataset.max_seq_len" + (f" = {value}" if value is not None else "")


def check_total_seq_len(total_seq_len: int, dataset: DatasetManifest) -> SupervisedExtent:
    """The dataset's supervised extent, once `total_seq_len` is known to cut none of it.

    Raises:
        ConfigError: `total_seq_len` would cut supervised tokens (names the longest record and the fix).
    """
    extent = supervised_extent(dataset, total_seq_len)
    if extent.cut_tokens:
        raise ConfigError(
            f"train.total_seq_len = {total_seq_len} would cut {extent.cut_tokens} supervised tokens from {extent.cut_records} of "
            f"{extent.num_records} records of dataset {dataset.path}: speculators packs records into batches of "
            "train.total_seq_len tokens and cuts a longer record's tail, its assistant turn. The longest supervised record, "
            f"record {extent.record} ('{extent.record_id}', "
            f"{extent.seq_len} tokens, supervised up to position {extent.tokens}), was kept that long by {_max_seq_len(dataset)}. "
            f"Set train.total_seq_len to at least {extent.tokens}, or dataset.max_seq_len to at most {total_seq_len + 1}."
        )
    return extent


class LosslessBackoff(BatchBackoff):
    """The out-of-memory back-off on `train.total_seq_len`, floored where supervised tokens would be cut:
    it halves down to `train.min_total_seq_len` or the dataset's supervised extent, whichever is
    larger, trying that floor itself last."""

    def __init__(self, cfg: TrainConfig, extent: SupervisedExtent, dataset: DatasetManifest, kept: str, log: Path | None = None):
        if extent.tokens > cfg.min_total_seq_len:
            floor_setting = f"the longest record's last supervised position (record {extent.record}, '{extent.record_id}')"
            kept += (
                f" Below {extent.tokens} tokens that record would lose supervised tokens: lower {_max_seq_len(dataset)}, "
                "or train on a device with more memory."
            )
        else:
            floor_setting = "train.min_total_seq_len"
        super().__init__("train.total_seq_len", cfg.total_seq_len, floor_setting, max(cfg.min_total_seq_len, extent.tokens), kept, log)

    def after(self, oom: OutOfMemory) -> int:
        if self.minimum < self.value < 2 * self.minimum:  # half would cut: try the floor itself once
            return self._retry_with(self.minimum, oom)
        return super().after(oom)
