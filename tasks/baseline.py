from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_table_artifact

from eagle3.config import EvalConfig, VerifierConfig
from eagle3.evaluation import baseline as step
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.gpu import decoding_claim, without_placement
from tasks.report import decode_rows, publish_step_report
from tasks.store import run_store


@step_task("measure-baselines", without_placement(step.baseline_provenance))
def measure_baselines_task(
    store_dir: str, cfg: EvalConfig, verifier: VerifierManifest, prompts: Path, placement: VerifierConfig | None = None
) -> step.BaselineManifest:
    store = run_store(store_dir)
    provenance = task_provenance(measure_baselines_task, store, cfg=cfg, verifier=verifier, prompts=prompts)
    manifest = step.measure_baselines(
        cfg, verifier, prompts, store, provenance, claim=decoding_claim(cfg.device, placement, verifier, cfg.dtype), placement=placement
    )
    create_table_artifact(
        key="baselines",
        table=decode_rows(manifest.results),
        description=f"n-gram prompt lookup; plain greedy {manifest.greedy_tokens_per_s:.1f} tok/s on {manifest.measured_on}",
    )
    publish_step_report(manifest, manifest.model_dump(include={"num_prompts", "num_tokens", "mismatches", "measured_on"}))
    return manifest
