"""Promotion: is this run's draft better than the best one promoted before it?

Measured tau is comparable only between evaluations of the same verifier, on the same prompts, with
the same settings that change tau (k, max_new_tokens, number of prompts, how and in what precision
it was measured): that is the comparison key. A run's EAGLE-3 tau at k is compared with the best tau an earlier run promoted under the same
key, and promoted when it is higher by more than `min_improvement`; the first under a key is promoted.
Both evaluations decoded the same prompts, so where both kept their per-prompt counts the record
holds the standard error of the difference, paired over prompts: a gain within about two of them
may be the luck of the prompt sample, and `min_standard_errors` can require more. Where no such
error can be measured (backend 'vllm' keeps no per-prompt counts), tau alone decides and the
summary says the bar was not checked.

The decision depends on history, so it is no artifact and never cached. Each decision is appended
to the store as `promotions/<time>-<run id>.json` (atomic write, under a lock so two concurrent
runs decide one after the other), where later runs and `eagle3 promoted` find it without a server.
A re-run of the same checkpoint does not count its own earlier records: while nothing better has
been promoted since, it stays promoted.
"""

from __future__ import annotations

import fcntl
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3.config import ConfigError, EvalConfig, PromotionConfig
from eagle3.figures import with_error
from eagle3.store import MANIFEST, ArtifactError, ArtifactStore, atomic_write_text
from eagle3.tau import gain_over, read_counts

if TYPE_CHECKING:  # evaluate imports torch and transformers: `eagle3 promoted` needs neither
    from eagle3.evaluate import EvalManifest

__all__ = ["PROMOTIONS", "ComparisonKey", "PromotionRecord", "best_promoted", "promote", "promoted_checkpoints", "read_promotions"]

PROMOTIONS = "promotions"


class ComparisonKey(BaseModel):
    """What two evaluations must share for their taus to be compared."""

    model_config = ConfigDict(frozen=True)

    verifier: str = Field(description="verifier artifact digest")
    prompts: str = Field(description="eval prompts file digest")
    k: int = Field(description="draft length tau was measured at")
    max_new_tokens: int
    num_prompts: int
    # Defaults, for evaluations that recorded no such field: made before it was keyed, or dtype under 'vllm', which ignores it.
    backend: str = Field(EvalConfig().backend, description="how tau was measured: our own decoding, or a vLLM server's counters")
    dtype: str = Field(EvalConfig().dtype, description="precision of our own decoding (bf16 drifts from greedy)")


class PromotionRecord(BaseModel):
    """One run's decision, with the numbers it was made on."""

    run_id: str
    recorded_at: datetime
    key: ComparisonKey
    checkpoint: str = Field(description="checkpoint artifact digest")
    checkpoint_path: Path
    evaluation: str = Field(description="evaluation artifact digest")
    tau: float = Field(description="measured EAGLE-3 tau at key.k")
    tau_sim: float = Field(description="tau simulated from training metrics, for comparison")
    min_improvement: float
    promoted: bool
    best_earlier_run_id: str | None = None
    best_earlier_checkpoint: str | None = None
    best_earlier_tau: float | None = None
    min_standard_errors: float = 0.0  # the bar in standard errors, applied where gain_standard_error is measured
    gain_standard_error: float | None = Field(
        None, description="standard error of tau minus best_earlier_tau, paired over the prompts (None: no best "
        "earlier; either evaluation kept no per-prompt counts, as backend 'vllm' and evaluations made before they "
        "were kept, or was deleted; fewer than two prompts; or no verifier pass)")

    def summary(self) -> str:
        measured = f"tau {self.tau:.3f} at k={self.key.k} on {self.key.num_prompts} prompts"
        if self.best_earlier_tau is None:
            return f"promoted: {measured}; first checkpoint evaluated on this verifier and eval set"
        verdict = "promoted" if self.promoted else "not promoted"
        beats = "beats" if self.promoted else "does not beat"
        bar, unchecked = f"more than {self.min_improvement}", ""
        if self.min_standard_errors and self.gain_standard_error is not None:
            bar += f" and {self.min_standard_errors} standard errors"
        elif self.min_standard_errors:
            unchecked = f" ({self.min_standard_errors} standard errors not checked: no paired standard error measured)"
        gain = with_error(self.tau - self.best_earlier_tau, self.gain_standard_error, signed=True)
        return (f"{verdict}: {measured} {beats} the best earlier promoted tau {self.best_earlier_tau:.3f} "
                f"(checkpoint {self.best_earlier_checkpoint[:12]}) by {bar}: {gain}{unchecked}")


