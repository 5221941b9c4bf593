"""Promotion after evaluation. Never cached: the decision depends on the store's history, and a
re-run must look at what was promoted since."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from eagle3.config import PromotionConfig
from eagle3.evaluation import promotion as step
from eagle3.evaluation.evaluate import EvalManifest
from eagle3.store.artifacts import ArtifactStore


def _markdown(record: step.PromotionRecord) -> str:
    key = record.key
    tau_sim = "" if record.tau_sim is None else f"{record.tau_sim:.3f}"  # None: a draft trained elsewhere
    rows = [f"| this run | `{record.checkpoint[:16]}` | {record.tau:.3f} | {tau_sim} | `{record.run_id}` |"]
    if record.best_earlier_checkpoint is not None:
        rows.append(
            f"| best earlier promoted | `{record.best_earlier_checkpoint[:16]}` | {record.best_earlier_tau:.3f} | | "
            f"`{record.best_earlier_run_id}` |"
        )
    return (
        f"### {'Promoted' if record.promoted else 'Not promoted'}\n\n{record.summary()}\n\n"
        f"| | checkpoint | measured tau (k={key.k}) | tau_sim | run |\n| --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + f"\n\nCompared on: verifier `{key.verifier[:16]}`, eval prompts `{key.prompts[:16]}`, k={key.k}, "
        f"max_new_tokens={key.max_new_tokens}, {key.num_prompts} prompts; min improvement {record.min_improvement}, "
        f"min standard errors {record.min_standard_errors}.\n\n"
        f"Checkpoint: `{record.checkpoint_path}`\n"
    )


@task(name="promote", cache_policy=NO_CACHE, persist_result=False)  # nothing pickled: docs/security.md
def promote_task(store_dir: str, cfg: PromotionConfig, evaluation: EvalManifest) -> step.PromotionRecord:
    """Compare the evaluated checkpoint with the best earlier promoted one; record and show the decision."""
    record = step.promote(cfg, evaluation, ArtifactStore(store_dir), str(flow_run.id or "local"))
    create_markdown_artifact(key="promotion", markdown=_markdown(record), description=record.summary())
    return record
