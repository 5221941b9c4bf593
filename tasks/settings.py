"""Prefect settings for every entry point that runs the flow (`eagle3 run`, the benchmarks)."""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["exit_cleanly_on_sigterm", "set_prefect_defaults", "tracebacks_to"]


def set_prefect_defaults() -> None:
    """Defaults the environment can still override: a temporary server that may start slowly on two
    cores, no telemetry (offline GPU hosts log its failures, and its writes contend for the server's
    SQLite file), the library's log lines in the run's log."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "eagle3")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # outside a run (`eagle3 plan`): the terminal only


EXIT_DEADLINE_S = 8.0  # after SIGTERM; a run must be gone within 10 s however the signal came
SIGNAL_SEEN_S = 1.0  # how long the block's end waits for the watcher to read the signals that arrived before it
CAUGHT_UP = 0  # a byte no signal writes to the wakeup fd (there is no signal 0): the watcher reports reading it


@contextmanager
def exit_cleanly_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM (`kill`, `timeout`, a scheduler) exits through Python's
    shutdown, which runs the atexit hooks: Prefect's workers send their last logs, then the
    temporary server stops. Python's default action skips them. During a flow Prefect's own handler
    marks the run crashed by raising in the main thread, then re-sends the signal to the handler it
    found, this one.

    That exception can be lost: raised while the main thread runs a finalizer (`__del__`), Python
    prints "Exception ignored" and the run goes on. So the deadline does not wait for a handler: the
    signal's arrival is read from the interpreter's wakeup fd by a thread of its own, which ends
    the process `EXIT_DEADLINE_S` later whatever the main thread does, and at once on a second
    SIGTERM. Children (the temporary server, a step's child process) get SIGTERM from the kernel as
    it dies. Afterwards the previous handler and wakeup fd are back (a test calling `eagle3.cli.main`
    leaves its process as it found it). Enter from the main thread.

    The exception can also turn into another: a SIGTERM that lands while Prefect creates a task run
    makes its crash handling raise `ValueError: Task run is not set`, which fails the flow instead.
    An exception that leaves the block after a SIGTERM arrived exits as SIGTERM does, 128 + 15, and
    so does a block that returns after one: a handler may swallow it (speculators' trainer saves and
    returns on SIGTERM, and in the window after its last epoch our check of the epochs passes): a
    process told to stop does not report success."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    terminated, caught_up = threading.Event(), threading.Event()
    threading.Thread(target=_exit_deadline, args=(read, terminated, caught_up), name="eagle3-sigterm-watch", daemon=True).start()

    def sigterm_arrived() -> bool:
        """A signal's byte is in the pipe before any handler runs, and the watcher reads the pipe in
        order: once it has read a byte written now, it has read every signal's before it."""
        os.write(write, bytes([CAUGHT_UP]))
        caught_up.wait(timeout=SIGNAL_SEEN_S)
        return terminated.is_set()

    try:
        yield
    except Exception as exc:
        if sigterm_arrived():
            raise SystemExit(128 + signal.SIGTERM) from exc
        raise
    else:
        if sigterm_arrived():
            raise SystemExit(128 + signal.SIGTERM)
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous)
        os.close(write)  # the watcher reads the end of the pipe and stops


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signum)


def _exit_deadline(wakeup: int, terminated: threading.Event, caught_up: threading.Event) -> None:
    """Started by the first SIGTERM that reaches the process (it sets `terminated`), ends it
    `EXIT_DEADLINE_S` later; a second ends it at once. Sets `caught_up` on reading `CAUGHT_UP`.
    Returns when the pipe is closed."""
    code = 128 + signal.SIGTERM
    deadline: threading.Timer | None = None
    while arrived := os.read(wakeup, 64):  # one byte per signal that arrived, its number
        for signum in arrived:
            if signum == CAUGHT_UP:
                caught_up.set()
            if signum != signal.SIGTERM:
                continue
            terminated.set()
            if deadline is not None:
                os._exit(code)
            deadline = threading.Timer(EXIT_DEADLINE_S, os._exit, args=(code,))
            deadline.daemon = True
            deadline.start()
    os.close(wakeup)


class _WithoutTraceback(logging.Formatter):
    """Another formatter's output, less the traceback (the record itself is left whole: the
    handlers after this one, Prefect's API log among them, still get it)."""

    def __init__(self, inner: logging.Formatter, log_file: Path):
        super().__init__()
        self.inner, self.log_file = inner, log_file

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text):
            return self.inner.format(record)
        bare = copy.copy(record)
        bare.exc_info, bare.exc_text, bare.stack_info = None, None, None
        return f"{self.inner.format(bare)} (traceback: {self.log_file})"


@contextmanager
def tracebacks_to(log_file: Path) -> Iterator[None]:
    """While the block runs, the terminal gets each log line without its traceback, and `log_file`
    gets every line with it (as does the Prefect server's log of the run). A failing step made
    Prefect print up to ten tracebacks (120 lines) before the one line that says what to fix."""
    formatters = {h: h.formatter for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler) and h.formatter is not None}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_file, delay=True)
    to_file.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
    logging.getLogger().addHandler(to_file)
    for handler, formatter in formatters.items():
        handler.setFormatter(_WithoutTraceback(formatter, log_file))
    try:
        yield
    finally:
        for handler, formatter in formatters.items():
            handler.setFormatter(formatter)
        logging.getLogger().removeHandler(to_file)
        to_file.close()
