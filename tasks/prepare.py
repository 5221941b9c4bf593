from __future__ import annotations

from pathlib import Path

from eagle3.config import DatasetConfig
from eagle3.data import prepare_dataset as step
from eagle3.verifier.resolve_verifier import VerifierManifest, verifier_tokenizer
from tasks.cache import step_task, task_provenance
from tasks.report import publish_step_report
from tasks.store import run_store


@step_task("prepare-dataset", "dataset")
def prepare_dataset_task(store_dir: str, cfg: DatasetConfig, source: Path, verifier: VerifierManifest) -> step.DatasetManifest:
    store = run_store(store_dir)
    provenance = task_provenance(prepare_dataset_task, store, cfg=cfg, source=source, verifier=verifier)
    manifest = step.prepare_dataset(cfg, source, verifier_tokenizer(verifier), store, provenance)
    publish_step_report(
        manifest,
        manifest.model_dump(include={"num_records", "num_tokens", "num_supervised_tokens", "num_truncated", "dropped"}),
    )
    return manifest
