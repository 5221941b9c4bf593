from __future__ import annotations

import pytest

from conftest import publish_text_artifact
from eagle3.lineage import find_artifact, lineage, to_mermaid
from eagle3.store import ArtifactError, ArtifactStore


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
