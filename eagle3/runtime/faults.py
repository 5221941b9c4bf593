"""Failures made to happen on purpose, so the recovery paths run deterministically without the hardware."""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_OOM_ENV", "FAULT_PAUSE_AFTER_SHARDS_ENV", "pause_after_shards", "simulate_oom_above"]

# Raise the real torch.OutOfMemoryError for any prefill (or training, or regeneration) batch above
# this many tokens, so the back-off paths run without a GPU.
FAULT_OOM_ENV = "EAGLE3_FAULT_OOM_ABOVE_TOKENS"


def simulate_oom_above(tokens: int, what: str) -> None:
    """Raise torch.OutOfMemoryError if `tokens` exceeds the `FAULT_OOM_ENV` limit (when set)."""
    limit = os.environ.get(FAULT_OOM_ENV)
    if limit and tokens > int(limit):
        import torch

        raise torch.OutOfMemoryError(f"simulated out of memory: {what} > {FAULT_OOM_ENV}={limit}")


# Stop an extraction attempt's process (SIGSTOP) once it has finished this many shards, so that a test
# acts at a known point between shards (signals the engine, kills the attempt) instead of racing it.
FAULT_PAUSE_AFTER_SHARDS_ENV = "EAGLE3_FAULT_PAUSE_AFTER_SHARDS"


def pause_after_shards(finished: int) -> None:
    """Stop this process when `finished` equals the `FAULT_PAUSE_AFTER_SHARDS_ENV` count (when set)."""
    count = os.environ.get(FAULT_PAUSE_AFTER_SHARDS_ENV)
    if count and finished == int(count):
        os.kill(os.getpid(), signal.SIGSTOP)
