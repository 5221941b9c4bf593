"""Garbage collection: drop artifacts and shards that none of the latest N runs reached.

Each finished run records what it reached (`eagle3/runs.py`). The best promoted checkpoint under
each comparison key, its evaluation and its verifier are kept however old: they are what gets
served and what `eagle3 promoted` lists. A flow holds a shared lock on `gc.lock` while it runs;
gc takes it exclusively, so it never deletes under a running flow (it refuses instead of waiting).
Unfinished work directories (`work/`) are kept: they are what a killed run resumes from. Files
an extracting server left in `served-states/` (requests that timed out and were retried) go: with
no flow running, no run is waiting for them.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from eagle3.promotion import promoted_checkpoints
from eagle3.runs import replay_file, run_records
from eagle3.store import PUBLISHED, SERVED_STATES, ArtifactError, ArtifactStore

__all__ = ["collect_garbage", "store_in_use"]


@contextmanager
def _lock(store: ArtifactStore, mode: int) -> Iterator[None]:
    with open(store.root / "gc.lock", "a") as f:
        try:
            fcntl.flock(f, mode)
        except BlockingIOError as exc:
            raise ArtifactError(store.root, "a flow is running on this store; run gc again when it has finished") from exc
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def store_in_use(store: ArtifactStore):
    """Held by a running flow: gc refuses to run meanwhile."""
    return _lock(store, fcntl.LOCK_SH)


def collect_garbage(store: ArtifactStore, keep_runs: int, dry_run: bool = False) -> dict[str, int]:
    """Delete what the latest `keep_runs` runs did not reach; returns counts and bytes freed.

    Raises:
        ArtifactError: a flow is running on the store, or no run has been recorded yet.
    """
    with _lock(store, fcntl.LOCK_EX | fcntl.LOCK_NB):
        records = run_records(store)
        if not records:
            raise ArtifactError(store.root, "no finished run is recorded; nothing is known to be live, so nothing is removed")
        live_artifacts: set[str] = set()
        live_shards: set[str] = set()
        for record in records[-keep_runs:]:
            entry = json.loads(record.read_text())
            live_artifacts.update(entry["artifacts"])
            live_shards.update(entry["shards"])
        for best in promoted_checkpoints(store):  # and the verifier a served checkpoint names
            live_artifacts.update((best.checkpoint, best.evaluation, best.key.verifier))
        doomed = [p for p in (store.root / "artifacts").iterdir() if p.name not in live_artifacts]
        shard_root = store.root / "shards"
        if shard_root.exists():
            doomed += [p for p in shard_root.iterdir() if p.name not in live_shards and not p.name.endswith(".partial")]
        served = store.root / SERVED_STATES
        orphans = [f for f in served.iterdir() if f.is_file()] if served.exists() else []
        freed = sum(f.stat().st_size for p in doomed for f in p.rglob("*") if f.is_file()) + sum(f.stat().st_size for f in orphans)
        if not dry_run:
            for path in doomed:
                shutil.rmtree(path)
            for orphan in orphans:
                orphan.unlink(missing_ok=True)
            published = store.root / PUBLISHED
            for pointer in published.glob("[!.]*") if published.exists() else ():  # not a write in progress
                if not store.artifact_dir(pointer.read_text()).exists():
                    pointer.unlink()
            for record in records[:-keep_runs]:
                record.unlink()
                replay_file(record).unlink(missing_ok=True)
        return {"removed": len(doomed) + len(orphans), "bytes": freed, "runs_kept": min(keep_runs, len(records))}
