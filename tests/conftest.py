"""Shared fixtures: tiny real verifiers, a prepared dataset, a real Prefect server and a real vLLM server."""

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


def wait_for_http(url: str, server: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll `url` until it answers; raise with the log's tail if `server` exits or time runs out."""
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{url} did not come up: {log_path.read_text()[-3000:]}") from None
            time.sleep(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served_draft(tmp_path_factory):
    """One real vLLM server for the session: a tiny verifier with a draft the pipeline exported."""
    from vllm_server import SERVED_NAME, ServedDraft, train_draft_for_serving, vllm_server

    root = tmp_path_factory.mktemp("served")
    store, verifier, hidden_states, checkpoint = train_draft_for_serving(root)
    with vllm_server(verifier.path, checkpoint.path, root / "vllm.log") as base_url:
        yield ServedDraft(base_url, SERVED_NAME, store, verifier, hidden_states, checkpoint)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` (SQLite), with this process's Prefect client pointed at it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": url}
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_for_http(f"{url}/health", server, home / "server.log", timeout_s=180)
    except RuntimeError:
        server.kill()
        raise
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
