from __future__ import annotations

from pathlib import Path

from eagle3.config import RegenerateConfig, VerifierConfig
from eagle3.data import regenerate as step
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.gpu import verifier_claim, without_placement
from tasks.report import Progress, publish_step_report
from tasks.store import run_store


@step_task("regenerate", without_placement(step.regenerate_provenance))
def regenerate_task(
    store_dir: str, cfg: RegenerateConfig, source: Path, verifier: VerifierManifest, placement: VerifierConfig | None = None
) -> step.RegeneratedManifest:
    store = run_store(store_dir)
    provenance = task_provenance(regenerate_task, store, cfg=cfg, source=source, verifier=verifier)
    manifest = step.regenerate(
        cfg,
        source,
        verifier,
        store,
        provenance,
        on_progress=Progress("regenerate (records)"),
        claim=verifier_claim(cfg.device, placement),
        placement=placement,
    )
    numbers = manifest.model_dump(include={"num_records", "num_generated_tokens", "reused_records", "backoffs", "gpu_memory_after_mib"})
    publish_step_report(manifest, {**numbers, "failed": len(manifest.failed)})
    return manifest
