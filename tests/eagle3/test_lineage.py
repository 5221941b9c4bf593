from __future__ import annotations

import json

import pytest
from conftest import publish_text_artifact

from eagle3.cli import main
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.lineage import change_summary, find_artifact, lineage, lineage_table, to_mermaid
from eagle3.store.manifests import Producer
from eagle3.store.runs import lineage_roots, record_run


def _store(root, run: str) -> ArtifactStore:
    return ArtifactStore(root, producer=Producer(flow_run_id=run, task_run_id=f"{run}-task"))


def test_lineage_follows_parents_through_the_store_and_marks_inputs(tmp_path):
    store = ArtifactStore(tmp_path)
    dataset = publish_text_artifact(store, "dataset", "d", {"source": "f" * 64})
    vocab = publish_text_artifact(store, "vocab_mapping", "v", {"dataset": dataset.digest})
    draft = publish_text_artifact(store, "draft", "x", {"dataset": dataset.digest, "vocab": vocab.digest})

    nodes = lineage(store, [find_artifact(store, draft.digest[:8])])

    assert {n["kind"] for n in nodes.values()} == {"draft", "vocab_mapping", "dataset", "input"}
    assert nodes["f" * 64] == {"kind": "input", "name": "source", "digest": "f" * 64, "parents": {}}
    graph = to_mermaid(nodes)
    assert f"n{dataset.digest[:12]} -->|vocab| n{draft.digest[:12]}" not in graph
    assert f"n{vocab.digest[:12]} -->|vocab| n{draft.digest[:12]}" in graph
    assert f"n{'f' * 12} -->|source| n{dataset.digest[:12]}" in graph


def test_ambiguous_or_unknown_digest_prefix_is_an_error(tmp_path):
    store = ArtifactStore(tmp_path)
    publish_text_artifact(store, "dataset", "d", {})

    with pytest.raises(ArtifactError, match="matches 0 artifacts"):
        find_artifact(store, "zzzz")


def test_republishing_equal_bytes_keeps_the_digest_and_the_first_producer(tmp_path):
    first = publish_text_artifact(_store(tmp_path, "run-1"), "dataset", "d", {"source": "f" * 64})

    again = publish_text_artifact(_store(tmp_path, "run-2"), "dataset", "d", {"source": "f" * 64})

    assert again.digest == first.digest
    assert again.producer == first.producer == Producer(flow_run_id="run-1", task_run_id="run-1-task")
    assert lineage(ArtifactStore(tmp_path), [first.digest])[first.digest]["producer"]["flow_run_id"] == "run-1"


def test_a_run_that_only_reuses_artifacts_says_nothing_changed_and_names_their_producer(tmp_path):
    dataset = publish_text_artifact(_store(tmp_path, "run-1"), "dataset", "d", {"source": "f" * 64})
    draft = publish_text_artifact(_store(tmp_path, "run-1"), "draft", "x", {"dataset": dataset.digest})
    nodes = lineage(ArtifactStore(tmp_path), [dataset.digest, draft.digest])

    summary = change_summary(nodes, "run-2")

    assert summary == "Nothing changed: this run produced no artifact; all 2 artifacts it used come from earlier runs (run-1)."
    rows = {row["kind"]: row for row in lineage_table(nodes, "run-2")}
    assert rows["draft"]["origin"] == "cached: produced by run run-1"
    assert rows["draft"]["task_run"] == "run-1-task"
    assert rows["input"]["origin"] == "input"


def test_a_run_that_produced_an_artifact_names_it_and_draws_it_as_new(tmp_path):
    dataset = publish_text_artifact(_store(tmp_path, "run-1"), "dataset", "d", {"source": "f" * 64})
    draft = publish_text_artifact(_store(tmp_path, "run-2"), "draft", "x", {"dataset": dataset.digest})
    nodes = lineage(ArtifactStore(tmp_path), [draft.digest])

    summary = change_summary(nodes, "run-2")
    graph = to_mermaid(nodes, "run-2")

    assert summary == "This run produced 1 of its 2 artifacts: draft."
    assert f'n{draft.digest[:12]}["draft<br/>{draft.digest[:12]}<br/>run run-2"]:::new' in graph
    assert f'n{dataset.digest[:12]}["dataset<br/>{dataset.digest[:12]}<br/>run run-1"]:::cached' in graph


