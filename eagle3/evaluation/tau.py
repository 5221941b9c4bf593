"""Acceptance length from per-prompt counts: tau, its standard error, and one drafter's gain over another.

tau is all tokens over all verifier passes, each pass yielding its accepted draft tokens and one
of the verifier's own. A pass that crosses `max_new_tokens` or an EOS is credited with everything it
accepted, although decoding keeps only the tokens up to there: vLLM's spec-decode counters count
acceptance the same way (before its stop check), so both backends measure one thing, and a
prompt's tokens here can exceed its output by at most k. The prompt is the sampling unit (the
passes of one answer are not independent), so each prompt is kept as its (tokens, passes) and
errors are taken over prompts.
Pure Python with no torch: `eagle3 promoted` and the benches read these without loading a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3.evaluation.speculative import DecodeStats

__all__ = ["PER_PROMPT", "Counts", "gain_over", "per_prompt_counts", "read_counts", "tau_from_counts", "tau_standard_error"]

PER_PROMPT = "per_prompt.json"  # in an artifact: {method: {k: [[tokens, passes], ...] in prompt order}}
Counts = list[tuple[int, int]]  # each prompt's (tokens, verifier passes)


def per_prompt_counts(runs: list[DecodeStats]) -> Counts:
    """Each decode's (tokens, verifier passes) as tau counts them: every pass yields its accepted
    draft tokens and one of the verifier's own."""
    return [(sum(run.accepted_per_pass) + len(run.accepted_per_pass), len(run.accepted_per_pass)) for run in runs]


def read_counts(artifact: Path, method: str, k: int) -> Counts | None:
    """Each prompt's counts with `method` at k from an artifact's `per_prompt.json` (None: no
    such file, method or k)."""
    path = artifact / PER_PROMPT
    counts = json.loads(path.read_text()).get(method, {}).get(str(k)) if path.exists() else None
    return None if counts is None else [tuple(c) for c in counts]


def tau_from_counts(counts: Counts) -> float:
    """All tokens over all passes; 0.0 where no pass was made (every answer one token long, so
    nothing was drafted)."""
    passes = sum(p for _, p in counts)
    return sum(t for t, _ in counts) / passes if passes else 0.0


def _influences(counts: Counts) -> list[float]:
    """Each prompt's first-order share of tau (they sum to zero)."""
    tau, passes = tau_from_counts(counts), sum(p for _, p in counts)
    return [(t - tau * p) / passes for t, p in counts]


def _standard_error(influences: list[float]) -> float:
    n = len(influences)
    return (n / (n - 1) * sum(x * x for x in influences)) ** 0.5


def tau_standard_error(counts: Counts) -> float | None:
    """Standard error of tau over prompts: tau is a ratio of sums, linearised. tau +- 2 x this is
    roughly a 95% interval for tau over prompts like these. None with fewer than two prompts or
    no passes."""
    if len(counts) < 2 or sum(p for _, p in counts) == 0:
        return None
    return _standard_error(_influences(counts))


def gain_over(counts: Counts, baseline: Counts) -> tuple[float | None, float | None]:
    """tau of one drafter minus tau of another decoding the same prompts, and its standard error
    over prompts. Paired: a prompt both find easy lifts both taus, so the difference's error is
    usually smaller than the two errors combined as if independent. The error is None with fewer
    than two prompts; both are None where either made no verifier pass.

    Raises:
        ValueError: the two are of different numbers of prompts.
    """
    if len(counts) != len(baseline):
        raise ValueError(f"{len(counts)} prompts against a baseline of {len(baseline)}")
    if not all(sum(p for _, p in c) for c in (counts, baseline)):
        return None, None
    gain = tau_from_counts(counts) - tau_from_counts(baseline)
    if len(counts) < 2:
        return gain, None
    return gain, _standard_error([a - b for a, b in zip(_influences(counts), _influences(baseline))])
