"""Garbage collection: drop artifacts and shards that none of the latest N runs reached.

Each finished run records what it reached (`eagle3.store.runs`). The best promoted checkpoint under
each comparison key, its evaluation, its verifier and the draft it was exported from are kept
however old: they are what gets served, what `eagle3 promoted` lists and what a warm start
(`train.init_from=previous`) continues from. A flow holds a shared lock on `gc.lock` while it runs;
gc takes it exclusively, so it never deletes under a running flow (it refuses instead of waiting).
Unfinished work directories (`work/`) are kept: they are what a killed run resumes from; so is what
was published since the oldest kept run was recorded (a run is recorded when it finishes, so the
steps a killed run finished are in no record, and its re-run reuses them). Files
an extracting server left in `served-states/` (requests that timed out and were retried) go: with
no flow running, no run is waiting for them.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path

from eagle3.runtime.locks import exclusive_if_free, shared
from eagle3.store.artifacts import PUBLISHED, SERVED_STATES, ArtifactError, ArtifactStore
from eagle3.store.files import remove_tree
from eagle3.store.manifests import MANIFEST
from eagle3.store.promotions import promoted_checkpoints, promoted_drafts
from eagle3.store.runs import replay_file, run_records
from eagle3.store.verify import SHARD_DONE

__all__ = ["collect_garbage", "store_in_use"]

GC_LOCK = "gc.lock"


def store_in_use(store: ArtifactStore) -> AbstractContextManager[None]:
    """Held by a running flow: gc refuses to run meanwhile (and a flow waits for a running gc)."""
    return shared(store.root / GC_LOCK, "eagle3 artifacts gc to finish")


def _finished_at(path: Path, last_written: str) -> float:
    """When an artifact or shard was finished: the time of the file written last in it."""
    marker = path / last_written
    return (marker if marker.exists() else path).stat().st_mtime


def collect_garbage(store: ArtifactStore, keep_runs: int, dry_run: bool = False) -> dict[str, int]:
    """Delete what the latest `keep_runs` runs did not reach; returns counts and bytes freed.

    Raises:
        ArtifactError: a flow is running on the store, or no run has been recorded yet.
    """
    with exclusive_if_free(store.root / GC_LOCK, remove=False) as free:
        if not free:
            raise ArtifactError(store.root, "a flow is running on this store; run gc again when it has finished")
        records = run_records(store)
        if not records:
            raise ArtifactError(store.root, "no finished run is recorded; nothing is known to be live, so nothing is removed")
        live_artifacts: set[str] = set()
        live_shards: set[str] = set()
        since = records[-keep_runs:][0].stat().st_mtime  # a run killed since then is recorded nowhere, and resumes
        for record in records[-keep_runs:]:
            entry = json.loads(record.read_text())
            live_artifacts.update(entry["artifacts"])
            live_shards.update(entry["shards"])
        best_records = promoted_checkpoints(store)
        for best in best_records:  # and the verifier a served checkpoint names
            live_artifacts.update((best.checkpoint, best.evaluation, best.key.verifier))
        live_artifacts.update(promoted_drafts(store, best_records))  # what the next warm start continues from
        # A name starting with a dot is a removal a kill cut short (`remove_tree`), one ending in .partial a
        # killed extraction's shard: neither is ever live, and no flow runs while gc does.
        doomed = [
            p
            for p in (store.root / "artifacts").iterdir()
            if p.name.startswith(".") or (p.name not in live_artifacts and _finished_at(p, MANIFEST) <= since)
        ]
        shard_root = store.root / "shards"
        if shard_root.exists():
            doomed += [
                p
                for p in shard_root.iterdir()
                if p.name.startswith(".")
                or p.name.endswith(".partial")
                or (p.name not in live_shards and _finished_at(p, SHARD_DONE) <= since)
            ]
        served = store.root / SERVED_STATES
        orphans = [f for f in served.iterdir() if f.is_file()] if served.exists() else []
        freed = sum(f.stat().st_size for p in doomed for f in p.rglob("*") if f.is_file()) + sum(f.stat().st_size for f in orphans)
        if not dry_run:
            for path in doomed:
                remove_tree(path, "collected")
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
