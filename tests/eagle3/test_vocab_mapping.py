from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3.config import ConfigError, VocabConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.training.vocab_mapping import build_vocab_mapping, load_vocab_mapping


@pytest.fixture
def dataset(tmp_path) -> DatasetManifest:
    """A prepared-dataset artifact whose supervised tokens are 7 (x50), 3 (x30), 11 (x15), 5 (x5)."""
    path = tmp_path / "dataset"
    path.mkdir()
    pq.write_table(pa.table({"token_id": [3, 5, 7, 11], "count": [30, 5, 50, 15]}), path / "token_freq.parquet")
    return DatasetManifest(path=path, num_records=1, num_tokens=100, num_supervised_tokens=100, num_truncated=0, dropped={}, files=[])


def test_vocab_mapping_keeps_the_most_frequent_tokens(dataset, tmp_path):
    manifest = build_vocab_mapping(VocabConfig(draft_vocab_size=3), dataset, 16, ArtifactStore(tmp_path / "s"), Provenance())

    d2t, t2d = load_vocab_mapping(manifest)
    assert torch.nonzero(t2d).flatten().tolist() == [3, 7, 11]
    assert (torch.arange(3) + d2t).tolist() == [3, 7, 11]
    assert manifest.coverage == pytest.approx(0.95)
    assert manifest.padded == 0


def test_draft_vocab_larger_than_supervised_tokens_is_reported_not_fatal(dataset, tmp_path, caplog):
    manifest = build_vocab_mapping(VocabConfig(draft_vocab_size=6), dataset, 16, ArtifactStore(tmp_path / "s"), Provenance())

    assert manifest.padded == 2
    assert manifest.coverage == 1.0
    assert "only 4 distinct tokens are supervised" in caplog.text
    assert int(load_vocab_mapping(manifest)[1].sum()) == 6


def test_draft_vocab_larger_than_verifier_vocab_is_a_config_error(dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"vocab.draft_vocab_size = 32 exceeds the verifier's vocabulary \(16\)"):
        build_vocab_mapping(VocabConfig(draft_vocab_size=32), dataset, 16, ArtifactStore(tmp_path / "s"), Provenance())
