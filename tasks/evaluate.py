from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_table_artifact

from eagle3.config import EvalConfig, VerifierConfig
from eagle3.evaluation import evaluate as step
from eagle3.evaluation.baseline import BaselineManifest
from eagle3.figures import with_error
from eagle3.runtime.library_logs import forward_speculators_logs
from eagle3.training.export import ExportManifest
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.gpu import decoding_claim, without_placement
from tasks.report import decode_rows, publish_step_report
from tasks.store import run_store


@step_task("evaluate", without_placement(step.evaluation_provenance))
def evaluate_task(
    store_dir: str,
    cfg: EvalConfig,
    checkpoint: ExportManifest,
    verifier: VerifierManifest,
    prompts: Path,
    baselines: BaselineManifest | None,
    placement: VerifierConfig | None = None,
) -> step.EvalManifest:
    """`baselines`: of the same verifier, prompts and settings (None: backend 'vllm'); `placement`: the
    verifier's GPU settings."""
    forward_speculators_logs()  # the draft's speculators code logs into the run's log
    store = run_store(store_dir)
    provenance = task_provenance(
        evaluate_task,
        store,
        cfg=cfg,
        checkpoint=checkpoint,
        verifier=verifier,
        prompts=prompts,
        baselines=baselines,
    )
    manifest = step.evaluate(
        cfg,
        checkpoint,
        verifier,
        prompts,
        store,
        provenance,
        baselines,
        claim=decoding_claim(cfg.device, placement, verifier, cfg.dtype),
        placement=placement,
    )
    create_table_artifact(
        key="acceptance-length",
        table=decode_rows(manifest.results),
        description="measured tau"
        + ("" if manifest.tau_sim is None else f" (tau_sim {manifest.tau_sim:.3f})")
        + "; "
        + (
            f"plain greedy {manifest.greedy_tokens_per_s:.1f} tok/s, decoded beside the draft on {manifest.measured_on}; "
            f"n-gram's speed-ups are over its baselines' greedy, decoded on {baselines.measured_on}"
            if baselines is not None
            else f"from the spec-decode counters of {cfg.endpoint.display_url}"
        ),
    )
    gains = {
        f"gain_over_ngram_k{g['k']}": with_error(g["gain"], g["standard_error"], signed=True)
        for g in manifest.gains_over_ngram or []
        if g["gain"] is not None
    }
    publish_step_report(
        manifest, {"num_prompts": manifest.num_prompts, "num_tokens": manifest.num_tokens, "mismatches": manifest.mismatches, **gains}
    )
    return manifest
