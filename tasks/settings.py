"""Prefect settings for every entry point that runs the flow (`eagle3 run`, the benchmarks)."""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["exit_cleanly_on_sigterm", "set_prefect_defaults"]


def set_prefect_defaults() -> None:
    """Defaults the environment can still override: a temporary server that may start slowly on two
    cores, no telemetry (offline GPU hosts log its failures, and its writes contend for the server's
    SQLite file), library warnings in the run's log."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "eagle3")


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`, a scheduler) exits through Python's shutdown, which runs the
    atexit hook that stops Prefect's temporary server. Python's default action skips it and leaves
    that server running; during a flow Prefect marks the run crashed, then re-sends the signal to
    the handler it found, this one."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
