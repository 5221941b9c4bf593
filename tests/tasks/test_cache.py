"""The step tasks' Prefect cache keys against the provenance their steps record."""

from __future__ import annotations

import pytest

from eagle3.config import EvalConfig, VerifierConfig
from eagle3.evaluation import baseline
from eagle3.store.artifacts import ArtifactStore
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.baseline import measure_baselines_task


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_baselines_task_is_cached_under_the_key_its_step_records(tmp_path, device):
    """Prefect's cache and the store must agree: the baselines key holds the device type, which is
    no input of the task, so both take it from `baseline_provenance`; the verifier's placement on
    GPUs (the task's input) is no part of either."""
    store = ArtifactStore(tmp_path / "store")
    verifier = VerifierManifest(path=tmp_path, digest="a" * 64, num_hidden_layers=4, hidden_size=64, vocab_size=256, nested=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say 1."}\n')
    cfg = EvalConfig(device=device)

    task_key = measure_baselines_task.cache_policy.provenance(
        store, cfg=cfg, verifier=verifier, prompts=prompts, placement=VerifierConfig(num_gpus=2, gpu_memory_gib=80)
    ).key

    assert task_key == baseline.baseline_provenance(store, cfg, verifier, prompts).key
    assert task_key != baseline.baseline_provenance(store, EvalConfig(device="cpu" if device == "cuda" else "cuda"), verifier, prompts).key
