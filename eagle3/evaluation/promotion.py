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
to the store's promotion registry (`eagle3.store.promotions`), where later runs and `eagle3
promoted` find it without a server.
A re-run of the same checkpoint does not count its own earlier records: while nothing better has
been promoted since, it stays promoted. Whatever the history, a draft whose tau does not beat n-gram
prompt lookup's on the same prompts (by `min_gain_over_ngram`) is not promoted: n-gram lookup needs
no training, so such a draft is not worth serving, and the summary says so; nor is one whose tau
is not above 1 (no drafted token accepted, or, at 0, no verifier pass: nothing drafted to measure).
"""

from __future__ import annotations

from datetime import UTC, datetime

from eagle3.config import ConfigError, PromotionConfig
from eagle3.evaluation.evaluate import EvalManifest
from eagle3.evaluation.tau import gain_over, read_counts
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import MANIFEST
from eagle3.store.promotions import ComparisonKey, PromotionRecord, best_promoted, promotions_held, record_promotion

__all__ = ["promote"]


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
    key = ComparisonKey(
        verifier=evaluation.parents["verifier"],
        prompts=evaluation.parents["prompts"],
        k=k,
        max_new_tokens=settings["max_new_tokens"],
        num_prompts=evaluation.num_prompts,
        **{name: settings[name] for name in ("backend", "dtype") if name in settings},
    )
    return key, taus[k]


def _against_ngram(evaluation: EvalManifest, k: int, cfg: PromotionConfig) -> tuple[float | None, bool | None]:
    """n-gram prompt lookup's tau at k on the evaluation's prompts, and whether the draft beats it by
    more than `cfg.min_gain_over_ngram` (None, None: the evaluation measured no n-gram baseline)."""
    ngram = next((r["tau"] for r in evaluation.results if r["method"] == "ngram" and r["k"] == k), None)
    gain = next((g["gain"] for g in evaluation.gains_over_ngram or [] if g["k"] == k and g["gain"] is not None), None)
    if ngram is None or gain is None:
        return None, None
    return ngram, gain > cfg.min_gain_over_ngram


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
    with promotions_held(store) as records:
        ngram_tau, beats_ngram = _against_ngram(evaluation, key.k, cfg)
        best = best_promoted(records, key, other_than=checkpoint)
        error = _paired_error(evaluation, best, store) if best else None
        now = datetime.now(UTC)
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
            promoted=tau > 1 and beats_ngram is not False and (best is None or _beats(tau - best.tau, error, cfg)),
            ngram_tau=ngram_tau,
            min_gain_over_ngram=cfg.min_gain_over_ngram,
            beats_ngram=beats_ngram,
            best_earlier_run_id=best.run_id if best else None,
            best_earlier_checkpoint=best.checkpoint if best else None,
            best_earlier_tau=best.tau if best else None,
            min_standard_errors=cfg.min_standard_errors,
            gain_standard_error=error,
        )
        record_promotion(store, record)
    return record
