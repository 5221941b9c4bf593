"""A run stopped by a signal, however it is delivered, is gone within 10 s, and so is every process
it started: the temporary Prefect server above all (202 MB, and it outlived a SIGKILLed run for
good), whatever step is running. SIGTERM comes from `kill`, `timeout` or a scheduler, to the run or
to its whole process group; SIGKILL from the kernel's OOM killer, to the run alone or to its server
(then the run stops, saying why)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_runs import alive, descendants, tiny_run_args

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0


def _wait_for(pattern: str, log: Path, run: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while not (match := re.search(pattern, log.read_text())):
        if run.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the run's output: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    return match


def _server_pid(port: str, timeout_s: float = 30) -> int:
    """The temporary server's process (Prefect's own says it starts one just before it does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if b"prefect.server.api.server:create_app" in args and port.encode() in args:
                return int(cmdline.parent.name)
        time.sleep(0.2)
    raise AssertionError(f"no temporary server process on port {port}")


def _survivors(pids: set[int], within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while (living := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return living


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["SIGTERM to the process group", "SIGTERM to the run", "SIGKILL to the run", "SIGKILL to the server"])
def test_a_signalled_run_and_every_process_it_started_are_gone_within_10_s(how, tiny_verifier, conversations, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the CLI's own temporary server
    env |= {"HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect")}
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "eagle3.cli", *tiny_run_args(tmp_path / "store", tiny_verifier, conversations)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, not pytest's
        )
    started: set[int] = set()
    try:
        port = _wait_for(r"(?:temporary Prefect server runs|Starting temporary server) on http://127\.0\.0\.1:(\d+)", log, run, 200)[1]
        server = _server_pid(port)
        _wait_for(r"Task run 'prepare-dataset-\w+' - Finished", log, run, 300)  # then extraction and training run
        started = descendants(run.pid) | {server}

        if how == "SIGTERM to the process group":
            os.killpg(run.pid, signal.SIGTERM)
        elif how == "SIGTERM to the run":
            run.send_signal(signal.SIGTERM)
        elif how == "SIGKILL to the run":
            run.kill()
        else:  # the server dies first (the OOM killer's pick): the run must not retry it for minutes
            os.kill(server, signal.SIGKILL)
        stopped_at = time.monotonic()

        expected = -signal.SIGKILL if how == "SIGKILL to the run" else 128 + signal.SIGTERM
        assert run.wait(timeout=GONE_WITHIN_S) == expected
        assert not _survivors(started, GONE_WITHIN_S - (time.monotonic() - stopped_at)), (
            f"{how}: processes of the run (the server is {server}) outlived it: {log.read_text()[-2000:]}"
        )
    finally:
        run.kill()
        for pid in started:  # nothing the test started outlives it, whatever failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
