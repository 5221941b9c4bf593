"""Stored bytes checked against their recorded digests: a damaged artifact or shard is found, reported,
repaired by recomputing, and read errors name the file."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os

import pytest
from conftest import publish_text_artifact

from eagle3.cli import main
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.store.artifacts import ArtifactError, ArtifactStore, artifact_damage
from eagle3.store.lineage import lineage
from eagle3.store.manifests import MANIFEST, ArtifactManifest, Provenance
from eagle3.store.verify import remove_damaged, verify_store
from eagle3.training.train import DraftManifest


def _shard(store: ArtifactStore, key: str, files: dict[str, bytes]):
    """A finished hidden-state shard as extraction leaves it: its files and `done.json` with their sha256."""
    shard = store.root / "shards" / key
    shard.mkdir(parents=True)
    for name, data in files.items():
        (shard / name).write_bytes(data)
    (shard / "done.json").write_text(json.dumps({"sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}))
    return shard


def _same_size_edit(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_publishing_an_artifact_again_repairs_a_stored_copy_whose_file_changed(tmp_path):
    store = ArtifactStore(tmp_path)
    first = publish_text_artifact(store, "dataset", "records", {})
    _same_size_edit(first.path / "data.txt")

    again = publish_text_artifact(store, "dataset", "records", {})

    assert again.digest == first.digest
    assert (again.path / "data.txt").read_text() == "records"
    assert artifact_damage(again.path) is None


def test_publishing_an_artifact_again_repairs_a_stored_copy_whose_manifest_is_not_json(tmp_path):
    store = ArtifactStore(tmp_path)
    first = publish_text_artifact(store, "dataset", "records", {})
    (first.path / MANIFEST).write_text('{"kind": "data')  # cut short

    again = publish_text_artifact(store, "dataset", "records", {})

    assert store.load(ArtifactManifest, again.digest).digest == first.digest


def test_loading_a_manifest_that_is_not_json_names_the_file_and_the_fix(tmp_path):
    store = ArtifactStore(tmp_path)
    artifact = publish_text_artifact(store, "dataset", "records", {})
    (artifact.path / MANIFEST).write_text('{"kind": "data')

    with pytest.raises(ArtifactError, match=rf"{artifact.path / MANIFEST}: not readable JSON .*delete {artifact.path} and re-run"):
        store.load(ArtifactManifest, artifact.digest)


def test_lineage_through_a_damaged_manifest_names_the_file(tmp_path):
    store = ArtifactStore(tmp_path)
    parent = publish_text_artifact(store, "dataset", "records", {})
    child = publish_text_artifact(store, "vocab_mapping", "vocab", {"dataset": parent.digest})
    (parent.path / MANIFEST).write_text('{"kind": "dat')

    with pytest.raises(ArtifactError, match=rf"{parent.path / MANIFEST}: not readable JSON"):
        lineage(store, [child.digest])


def test_a_step_whose_published_manifest_is_damaged_runs_again(tmp_path):
    store = ArtifactStore(tmp_path)
    provenance = Provenance(config={"step": "x"})
    with store.work_dir("dataset", provenance.key) as work:
        (work / "data.txt").write_text("records")
        artifact = store.publish(
            work,
            DatasetManifest(
                path=work,
                num_records=1,
                num_tokens=1,
                num_supervised_tokens=1,
                num_truncated=0,
                dropped={},
                files=["data.txt"],
                **provenance.model_dump(),
            ),
        )
    assert store.published(DatasetManifest, provenance) is not None
    (artifact.path / MANIFEST).write_text("")

    assert store.published(DatasetManifest, provenance) is None


def test_a_damaged_file_digest_memo_is_rebuilt_not_fatal(tmp_path, caplog):
    store = ArtifactStore(tmp_path / "store")
    source = tmp_path / "conversations.jsonl"
    source.write_text('{"id": 1}\n')
    (store.root / "file-digests.json").write_text('{"/some/file": {"tag": "1:2", "sha')  # cut short

    digest = store.input_digest(source)

    assert digest == hashlib.sha256(source.read_bytes()).hexdigest()
    assert "file-digests.json: unreadable" in caplog.text
    assert str(source) in json.loads((store.root / "file-digests.json").read_text())


def test_an_input_copied_over_with_its_old_size_and_timestamp_is_hashed_again(tmp_path):
    """What `cp -p`, `rsync -a` and `tar x` leave: other bytes, the same size and mtime."""
    store = ArtifactStore(tmp_path / "store")
    source = tmp_path / "conversations.jsonl"
    source.write_text('{"id": 1}\n')
    before = store.input_digest(source)
    stamp = source.stat().st_mtime_ns

    source.write_text('{"id": 2}\n')
    os.utime(source, ns=(stamp, stamp))

    assert store.input_digest(source) != before
    assert store.input_digest(source) == hashlib.sha256(source.read_bytes()).hexdigest()


def test_a_manifest_holding_nan_reads_back_as_published(tmp_path):
    """A diverged validation loss is NaN: written as null it no longer read as a number, and the
    draft was trained again on every run."""
    store = ArtifactStore(tmp_path)
    provenance = Provenance(config={"lr": 1e8})
    with store.step_work_dir(DraftManifest, provenance) as (work, _):
        (work / "weights.txt").write_text("diverged")
        store.publish(work, DraftManifest(**provenance.model_dump(), path=work, epochs=[{"val_loss": math.nan}], num_steps=1, tau_sim=1.0))

    found = store.published(DraftManifest, provenance)

    assert found is not None and math.isnan(found.epochs[0]["val_loss"])


def test_verify_store_finds_each_damaged_artifact_and_shard_and_nothing_else(tmp_path):
    store = ArtifactStore(tmp_path)
    good = publish_text_artifact(store, "dataset", "good", {})
    edited = publish_text_artifact(store, "dataset", "edited", {})
    _same_size_edit(edited.path / "data.txt")
    _shard(store, "a" * 64, {"hs_0.safetensors": b"states 0", "hs_1.safetensors": b"states 1"})
    truncated = _shard(store, "b" * 64, {"hs_0.safetensors": b"states 0", "hs_1.safetensors": b"states 1"})
    (truncated / "hs_1.safetensors").write_bytes(b"stat")

    checked, damaged = verify_store(store)

    assert checked == 4
    assert [(d.kind, d.path) for d in damaged] == [("artifact", edited.path), ("shard", truncated)]
    assert "hs_1.safetensors hashes to" in damaged[1].problem and "done.json recorded" in damaged[1].problem
    assert good.path.exists()


def test_removing_a_damaged_shard_removes_the_hidden_state_artifacts_that_list_it(tmp_path):
    store = ArtifactStore(tmp_path)
    shard = _shard(store, "c" * 64, {"hs_0.safetensors": b"states 0"})
    listing, other = (
        publish_text_artifact(
            store,
            "hidden_states",
            name,
            {},
            manifest_type=HiddenStatesManifest,
            aux_layer_ids=[1, 2, 3],
            hidden_size=64,
            num_records=1,
            num_tokens=8,
            shards=[{"key": key, "first_record": 0, "num_records": 1}],
            extracted_shards=1,
            reused_shards=0,
        )
        for name, key in (("listing", "c" * 64), ("other listing", "d" * 64))
    )
    (shard / "hs_0.safetensors").write_bytes(b"changed!")

    removed = remove_damaged(store, verify_store(store)[1])

    assert removed == [shard, listing.path]
    assert not shard.exists() and not listing.path.exists() and other.path.exists()


def test_artifacts_verify_prints_one_line_per_damaged_artifact_and_exits_1(tmp_path, capsys):
    store = ArtifactStore(tmp_path)
    publish_text_artifact(store, "dataset", "good", {})
    edited = publish_text_artifact(store, "dataset", "edited", {})
    _same_size_edit(edited.path / "data.txt")

    code = main(["artifacts", "verify", "--store", str(tmp_path)])

    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out == [f"artifact {edited.path}: {artifact_damage(edited.path)}"]


def test_artifacts_verify_remove_leaves_a_store_that_verifies(tmp_path, capsys, caplog):
    store = ArtifactStore(tmp_path)
    edited = publish_text_artifact(store, "dataset", "edited", {})
    _same_size_edit(edited.path / "data.txt")
    caplog.set_level(logging.WARNING)

    assert main(["artifacts", "verify", "--store", str(tmp_path), "--remove"]) == 1

    assert not edited.path.exists()
    assert main(["artifacts", "verify", "--store", str(tmp_path)]) == 0
