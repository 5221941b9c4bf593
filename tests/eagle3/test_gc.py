from __future__ import annotations

import os

import pytest
from conftest import publish_evaluation, publish_text_artifact

from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.gc import collect_garbage, store_in_use
from eagle3.store.runs import record_run


def test_gc_removes_only_what_the_kept_runs_did_not_reach(tmp_path):
    store = ArtifactStore(tmp_path)
    dataset = publish_text_artifact(store, "dataset", "shared", {"source": "f" * 64})
    old = publish_text_artifact(store, "draft", "old", {"dataset": dataset.digest}, config={"lr": 1e-3})
    new = publish_text_artifact(store, "draft", "new", {"dataset": dataset.digest}, config={"lr": 3e-4})
    assert sorted(p.read_text() for p in (store.root / "published").iterdir()) == sorted([dataset.digest, old.digest, new.digest])
    record_run(store, "run-1", [old], {"train": {"lr": 1e-3}})
    kept = record_run(store, "run-2", [new], {"train": {"lr": 3e-4}})

    result = collect_garbage(store, keep_runs=1)

    assert result["removed"] == 1
    assert not old.path.exists()
    assert new.path.exists() and dataset.path.exists()
    # What a step reuses by provenance points only at artifacts still there.
    assert sorted(p.read_text() for p in (store.root / "published").iterdir()) == sorted([dataset.digest, new.digest])
    assert sorted((store.root / "runs").iterdir()) == [kept, kept.with_suffix(".yaml")]  # a run's record and its replay file go together


def test_gc_keeps_what_a_run_killed_since_the_oldest_kept_run_published_until_a_later_run_passes_it(tmp_path):
    """A run is recorded when it finishes: a killed one's finished steps are in no record, and its
    re-run reuses them."""
    store = ArtifactStore(tmp_path)
    served = publish_text_artifact(store, "draft", "served", {})
    record_run(store, "run-1", [served])
    killed = publish_text_artifact(store, "hidden_states", "extracted, then the run was killed", {})

    collect_garbage(store, keep_runs=1)
    assert killed.path.exists()

    record_run(store, "run-2", [served])  # a later run that did not reuse them
    collect_garbage(store, keep_runs=1)
    assert not killed.path.exists() and served.path.exists()


def test_gc_removes_states_files_an_extracting_server_left_behind(tmp_path):
    store = ArtifactStore(tmp_path)
    record_run(store, "run-1", [publish_text_artifact(store, "draft", "kept", {})])
    left = tmp_path / "served-states"
    left.mkdir()
    (left / "cmpl-1.safetensors").write_bytes(b"x" * 100)
    (left / "cmpl-1.safetensors.lock").write_bytes(b"")

    assert collect_garbage(store, keep_runs=1, dry_run=True) == {"removed": 2, "bytes": 100, "runs_kept": 1}
    assert collect_garbage(store, keep_runs=1) == {"removed": 2, "bytes": 100, "runs_kept": 1}
    assert list(left.iterdir()) == []


def test_gc_removes_what_killed_extractions_and_killed_removals_left(tmp_path):
    """A resumed run extracts a shard afresh, so a `.partial` directory of a key no run asks for
    again (records appended, other aux layers) would otherwise stay for good; so would a directory
    a removal renamed away (`remove_tree`) and was killed before deleting."""
    store = ArtifactStore(tmp_path)
    record_run(store, "run-1", [publish_text_artifact(store, "draft", "kept", {})])
    shards = tmp_path / "shards"
    finished, partial, half_removed = shards / ("a" * 64), shards / f"{'b' * 64}.partial", shards / f".{'c' * 64}.collected-99"
    half_removed_artifact = tmp_path / "artifacts" / f".{'d' * 64}.damaged-98"
    for left in (finished, partial, half_removed, half_removed_artifact):  # all since the kept run: a finished shard is kept
        left.mkdir(parents=True)
        (left / "hs_0.safetensors").write_bytes(b"x" * 100)
    (finished / "done.json").write_text('{"sha256": {}}')

    assert collect_garbage(store, keep_runs=1) == {"removed": 3, "bytes": 300, "runs_kept": 1}
    assert finished.exists() and not partial.exists() and not half_removed.exists() and not half_removed_artifact.exists()
    assert [p.name for p in shards.iterdir()] == ["a" * 64]  # gc's own removals leave nothing behind


