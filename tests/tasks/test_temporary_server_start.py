"""What makes a fully cached rerun with the temporary server finish within 10 s on two cores
(`python bench/cached_rerun.py`): the server's process loads Prefect's server with the garbage
collector off and serves with it back on, and the run loads what its flow's start would while it
waits for the server. Each check runs in a fresh interpreter, as the run and its server do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each loads Prefect's server or its flow engine cold: seconds

SERVER_STATE = """
import gc, json, sys
import uvicorn.main
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
def serve():  # where uvicorn would start serving: report the collector's state instead
    print(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "collections": len(collections),
                      "server_loaded": "prefect.server.api.server" in sys.modules}))
uvicorn.main.main = serve
from tasks.server_process import main
main()
"""

FLOW_START = """
import json, sys
import flows.train_draft
from tasks.temporary_server import FLOW_START_MODULES, preload_flow_engine
before = [m for m in FLOW_START_MODULES if m in sys.modules]
preload_flow_engine()
print(json.dumps({"before": before, "after": [m for m in FLOW_START_MODULES if m in sys.modules], "all": list(FLOW_START_MODULES)}))
"""


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_server_process_loads_prefect_without_collecting_and_serves_with_the_collector_on():
    state = _run(SERVER_STATE)
    assert state["server_loaded"]
    assert state["collections"] == 0  # none while Prefect's server loaded
    assert state["enabled"]
    assert state["frozen"] > 100_000  # Prefect's server modules, out of the collector's way


def test_the_modules_preloaded_are_ones_the_flow_start_would_load_and_they_load():
    modules = _run(FLOW_START)
    assert {"prefect.flow_engine", "prefect.task_engine"} <= set(modules["all"])  # the slow ones: an empty list would pass the rest
    assert modules["before"] == []  # importing the flow does not load them: the flow's start would
    assert modules["after"] == modules["all"]
