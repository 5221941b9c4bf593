from __future__ import annotations

from pathlib import Path

from eagle3.config import VerifierConfig
from eagle3.verifier import resolve_verifier as step
from tasks.cache import step_task
from tasks.report import publish_step_report
from tasks.store import run_store


@step_task("resolve-verifier", "verifier")
def resolve_verifier_task(store_dir: str, cfg: VerifierConfig, source: Path) -> step.VerifierManifest:
    manifest = step.resolve_verifier(cfg, run_store(store_dir))
    publish_step_report(manifest, manifest.model_dump(include={"num_hidden_layers", "hidden_size", "vocab_size", "nested"}))
    return manifest
