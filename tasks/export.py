from __future__ import annotations

from pathlib import Path

from eagle3.config import ExportConfig
from eagle3.evaluation.given_draft import given_draft, given_draft_provenance
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.runtime.library_logs import forward_speculators_logs
from eagle3.training import export as step
from eagle3.training.train import DraftManifest
from eagle3.training.vocab_mapping import VocabManifest
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.report import publish_step_report
from tasks.store import run_store


@step_task("export-checkpoint", "checkpoint")
def export_checkpoint_task(
    store_dir: str,
    cfg: ExportConfig,
    draft: DraftManifest,
    verifier: VerifierManifest,
    vocab: VocabManifest,
    hidden_states: HiddenStatesManifest,
) -> step.ExportManifest:
    forward_speculators_logs()  # the draft's speculators code logs into the run's log
    store = run_store(store_dir)
    provenance = task_provenance(
        export_checkpoint_task, store, cfg=cfg, draft=draft, verifier=verifier, vocab=vocab, hidden_states=hidden_states
    )
    manifest = step.export_checkpoint(cfg, draft, verifier, vocab, hidden_states, store, provenance)
    publish_step_report(manifest, {"path": str(manifest.path), "tau_sim": round(draft.tau_sim, 4)})
    return manifest


@step_task("given-draft", given_draft_provenance)
def given_draft_task(store_dir: str, draft: Path, cfg: ExportConfig, verifier: VerifierManifest) -> step.ExportManifest:
    """A draft trained elsewhere (`draft_path`), checked against the verifier and copied into the store."""
    forward_speculators_logs()
    store = run_store(store_dir)
    provenance = task_provenance(given_draft_task, store, draft=draft, cfg=cfg, verifier=verifier)
    manifest = given_draft(draft, cfg, verifier, store, provenance)
    publish_step_report(manifest, {"path": str(manifest.path), "given": str(draft)})
    return manifest