def test_gc_removes_the_finished_shards_no_kept_run_reached(tmp_path):
    store = ArtifactStore(tmp_path)
    unreached = tmp_path / "shards" / ("e" * 64)
    unreached.mkdir(parents=True)
    (unreached / "hs_0.safetensors").write_bytes(b"x" * 100)
    (unreached / "done.json").write_text('{"sha256": {}}')  # finished before the kept run
    os.utime(unreached / "done.json", (1, 1))
    record_run(store, "run-1", [publish_text_artifact(store, "draft", "kept", {})])

    assert collect_garbage(store, keep_runs=1) == {"removed": 1, "bytes": 114, "runs_kept": 1}
    assert not unreached.exists()


def test_gc_dry_run_removes_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    old = publish_text_artifact(store, "draft", "old", {})
    record_run(store, "run-1", [publish_text_artifact(store, "draft", "new", {})])

    assert collect_garbage(store, keep_runs=1, dry_run=True)["removed"] == 1
    assert old.path.exists()


def test_gc_refuses_while_a_flow_uses_the_store(tmp_path):
    store = ArtifactStore(tmp_path)
    record_run(store, "run-1", [publish_text_artifact(store, "draft", "x", {})])

    with store_in_use(store), pytest.raises(ArtifactError, match="a flow is running on this store"):
        collect_garbage(store, keep_runs=1)


def test_gc_without_any_recorded_run_removes_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    kept = publish_text_artifact(store, "draft", "x", {})

    with pytest.raises(ArtifactError, match="no finished run is recorded"):
        collect_garbage(store, keep_runs=1)
    assert kept.path.exists()


def test_gc_keeps_the_draft_a_kept_run_warm_started_from_but_not_its_ancestry(tmp_path):
    store = ArtifactStore(tmp_path)
    old_data = publish_text_artifact(store, "dataset", "week 1", {})
    old_draft = publish_text_artifact(store, "draft", "week 1 draft", {"dataset": old_data.digest})
    new_data = publish_text_artifact(store, "dataset", "week 2", {})
    new_draft = publish_text_artifact(store, "draft", "week 2 draft", {"dataset": new_data.digest, "init": old_draft.digest})
    record_run(store, "run-1", [old_draft])
    record_run(store, "run-2", [new_draft])

    collect_garbage(store, keep_runs=1)

    assert new_draft.path.exists() and new_data.path.exists() and old_draft.path.exists()
    assert not old_data.path.exists()


def test_gc_keeps_the_best_promoted_checkpoint_its_evaluation_verifier_and_draft_however_old(tmp_path):
    from eagle3.config import PromotionConfig
    from eagle3.evaluation.promotion import promote

    store = ArtifactStore(tmp_path)
    old_verifier = publish_text_artifact(store, "verifier", "dequantized last month", {})
    served, worse = (publish_text_artifact(store, "draft", name, {}) for name in ("served draft", "worse draft"))
    best = publish_evaluation(store, "best", {3: 2.0}, verifier=old_verifier.digest, draft=served.digest)
    unpromoted = publish_evaluation(store, "worse", {3: 1.5}, verifier=old_verifier.digest, draft=worse.digest)
    other = publish_evaluation(store, "other verifier", {3: 1.7})
    for run, evaluation in (("run-1", best), ("run-2", unpromoted), ("run-3", other)):
        promote(PromotionConfig(), evaluation, store, run)
        record_run(store, run, [evaluation])

    collect_garbage(store, keep_runs=1)

    assert best.path.exists() and store.artifact_dir(best.parents["checkpoint"]).exists() and old_verifier.path.exists()
    assert served.path.exists() and not worse.path.exists()  # a warm start continues from the served draft
    assert not unpromoted.path.exists() and not store.artifact_dir(unpromoted.parents["checkpoint"]).exists()
    assert other.path.exists()
