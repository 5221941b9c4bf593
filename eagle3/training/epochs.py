"""Each epoch's validation figures, and which epoch's weights the draft ships.

The simulated acceptance length of an epoch is `1 + sum_j prod_{i<=j} cond_acc_i` over the TTT
steps, from its validation accuracies on the held-out split. The draft ships the epoch with the
highest (the later on a tie), not the last: on the SmolLM2 runs in bench/results tau_sim moved by
0.016 over the last 5 of 15 epochs, and a run that overfits peaks before its end. tau_sim is the
held-out estimate evaluation's measured tau follows (bench/results: the recipes that rank higher
on tau_sim rank higher on measured tau), and it costs nothing beyond validation, where measuring
tau per epoch would decode every eval prompt once per epoch.
"""

from __future__ import annotations

import math

__all__ = ["best_epoch", "epoch_summaries", "simulated_acceptance_length"]


def simulated_acceptance_length(cond_acc: list[float]) -> float:
    """Expected tokens per verifier pass for a chain draft: 1 + sum_j prod_{i<=j} cond_acc_i."""
    return 1.0 + sum(math.prod(cond_acc[: j + 1]) for j in range(len(cond_acc)))


def epoch_summaries(records: list[dict], ttt_steps: int) -> list[dict[str, float]]:
    """Validation figures per epoch, in epoch order (the last report wins where a resume repeated one)."""
    summaries: dict[int, dict[str, float]] = {}
    for record in records:
        if "val" not in record:
            continue
        val = record["val"]
        cond = [val[f"cond_acc_{k}_epoch"] for k in range(ttt_steps)]
        summary = {"epoch": record["epoch"], "val_loss": val["loss_epoch"], "tau_sim": simulated_acceptance_length(cond)}
        summary.update({f"full_acc_{k}": val[f"full_acc_{k}_epoch"] for k in range(ttt_steps)})
        summary.update({f"cond_acc_{k}": c for k, c in enumerate(cond)})
        summaries[record["epoch"]] = summary
    return [summaries[e] for e in sorted(summaries)]


def best_epoch(summaries: list[dict[str, float]]) -> int | None:
    """The validated epoch with the highest tau_sim, the later on a tie (None: none validated)."""
    if not summaries:
        return None
    return int(max(summaries, key=lambda s: (s["tau_sim"], s["epoch"]))["epoch"])
