from __future__ import annotations

from prefect import task

from eagle3 import vocab_mapping as step
from eagle3.config import VocabConfig
from eagle3.prepare_dataset import DatasetManifest
from eagle3.store import step_provenance
from eagle3.verifier import VerifierManifest
from tasks.cache import step_cache_policy
from tasks.report import publish_step_report
from tasks.store import run_store


@task(name="build-vocab-mapping", cache_policy=step_cache_policy(step), persist_result=True)
def build_vocab_mapping_task(
    store_dir: str, cfg: VocabConfig, dataset: DatasetManifest, verifier: VerifierManifest
) -> step.VocabManifest:
    store = run_store(store_dir)
    provenance = step_provenance(step, store, cfg=cfg, dataset=dataset, verifier=verifier)
    manifest = step.build_vocab_mapping(cfg, dataset, verifier.vocab_size, store, provenance)
    publish_step_report(
        manifest,
        manifest.model_dump(include={"draft_vocab_size", "num_distinct_supervised_tokens", "coverage", "padded"}),
    )
    return manifest
