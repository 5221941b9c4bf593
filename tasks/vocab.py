from __future__ import annotations

from eagle3.config import VocabConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.training import vocab_mapping as step
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.report import publish_step_report
from tasks.store import run_store


@step_task("build-vocab-mapping", "vocab_mapping")
def build_vocab_mapping_task(store_dir: str, cfg: VocabConfig, dataset: DatasetManifest, verifier: VerifierManifest) -> step.VocabManifest:
    store = run_store(store_dir)
    provenance = task_provenance(build_vocab_mapping_task, store, cfg=cfg, dataset=dataset, verifier=verifier)
    manifest = step.build_vocab_mapping(cfg, dataset, verifier.vocab_size, store, provenance)
    publish_step_report(
        manifest,
        manifest.model_dump(include={"draft_vocab_size", "num_distinct_supervised_tokens", "coverage", "padded"}),
    )
    return manifest
