"""A SIGTERM ends `eagle3 run` within 10 s even where the exception Prefect's handler raises for it
is lost: raised while the main thread runs a finalizer, Python prints "Exception ignored" and goes on
(a fault trial saw a run train on for 30 s after SIGTERM this way)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.settings import EXIT_DEADLINE_S

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each test waits out a real exit deadline

RUN = """
import signal, sys, time
from tasks.settings import exit_cleanly_on_sigterm

def lost(signum, frame):  # as Prefect's handler does during a flow: raise in the main thread
    raise RuntimeError("termination")

class Finalizer:
    def __del__(self):
        time.sleep(0.2)  # the signal lands here: its exception is printed and ignored

with exit_cleanly_on_sigterm():
    signal.signal(signal.SIGTERM, lost)
    print("ready", flush=True)
    while True:
        Finalizer()
"""


def test_a_sigterm_whose_exception_is_lost_in_a_finalizer_still_ends_the_process_within_10_s():
    run = subprocess.Popen([sys.executable, "-c", RUN], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout.readline() == "ready\n"
    time.sleep(0.5)

    run.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = run.wait(timeout=30)

    assert code == 128 + signal.SIGTERM and time.monotonic() - sent < 10
    assert "Exception ignored" in run.stderr.read()  # the handler's exception was lost: the deadline ended it


TURNED = """
import signal, sys, time
from tasks.settings import exit_cleanly_on_sigterm

def crash(signum, frame):  # as Prefect's handler does during a flow: raise in the main thread
    raise RuntimeError("termination")

with exit_cleanly_on_sigterm():
    signal.signal(signal.SIGTERM, crash)
    print("ready", flush=True)
    try:
        time.sleep(float(sys.argv[1]))
    except RuntimeError as exc:  # as Prefect's crash handling does before the task run exists
        raise ValueError("Task run is not set") from exc
    raise ValueError("a bug, no signal")
"""


def test_a_sigterm_that_turned_into_another_exception_still_exits_as_sigterm_does():
    run = subprocess.Popen([sys.executable, "-c", TURNED, "60"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout.readline() == "ready\n"

    run.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    assert run.wait(timeout=30) == 128 + signal.SIGTERM and time.monotonic() - sent < EXIT_DEADLINE_S  # not the deadline's exit
    assert run.stderr.read() == ""


SWALLOWED = """
import os, signal
from tasks.settings import exit_cleanly_on_sigterm

with exit_cleanly_on_sigterm():
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as speculators' trainer does: it saves and returns
    os.kill(os.getpid(), signal.SIGTERM)
    print("went on", flush=True)
print("reported success", flush=True)
"""


def test_a_sigterm_a_handler_swallowed_still_ends_the_process_as_sigterm_does_when_the_block_returns():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SWALLOWED], cwd=REPO, capture_output=True, text=True, timeout=30)

    assert (done.returncode, done.stdout) == (128 + signal.SIGTERM, "went on\n")
    assert time.monotonic() - started < EXIT_DEADLINE_S  # at the block's end, not at the deadline


def test_an_exception_without_a_sigterm_leaves_the_process_as_it_is():
    done = subprocess.run([sys.executable, "-c", TURNED, "0"], cwd=REPO, capture_output=True, text=True, timeout=30)

    assert done.returncode == 1 and "ValueError: a bug, no signal" in done.stderr


def test_a_second_sigterm_ends_the_process_at_once():
    run = subprocess.Popen([sys.executable, "-c", RUN], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert run.stdout.readline() == "ready\n"
    time.sleep(0.5)

    run.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    assert run.wait(timeout=30) == 128 + signal.SIGTERM and time.monotonic() - sent < 2


def test_outside_its_block_a_sigterm_is_the_previous_handlers_again():
    """`eagle3.cli.main` called in a process (as tests do) leaves no watcher behind: a SIGTERM that
    another handler survives later (speculators' saves a checkpoint and returns) ends nothing."""
    import threading

    from tasks.settings import exit_cleanly_on_sigterm

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with exit_cleanly_on_sigterm():
            pass
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert received == [signal.SIGTERM]
        assert not any(t.name == "eagle3-sigterm-watch" for t in threading.enumerate())
    finally:
        signal.signal(signal.SIGTERM, previous)
