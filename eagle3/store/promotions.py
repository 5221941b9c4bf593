"""The promotion registry: every run's decision on its checkpoint, kept in the store as
`promotions/<time>-<run id>.json`, where later runs, `eagle3 promoted`, gc and warm starts find the
checkpoints to keep and serve without a server. The decision itself is evaluation's
(`eagle3.evaluation.promotion`); this module only reads and appends records, so it needs neither
torch nor the steps that measure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3.config import EvalConfig
from eagle3.figures import with_error
from eagle3.runtime.locks import exclusive
from eagle3.store.artifacts import ArtifactError, ArtifactStore, read_manifest_record
from eagle3.store.files import atomic_write_text
from eagle3.store.manifests import MANIFEST

__all__ = [
    "PROMOTIONS",
    "ComparisonKey",
    "PromotionRecord",
    "best_promoted",
    "promoted_checkpoints",
    "promoted_drafts",
    "promotions_held",
    "read_promotions",
    "record_promotion",
]

PROMOTIONS = "promotions"
logger = logging.getLogger(__name__)


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
    tau_sim: float | None = Field(description="tau simulated from training metrics, for comparison (None: a draft trained elsewhere)")
    min_improvement: float
    promoted: bool
    best_earlier_run_id: str | None = None
    best_earlier_checkpoint: str | None = None
    best_earlier_tau: float | None = None
    min_standard_errors: float = 0.0  # the bar in standard errors, applied where gain_standard_error is measured
    ngram_tau: float | None = Field(None, description="n-gram prompt lookup's tau at key.k on the same prompts (None: not measured)")
    min_gain_over_ngram: float = 0.0
    beats_ngram: bool | None = Field(
        None, description="whether tau beats ngram_tau by more than min_gain_over_ngram (None: no n-gram baseline to check)"
    )
    gain_standard_error: float | None = Field(
        None,
        description="standard error of tau minus best_earlier_tau, paired over the prompts (None: no best "
        "earlier; either evaluation kept no per-prompt counts, as backend 'vllm' and evaluations made before they "
        "were kept, or was deleted; fewer than two prompts; or no verifier pass)",
    )

    def summary(self) -> str:
        measured = f"tau {self.tau:.3f} at k={self.key.k} on {self.key.num_prompts} prompts"
        if self.tau == 0:  # tau_from_counts' value where no verifier pass was made
            return (
                f"not promoted: no verifier pass on {self.key.num_prompts} prompts at max_new_tokens={self.key.max_new_tokens}: "
                "every answer was one token long, so nothing was drafted to measure; raise evaluate.max_new_tokens"
            )
        if self.tau <= 1:  # a server's counters give 1 where nothing was drafted, too
            return f"not promoted: {measured}: no drafted token was accepted, so the draft saves no verifier pass"
        if self.beats_ngram is False:
            return (
                f"not promoted: {measured} does not beat n-gram prompt lookup's tau {self.ngram_tau:.3f} on the same prompts"
                + (f" by more than {self.min_gain_over_ngram}" if self.min_gain_over_ngram else "")
                + ": not worth serving, since n-gram lookup needs no training"
            )
        unchecked_ngram = "; n-gram lookup not measured here, so not compared" if self.beats_ngram is None else ""
        if self.best_earlier_tau is None:
            return f"promoted: {measured}; first checkpoint evaluated on this verifier and eval set{unchecked_ngram}"
        if self.best_earlier_checkpoint is None:
            raise ValueError(f"promotion record of {self.checkpoint}: best_earlier_tau is set without its best_earlier_checkpoint")
        verdict = "promoted" if self.promoted else "not promoted"
        beats = "beats" if self.promoted else "does not beat"
        bar, unchecked = f"more than {self.min_improvement}", ""
        if self.min_standard_errors and self.gain_standard_error is not None:
            bar += f" and {self.min_standard_errors} standard errors"
        elif self.min_standard_errors:
            unchecked = f" ({self.min_standard_errors} standard errors not checked: no paired standard error measured)"
        gain = with_error(self.tau - self.best_earlier_tau, self.gain_standard_error, signed=True)
        return (
            f"{verdict}: {measured} {beats} the best earlier promoted tau {self.best_earlier_tau:.3f} "
            f"(checkpoint {self.best_earlier_checkpoint[:12]}) by {bar}: {gain}{unchecked}{unchecked_ngram}"
        )


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
    # Each key is some promoted record's, so best_promoted finds one for it.
    return sorted((cast(PromotionRecord, best_promoted(records, key)) for key in keys), key=lambda r: r.recorded_at)


def promoted_drafts(store: ArtifactStore, best_records: list[PromotionRecord]) -> set[str]:
    """Digests of the drafts the promoted checkpoints of `best_records` (`promoted_checkpoints`) were
    exported from (a checkpoint's `draft` parent): what a warm start prefers and gc keeps. A damaged
    checkpoint manifest names none."""
    drafts = set()
    for best in best_records:
        if (path := store.artifact_dir(best.checkpoint) / MANIFEST).exists():
            try:
                drafts.add(read_manifest_record(path).get("parents", {}).get("draft"))
            except ArtifactError as exc:
                logger.warning("%s", str(exc).splitlines()[0])
    return drafts - {None}


@contextmanager
def promotions_held(store: ArtifactStore) -> Iterator[list[PromotionRecord]]:
    """Every recorded decision, oldest first, held so that no other run records one until the block
    ends: two runs that finish together decide one after the other."""
    root = store.root / PROMOTIONS
    root.mkdir(exist_ok=True)
    with exclusive(root / ".lock", "another run's promotion decision"):
        yield read_promotions(store)


def record_promotion(store: ArtifactStore, record: PromotionRecord) -> Path:
    """Append a decision to the registry (inside `promotions_held`); returns its file."""
    path = store.root / PROMOTIONS / f"{record.recorded_at:%Y%m%dT%H%M%S%f}-{record.run_id}.json"
    atomic_write_text(path, record.model_dump_json(indent=2))
    return path
