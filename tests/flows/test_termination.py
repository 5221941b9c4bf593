"""A run stopped by SIGTERM (`kill`, `timeout`, a scheduler) takes down the temporary Prefect
server it started instead of leaving it running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _wait_for(pattern: str, log: Path, run: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while not (match := re.search(pattern, log.read_text())):
        if run.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the run's output: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    return match


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_sigterm_during_a_flow_stops_the_temporary_server(tiny_verifier, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the CLI's own temporary server
    env |= {"HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect")}
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "eagle3.cli", "run", f"store_dir={tmp_path / 'store'}", f"verifier.path={tiny_verifier}"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    server = None
    try:
        server = _wait_for(r"Starting temporary server on (http://127\.0\.0\.1:(\d+))", log, run, 200)
        _wait_for(r"Beginning flow run", log, run, 60)
        health = f"{server[1]}/api/health"
        assert _answers(health)

        run.send_signal(signal.SIGTERM)

        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _answers(health), f"the temporary server still answers after the run ended: {log.read_text()[-2000:]}"
    finally:
        run.kill()
        if server is not None:  # a server left behind must not outlive the test
            subprocess.run(["pkill", "-f", f"uvicorn.*--port {server[2]}"], check=False)
