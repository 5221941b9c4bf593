"""Where an interrupted training resumes, and what is cleared first so that speculators' Trainer
resumes exactly there.

speculators' Trainer resumes from the highest-numbered directory under `checkpoints/` (an epoch's
weights, optimizer and scheduler state, then `training_state.json`, written last), and its epoch
loop runs training, the checkpoint, then validation. What a kill can leave, and what happens to it:

- an epoch checkpoint cut short (killed, or the disk filled, while it was written: no readable
  `training_state.json`, or weights that do not open): removed, so the run resumes from the one before;
- an epoch checkpoint whose validation never finished: an epoch counts only once its validation
  record is in `metrics.jsonl`, so the re-run validates that checkpoint first (`validate_epoch`)
  instead of reporting the previous epoch's figures (or none, with one epoch);
- speculators' `interrupted/` checkpoint, written on SIGTERM mid-epoch: discarded, not renamed as
  speculators advises. It records no step position, and the signal may have landed between the
  optimizer and scheduler steps, so the run redoes the epoch from the last epoch checkpoint;
- records in `metrics.jsonl` after the resume point (a partial epoch) and torn last lines of either
  log: dropped, so the published log is the one an uninterrupted run writes.

Checkpoints are float32 (`trainer_compat.ExactResumeTrainer`), so a resumed run's draft is the
uninterrupted run's, byte for byte on CPU. Older epoch checkpoints go once a later epoch is
validated (`drop_checkpoints_before`), but the best validated one, which the draft ships where it
beats the last (`eagle3.training.epochs`): float32 doubles their size.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from eagle3.training.epochs import best_epoch, epoch_summaries
from eagle3.training.metrics_log import read_log, rewrite_log

__all__ = ["ResumePoint", "drop_checkpoints_before", "prepare_resume", "resume_point"]

logger = logging.getLogger(__name__)
INTERRUPTED = "interrupted"  # speculators' checkpoint on SIGINT/SIGTERM


@dataclass(frozen=True)
class ResumePoint:
    epoch: int  # the epoch checkpoint training continues from; -1: from the start
    validated: bool  # its validation is recorded

    @property
    def finished_epochs(self) -> int:
        return self.epoch + self.validated


def _whole(epoch_dir: Path) -> bool:
    """The epoch checkpoint was written to the end: its last file reads, its weights open."""
    try:
        state = json.loads((epoch_dir / "training_state.json").read_text())
        with safe_open(epoch_dir / "model.safetensors", "pt"):
            pass
    except (OSError, ValueError, SafetensorError):
        return False
    return (
        isinstance(state, dict)
        and state.get("epoch") == int(epoch_dir.name)
        and state.get("local_step", 0) == 0
        and (epoch_dir / "optimizer_state_dict.pt").is_file()
    )


def _epoch_dirs(checkpoints: Path) -> list[int]:
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink())


def resume_point(checkpoints: Path, records: list[dict]) -> ResumePoint:
    """The last whole epoch checkpoint all of whose earlier epochs have a validation record."""
    validated = {r["epoch"] for r in records if "val" in r}
    for epoch in reversed(_epoch_dirs(checkpoints)):
        if set(range(epoch)) <= validated and _whole(checkpoints / str(epoch)):
            return ResumePoint(epoch, epoch in validated)
    return ResumePoint(-1, True)


def _remove_entry(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def drop_checkpoints_before(checkpoints: Path, epoch: int, keep: int | None = None) -> None:
    """Remove the epoch checkpoints before `epoch` (whose own checkpoint is whole and validated), but
    `keep`'s (the best so far, which the draft may ship), and the links speculators keeps to them."""
    for entry in list(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        target = entry.readlink().name if entry.is_symlink() else entry.name
        if target.isdigit() and int(target) < epoch and int(target) != keep:
            _remove_entry(entry)


def prepare_resume(checkpoints: Path, metrics_log: Path, timing_log: Path, ttt_steps: int) -> ResumePoint:
    """Leave under `checkpoints` only the resume point's checkpoint and the best validated one before
    it (which the draft may ship), and in the logs only what led to the resume point (readable lines,
    and metrics of the epochs up to it); returns the resume point."""
    records = read_log(metrics_log)
    point = resume_point(checkpoints, records)
    best = best_epoch([e for e in epoch_summaries(records, ttt_steps) if e["epoch"] < point.epoch])
    keep = {str(point.epoch)} | ({str(best)} if best is not None and _whole(checkpoints / str(best)) else set())
    for entry in list(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        target = entry.readlink().name if entry.is_symlink() else entry.name
        if target in keep and entry.name != INTERRUPTED:
            continue
        if entry.name == INTERRUPTED:
            logger.warning(
                "%s: discarding speculators' checkpoint of an interrupted epoch (it records no step position); "
                "training resumes from the end of epoch %d",
                entry,
                point.epoch,
            )
        elif entry.is_dir() and not entry.is_symlink():
            logger.warning(
                "%s: discarding an epoch checkpoint cut short or past the last validated epoch; training resumes from the end of epoch %d",
                entry,
                point.epoch,
            )
        _remove_entry(entry)
    rewrite_log(metrics_log, lambda record: record.get("epoch", -1) <= point.epoch)
    rewrite_log(timing_log)
    return point
