"""Data-parallel regeneration and extraction: one worker process per claimed device, each taking
whole shards or batches of records. CPU workers (devices named "cpu") run the same code path as
GPU workers: a child process per worker, driven by a thread of the step."""

from __future__ import annotations

import threading

import pytest
from conftest import SAMPLE, write_jsonl

from eagle3.config import DatasetConfig, ExtractConfig, RegenerateConfig, VerifierConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.data.regenerate import regenerate
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.runtime.attempts import fixed_devices
from eagle3.runtime.faults import FAULT_OOM_ENV
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # each worker is a spawned process that imports torch and transformers
AUX = [1, 2, 3]
TWO_CPU_WORKERS = fixed_devices(["cpu", "cpu"])


@pytest.fixture(scope="module")
def prepared(tiny_verifier, tmp_path_factory):
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256, max_records=24), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return verifier, dataset


class ReportingThreads:
    """An `on_progress` that records which thread reported: each worker's reports come from its own."""

    def __init__(self):
        self.names: set[str] = set()

    def __call__(self, *_):
        self.names.add(threading.current_thread().name)


def test_two_cpu_workers_extract_every_shard_with_the_digest_of_one_worker(prepared, tmp_path):
    verifier, dataset = prepared
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=4)
    one = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "one"), Provenance())
    reports = ReportingThreads()

    two = extract_hidden_states(
        cfg, dataset, verifier, ArtifactStore(tmp_path / "two"), Provenance(), on_progress=reports, claim=TWO_CPU_WORKERS
    )

    assert two.digest == one.digest
    assert (two.extracted_shards, two.reused_shards) == (6, 0)
    assert len({name for name in reports.names if name.startswith("extract-worker")}) == 2  # both workers extracted shards


def test_each_data_parallel_worker_backs_off_on_its_own_and_the_digest_holds(prepared, monkeypatch, tmp_path):
    verifier, dataset = prepared
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=4, prefill_batch_tokens=1024)
    direct = extract_hidden_states(
        cfg.model_copy(update={"prefill_batch_tokens": 512}), dataset, verifier, ArtifactStore(tmp_path / "a"), Provenance()
    )
    monkeypatch.setenv(FAULT_OOM_ENV, "600")  # the workers' processes inherit it

    manifest = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "b"), Provenance(), claim=TWO_CPU_WORKERS)

    first_attempts = [b for b in manifest.backoffs if b.value == 1024]
    assert {b.at["shard"] for b in first_attempts} == {0, 3}  # each worker ran out of memory at the first shard of its share
    assert all(b.setting == "extract.prefill_batch_tokens" for b in manifest.backoffs)
    assert manifest.digest == direct.digest


def test_two_cpu_workers_regenerate_what_one_worker_regenerates(prepared, tmp_path):
    verifier, _ = prepared
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"id": str(i), "prompt": f"Count to {i}, slowly."} for i in range(6)])
    cfg = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=2)
    one = regenerate(cfg, source, verifier, ArtifactStore(tmp_path / "one"), Provenance())
    reports = ReportingThreads()

    two = regenerate(cfg, source, verifier, ArtifactStore(tmp_path / "two"), Provenance(), on_progress=reports, claim=TWO_CPU_WORKERS)

    assert two.digest == one.digest
    assert two.num_records + len(two.failed) == 6
    assert len({name for name in reports.names if name.startswith("regenerate-worker")}) == 2
