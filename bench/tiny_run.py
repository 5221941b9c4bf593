"""The tiny run the CPU benchmarks drive: `eagle3 run` in its own process, on a 4-layer H64 random
Llama verifier (the tests' `tiny_llama`) and 40 bundled conversations, as `tests/conftest.py`'s
`tiny_run_config` sizes it: about 90 s on two cores from nothing, every step included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

__all__ = ["ROOT", "Finished", "git_sha", "make_inputs", "newest_run_record", "run_cli", "start_cli", "started_server"]


def make_inputs(work: Path) -> tuple[Path, Path]:
    """The tiny verifier and the conversations file, made once under `work`."""
    from tiny_models import SAMPLE, tiny_llama

    verifier, conversations = work / "verifier", work / "conversations.jsonl"
    if not (verifier / "config.json").exists():
        tiny_llama(verifier)
    if not conversations.exists():
        conversations.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    return verifier, conversations


def _env(prefect_home: Path, api_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return env | ({"PREFECT_API_URL": api_url} if api_url else {})


def start_cli(args: list[str], prefect_home: Path, log: Path, api_url: str | None = None) -> subprocess.Popen:
    """`eagle3 <args>` started in its own process group (a signal to the group reaches it and its
    children, not this script), output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "eagle3.cli", *args],
            cwd=ROOT,
            env=_env(prefect_home, api_url),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass
class Finished:
    returncode: int
    seconds: float
    output: str


def run_cli(args: list[str], prefect_home: Path, log: Path, api_url: str | None = None, timeout_s: float = 900) -> Finished:
    start = time.monotonic()
    run = start_cli(args, prefect_home, log, api_url)
    try:
        code = run.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.kill()
        code = run.wait()
    return Finished(code, time.monotonic() - start, log.read_text(errors="replace"))


class started_server:
    """A persistent `prefect server start` for the block, with its API URL."""

    def __init__(self, prefect_home: Path, port: int):
        self.home, self.port = prefect_home, port
        self.api_url = f"http://127.0.0.1:{port}/api"

    def __enter__(self) -> str:
        import urllib.request

        log = open(self.home / "server.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=_env(self.home, None),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{self.api_url}/health", timeout=2)
                return self.api_url
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prefect server start did not come up: {(self.home / 'server.log').read_text()[-2000:]}") from None
                time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def git_sha() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return sha + ("+uncommitted" if dirty else "")


def newest_run_record(store: Path) -> dict:
    """The last run's record in the store (`eagle3.store.runs`): the artifacts it reached."""
    return json.loads(sorted((store / "runs").glob("*.json"))[-1].read_text())