def _comparison(evaluation: EvalManifest, k: int | None) -> tuple[ComparisonKey, float]:
    """The evaluation's comparison key and its EAGLE-3 tau at k (None: the first k it measured)."""
    where = evaluation.path / MANIFEST
    settings = evaluation.config.get("cfg", {})
    missing = [f"parents.{name}" for name in ("checkpoint", "verifier", "prompts") if name not in evaluation.parents]
    missing += [] if "max_new_tokens" in settings else ["config.cfg.max_new_tokens"]
    if missing:
        raise ArtifactError(where, f"no field {', '.join(missing)}: not made by the pipeline's evaluate step; re-run it")
    taus = {r["k"]: r["tau"] for r in evaluation.results if r["method"] == "eagle3"}  # in evaluate.ks order
    if not taus:
        raise ArtifactError(where, "field 'results' has no 'eagle3' entry: nothing to compare")
    k = next(iter(taus)) if k is None else k
    if k not in taus:
        raise ConfigError(f"promotion.k={k}: {where} measured EAGLE-3 tau only at k in {sorted(taus)}; set promotion.k to one of them")
    key = ComparisonKey(verifier=evaluation.parents["verifier"], prompts=evaluation.parents["prompts"], k=k,
                        max_new_tokens=settings["max_new_tokens"], num_prompts=evaluation.num_prompts,
                        **{name: settings[name] for name in ("backend", "dtype") if name in settings})
    return key, taus[k]


def read_promotions(store: ArtifactStore) -> list[PromotionRecord]:
    """Every recorded decision, oldest first.

    Raises:
        ArtifactError: a record is not valid JSON or lacks a field (names the file and field).
    """
    records = []
    for path in sorted((store.root / PROMOTIONS).glob("*.json")):
        try:
            records.append(PromotionRecord.model_validate_json(path.read_text()))
        except ValidationError as exc:
            fields = "; ".join(f"field '{'.'.join(map(str, e['loc']))}': {e['msg']}" for e in exc.errors())
            raise ArtifactError(path, f"not a promotion record ({fields}); fix or delete the file") from exc
    return sorted(records, key=lambda r: r.recorded_at)


def best_promoted(records: list[PromotionRecord], key: ComparisonKey, other_than: str | None = None) -> PromotionRecord | None:
    """The highest-tau promoted record under `key` (the earliest on a tie), skipping checkpoint `other_than`."""
    candidates = [r for r in records if r.promoted and r.key == key and r.checkpoint != other_than]
    return max(candidates, key=lambda r: r.tau, default=None)


def promoted_checkpoints(store: ArtifactStore) -> list[PromotionRecord]:
    """The best promoted checkpoint under each comparison key, in order of its decision."""
    records = read_promotions(store)
    keys = dict.fromkeys(r.key for r in records if r.promoted)
    return sorted((best_promoted(records, key) for key in keys), key=lambda r: r.recorded_at)


def _beats(gain: float, error: float | None, cfg: PromotionConfig) -> bool:
    """Whether a gain over the best earlier tau clears both bars (the error's only where measured)."""
    return gain > cfg.min_improvement and (error is None or gain > cfg.min_standard_errors * error)


def _paired_error(evaluation: EvalManifest, best: PromotionRecord, store: ArtifactStore) -> float | None:
    """Standard error of the evaluation's tau minus the best earlier one's, paired over their prompts
    (None: as `PromotionRecord.gain_standard_error` says)."""
    ours = evaluation.counts("eagle3", best.key.k)
    theirs = read_counts(store.artifact_dir(best.evaluation), "eagle3", best.key.k)
    if ours is None or theirs is None or len(ours) != len(theirs):
        return None
    return gain_over(ours, theirs)[1]


def promote(cfg: PromotionConfig, evaluation: EvalManifest, store: ArtifactStore, run_id: str) -> PromotionRecord:
    """Decide whether the evaluated checkpoint is promoted, and record the decision in the store.

    Args:
        cfg: which k decides and by how much tau must improve, in tau and in standard errors.
        evaluation: the run's evaluation; its parents name the checkpoint, verifier and prompts.
        store: the artifact store holding earlier decisions.
        run_id: the flow run recorded with the decision.

    Returns:
        The decision, as written to `promotions/`.

    Raises:
        ArtifactError: the evaluation lacks what the comparison needs, or a stored record is corrupt.
        ConfigError: `cfg.k` was not measured by the evaluation.
    """
    key, tau = _comparison(evaluation, cfg.k)
    checkpoint = evaluation.parents["checkpoint"]
    root = store.root / PROMOTIONS
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        best = best_promoted(read_promotions(store), key, other_than=checkpoint)
        error = _paired_error(evaluation, best, store) if best else None
        now = datetime.now(timezone.utc)
        record = PromotionRecord(
            run_id=run_id,
            recorded_at=now,
            key=key,
            checkpoint=checkpoint,
            checkpoint_path=store.artifact_dir(checkpoint),
            evaluation=evaluation.digest,
            tau=tau,
            tau_sim=evaluation.tau_sim,
            min_improvement=cfg.min_improvement,
            promoted=best is None or _beats(tau - best.tau, error, cfg),
            best_earlier_run_id=best.run_id if best else None,
            best_earlier_checkpoint=best.checkpoint if best else None,
            best_earlier_tau=best.tau if best else None,
            min_standard_errors=cfg.min_standard_errors,
            gain_standard_error=error,
        )
        atomic_write_text(root / f"{now:%Y%m%dT%H%M%S%f}-{run_id}.json", record.model_dump_json(indent=2))
    return record
