"""Shared fixtures: tiny real verifiers, a prepared dataset, and a real Prefect server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_llama, tiny_llava  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "eagle3" / "data" / "sample_conversations.jsonl"


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory) -> Path:
    """A 4-layer, hidden-64 random Llama with a ChatML byte-level tokenizer (vocab 1024)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_nested_verifier(tmp_path_factory) -> Path:
    return tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture
def conversations(tmp_path) -> Path:
    """40 GSM8K conversations in `messages` form, a copy the test may edit."""
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def publish_text_artifact(store, kind: str, content: str, parents: dict[str, str], manifest_type=None, **fields):
    """A one-file artifact with the given parents and manifest fields: lineage, gc and promotion
    tests need the graph and the manifest, not the payload."""
    from eagle3.store import ArtifactManifest

    work = store.work_dir(kind, content)
    (work / "data.txt").write_text(content)
    return store.publish(work, (manifest_type or ArtifactManifest)(kind=kind, path=work, parents=parents, **fields))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` (SQLite), with this process's Prefect client pointed at it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": url}
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(1)
    try:
        with temporary_settings(
            updates={PREFECT_API_URL: url, PREFECT_HOME: str(home), PREFECT_LOCAL_STORAGE_PATH: str(home / "storage")}
        ):
            yield url
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)  # send the last logs before the server stops
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
