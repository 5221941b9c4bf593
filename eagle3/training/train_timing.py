"""Where a training step's wall time goes, read from the timing log its rank-0 process writes.

The log holds one line per optimizer step (speculators' step timer: `step_ms` from the end of the
previous step to the end of this one's optimizer update, `fetch_ms` of it waiting for the batch)
and one per validation epoch, each stamped with the wall clock (`ended_at`) when it was logged.
On a GPU the optimizer steps can be a small part of the whole: launch, imports, data-loader
workers, `torch.compile` and kernel autotuning in the first step, validation and checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.training.metrics_log import read_log

__all__ = ["median_tokens_per_s", "time_breakdown"]


def _records(timing_log: Path) -> list[dict]:
    return read_log(timing_log)  # a line a kill cut short is left out


def median_tokens_per_s(timing_log: Path) -> float | None:
    """Median training tokens per second over the optimizer steps (None: no step was timed)."""
    rates = sorted(r["tokens_per_s"] for r in _records(timing_log) if "tokens_per_s" in r)
    return rates[len(rates) // 2] if rates else None


def time_breakdown(timing_log: Path, started_at: float, ended_at: float) -> dict[str, float]:
    """Seconds from `started_at` to `ended_at` split into: `startup` (before the first step began:
    launch, imports, model), `first_step` (compile and autotuning on GPU), `steps` (all other
    optimizer steps, an out-of-memory relaunch's first step included), `validation` (with the epoch
    checkpoint speculators saves just before it) and `other` (epoch boundaries, a relaunch's
    startup, export). `waiting_for_data` is the part of the steps, the first one included, spent
    fetching batches (on a GPU the first fetch starts the data-loader workers)."""
    parts = dict.fromkeys(("startup", "first_step", "steps", "waiting_for_data", "validation"), 0.0)
    previous, first = started_at, True
    for record in _records(timing_log):
        if record["ended_at"] < started_at or not (record["validation"] or "step_ms" in record):
            continue  # an interrupted earlier run's, resumed by this one; or no step (speculators' CLI logs its config)
        gap = record["ended_at"] - previous
        previous = record["ended_at"]
        if record["validation"]:
            parts["validation"] += gap
            continue
        step = min(record["step_ms"] / 1000, gap)
        if first:
            parts["startup"], parts["first_step"], first = gap - step, step, False
        else:
            parts["steps"] += step
        parts["waiting_for_data"] += min(record["fetch_ms"] / 1000, step)
    parts["other"] = (ended_at - started_at) - sum(v for k, v in parts.items() if k != "waiting_for_data")
    return {k: round(v, 3) for k, v in parts.items()}
