from __future__ import annotations

from prefect import task

from eagle3 import export as step
from eagle3.config import ExportConfig
from eagle3.extract_hidden_states import HiddenStatesManifest
from eagle3.store import step_provenance
from eagle3.train import DraftManifest
from eagle3.verifier import VerifierManifest
from eagle3.vocab_mapping import VocabManifest
from tasks.cache import step_cache_policy
from tasks.report import publish_step_report
from tasks.store import run_store


@task(name="export-checkpoint", cache_policy=step_cache_policy(step), persist_result=True)
def export_checkpoint_task(
    store_dir: str,
    cfg: ExportConfig,
    draft: DraftManifest,
    verifier: VerifierManifest,
    vocab: VocabManifest,
    hidden_states: HiddenStatesManifest,
) -> step.ExportManifest:
    store = run_store(store_dir)
    provenance = step_provenance(step, store, cfg=cfg, draft=draft, verifier=verifier, vocab=vocab, hidden_states=hidden_states)
    manifest = step.export_checkpoint(cfg, draft, verifier, vocab, hidden_states, store, provenance)
    publish_step_report(manifest, {"path": str(manifest.path), "tau_sim": round(manifest.tau_sim, 4)})
    return manifest