def test_a_run_id_prefix_resolves_to_the_roots_the_run_recorded(tmp_path):
    store = _store(tmp_path, "5f0c7a2e-run")
    dataset = publish_text_artifact(store, "dataset", "d", {"source": "f" * 64})
    draft = publish_text_artifact(store, "draft", "x", {"dataset": dataset.digest})
    record_run(store, "5f0c7a2e-run", [dataset, draft])

    assert lineage_roots(store, "5f0c") == (
        [dataset.digest, draft.digest],
        "5f0c7a2e-run",
        {dataset.digest: {"source": "f" * 64}, draft.digest: {"dataset": dataset.digest}},
    )
    assert lineage_roots(store, draft.digest[:10]) == ([draft.digest], None, {})


def test_a_run_s_lineage_follows_the_parents_it_handed_on_where_equal_bytes_came_from_other_inputs(tmp_path, capsys):
    """A draft trained on records that differ only in the validation split is the same bytes: the
    store keeps the first run's manifest, whose parents are the first run's data. The second run's
    lineage, record and graph name its own data, and not the first run's."""
    first_data = publish_text_artifact(_store(tmp_path, "run-1"), "dataset", "week 1", {"source": "a" * 64})
    first = publish_text_artifact(_store(tmp_path, "run-1"), "draft", "same weights", {"dataset": first_data.digest})
    record_run(ArtifactStore(tmp_path), "run-1", [first_data, first])
    data = publish_text_artifact(_store(tmp_path, "run-2"), "dataset", "week 2", {"source": "b" * 64})
    draft = publish_text_artifact(_store(tmp_path, "run-2"), "draft", "same weights", {"dataset": data.digest})
    assert draft.digest == first.digest and draft.parents == {"dataset": data.digest}

    record = json.loads(record_run(ArtifactStore(tmp_path), "run-2", [data, draft]).read_text())

    assert record["artifacts"] == sorted([data.digest, draft.digest])  # not the first run's dataset
    assert main(["lineage", "run-2", "--store", str(tmp_path), "--table"]) == 0
    out, err = capsys.readouterr()
    assert f"dataset={data.digest[:12]}" in out and first_data.digest[:12] not in out
    assert err == "This run produced 1 of its 2 artifacts: dataset.\n"  # the draft's bytes are run-1's


def test_eagle3_lineage_of_a_run_id_prints_the_runs_graph(tmp_path, capsys):
    store = _store(tmp_path, "run-1")
    draft = publish_text_artifact(store, "draft", "x", {"source": "f" * 64})
    record_run(store, "run-1", [draft])

    assert main(["lineage", "run-1", "--store", str(tmp_path)]) == 0

    out, err = capsys.readouterr()
    assert out == to_mermaid(lineage(store, [draft.digest]), "run-1") + "\n"
    assert err == "This run produced 1 of its 1 artifacts: draft.\n"


def test_a_node_reached_first_through_a_leaf_edge_still_brings_its_ancestors_when_reached_otherwise(tmp_path):
    store = ArtifactStore(tmp_path)
    data = publish_text_artifact(store, "dataset", "d", {})
    draft = publish_text_artifact(store, "draft", "old", {"dataset": data.digest})
    warm = publish_text_artifact(store, "draft", "new", {"init": draft.digest})

    nodes = lineage(store, [draft.digest, warm.digest], leaf_edges=frozenset({"init"}))

    assert set(nodes) == {data.digest, draft.digest, warm.digest}
    assert set(lineage(store, [warm.digest], leaf_edges=frozenset({"init"}))) == {draft.digest, warm.digest}
