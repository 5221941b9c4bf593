"""Deployments registered against the real server, a tiny run config, and a real process worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def deployments(prefect_server):
    """prefect.yaml registered by deployments/register.sh (once: it costs about a minute)."""
    from prefect.client.orchestration import get_client

    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    done = subprocess.run([str(ROOT / "deployments" / "register.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with get_client(sync_client=True) as client:
        return {
            name: client.read_deployment_by_name(f"train-eagle3-draft/{name}")
            for name in ("train-on-demand", "scheduled-retrain")
        }


@pytest.fixture
def tiny_run_config(tiny_verifier, conversations, tmp_path) -> dict:
    """`config` for a deployment run that finishes in about 90 s on 2 cores."""
    return {
        "store_dir": str(tmp_path / "store"),
        "verifier": {"path": str(tiny_verifier)},
        "dataset": {"path": str(conversations), "max_seq_len": 256},
        "extract": {"aux_layer_ids": [1, 2, 3]},
        "vocab": {"draft_vocab_size": 512},
        "train": {"epochs": 1, "total_seq_len": 512},
        "evaluate": {"num_prompts": 1, "max_new_tokens": 8, "ks": [3]},
    }


@pytest.fixture
def start_worker(prefect_server, tmp_path):
    """Starts a real process worker that takes the pool's due runs once, runs them and exits.

    Returns its log file; start it after the run exists, or it finds nothing and exits.
    """
    log_path = tmp_path / "worker.log"
    workers = []

    def start() -> Path:
        env = {**os.environ, "PREFECT_API_URL": prefect_server}
        with open(log_path, "w") as log:
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "eagle3", "--run-once"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
        return log_path

    yield start
    for worker in workers:
        worker.terminate()
        worker.wait(timeout=60)
