"""Finished flow runs, recorded in the store as `runs/<time>-<run id>.json`.

A record names the run, the artifacts it was handed (the roots of its lineage) with the parents
the run handed on with each (`eagle3.store.lineage` says why a stored manifest's may differ), every
artifact those reach and the hidden-state shards they use. `eagle3 artifacts gc` keeps what the latest
runs reached; `eagle3 lineage <run id>` redraws a run's lineage from its roots, with no server.
Beside it, `<time>-<run id>.yaml` holds the run's whole resolved configuration:
`eagle3 run --config <it>` replays the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.files import atomic_write_text
from eagle3.store.lineage import find_artifact, lineage
from eagle3.store.manifests import ArtifactManifest

__all__ = ["lineage_roots", "record_run", "replay_file", "run_records", "run_roots"]


def record_run(store: ArtifactStore, run_id: str, handed: Sequence[ArtifactManifest], config: dict | None = None) -> Path:
    """Record what a finished run reached: the artifacts it was handed (its roots, with the parents
    they came with), their ancestors and their shards. A draft warm-started from an earlier one keeps that draft
    but not its ancestry (its data and hidden states), so a chain of scheduled retrainings does not
    keep every dataset it ever saw."""
    roots = run_roots(handed)
    nodes = lineage(store, list(roots), leaf_edges=frozenset({"init"}), parents=roots)
    artifacts = sorted(d for d, n in nodes.items() if n["kind"] != "input")
    shards = sorted(s["key"] for n in nodes.values() if n["kind"] == "hidden_states" for s in n["shards"])
    path = store.root / "runs" / f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{run_id}.json"
    path.parent.mkdir(exist_ok=True)
    record = {"run_id": run_id, "roots": list(roots), "parents": roots, "artifacts": artifacts, "shards": shards}
    if config is not None:  # written first: a record never lacks the replay file it names
        atomic_write_text(replay_file(path), yaml.safe_dump(config, sort_keys=False))
    atomic_write_text(path, json.dumps(record, indent=0))
    return path


def run_roots(handed: Sequence[ArtifactManifest]) -> dict[str, dict[str, str]]:
    """digest -> parents of each artifact a run was handed, as the run handed it on."""
    return {m.digest: m.parents for m in handed}


def replay_file(record: Path) -> Path:
    """The resolved configuration beside a run record (`eagle3 run --config` takes it)."""
    return record.with_suffix(".yaml")


def run_records(store: ArtifactStore) -> list[Path]:
    """Every run record, oldest first."""
    runs = store.root / "runs"
    return sorted(runs.glob("*.json")) if runs.exists() else []


def _find_run(store: ArtifactStore, prefix: str) -> dict | None:
    """The latest record of the one run whose id starts with `prefix`, or None if no run does."""
    matches: dict[str, dict] = {}
    for path in run_records(store):  # oldest first: a retried flow's latest record wins
        record = json.loads(path.read_text())
        if record["run_id"].startswith(prefix):
            matches[record["run_id"]] = record
    if len(matches) > 1:
        raise ArtifactError(store.root / "runs", f"run id prefix {prefix!r} matches {len(matches)} runs: {sorted(matches)}")
    return next(iter(matches.values()), None)


def lineage_roots(store: ArtifactStore, ref: str) -> tuple[list[str], str | None, dict[str, dict[str, str]]]:
    """The lineage roots for `ref` (a flow run id or an artifact digest, or a unique prefix of
    either), the run id when `ref` names a run, and the parents the run handed on with its roots
    (none for an artifact).

    Raises:
        ArtifactError: `ref` matches no run and no artifact, or more than one.
    """
    run = _find_run(store, ref)
    if run is None:
        return [find_artifact(store, ref)], None, {}
    if any(p.name.startswith(ref) for p in (store.root / "artifacts").iterdir()):
        raise ArtifactError(store.root, f"{ref!r} is the prefix of run {run['run_id']} and of an artifact digest; give more of it")
    # A record written before roots (or their parents) were kept: its artifacts reach the same artifacts.
    return run.get("roots", run["artifacts"]), run["run_id"], run.get("parents", {})
