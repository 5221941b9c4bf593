from __future__ import annotations

from functools import partial
from pathlib import Path

from prefect import task

from eagle3 import regenerate as step
from eagle3.config import RegenerateConfig
from eagle3.store import step_provenance
from eagle3.verifier import VerifierManifest
from tasks.cache import step_cache_policy
from tasks.gpu import claim_gpus
from tasks.report import Progress, publish_step_report
from tasks.store import run_store


@task(name="regenerate", cache_policy=step_cache_policy(step), persist_result=True)
def regenerate_task(store_dir: str, cfg: RegenerateConfig, source: Path, verifier: VerifierManifest) -> step.RegeneratedManifest:
    store = run_store(store_dir)
    provenance = step_provenance(step, store, cfg=cfg, source=source, verifier=verifier)
    manifest = step.regenerate(
        cfg, source, verifier, store, provenance, on_progress=Progress("regenerate (records)"), claim=partial(claim_gpus, cfg.device)
    )
    numbers = manifest.model_dump(include={"num_records", "num_generated_tokens", "backoffs", "gpu_memory_after_mib"})
    publish_step_report(manifest, {**numbers, "failed": len(manifest.failed)})
    return manifest
