"""GPU claims against a real Prefect server (the claim itself needs no GPU)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3.cli import main
from tasks.gpu import GPU_LIMIT, LEASE_SECONDS, claim_gpus, ensure_gpu_limit, gpu_slots, persistent_server
from tasks.temporary_server import TEMPORARY_API_URL

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


@pytest.fixture
def no_gpu_limit(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    def delete():
        with get_client(sync_client=True) as client, contextlib.suppress(ObjectNotFound):
            client.delete_global_concurrency_limit_by_name(GPU_LIMIT)

    delete()
    yield
    delete()


def test_claiming_without_the_limit_is_an_error_naming_the_fix(no_gpu_limit):
    with pytest.raises(RuntimeError, match=r"concurrency limit 'gpu'.*`eagle3 gpu-limit`"), claim_gpus("cuda"):
        pass


def _slots() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit


def test_a_gpu_hosts_first_run_creates_the_limit_and_later_runs_keep_what_its_owner_set(no_gpu_limit, capsys):
    ensure_gpu_limit(2)
    assert _slots() == 2
    assert "created the Prefect concurrency limit 'gpu' with 2 slot(s), one per GPU here" in capsys.readouterr().err

    assert main(["gpu-limit", "--gpus", "1"]) == 0
    ensure_gpu_limit(8)
    assert _slots() == 1
    assert "created" not in capsys.readouterr().err


def test_claims_on_one_gpu_slot_never_overlap(no_gpu_limit):
    assert main(["gpu-limit", "--gpus", "1"]) == 0
    spans = []

    def hold():
        with gpu_slots(1):
            start = time.monotonic()
            time.sleep(1.5)
            spans.append((start, time.monotonic()))

    # Each thread runs in a copy of this context, which holds the test server's Prefect settings.
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(hold,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    (_a_start, a_end), (b_start, _b_end) = sorted(spans)
    assert b_start >= a_end


def test_cpu_steps_claim_nothing(no_gpu_limit):
    with claim_gpus("cpu") as devices:
        assert devices is None


def _active_slots() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots


def test_a_failing_step_releases_its_slots(no_gpu_limit):
    assert main(["gpu-limit", "--gpus", "2"]) == 0

    with pytest.raises(ZeroDivisionError), gpu_slots(2):
        assert _active_slots() == 2
        raise ZeroDivisionError

    assert _active_slots() == 0


def test_a_killed_holders_slots_return_when_its_lease_expires(no_gpu_limit, prefect_server):
    assert main(["gpu-limit", "--gpus", "1"]) == 0
    code = "import time; from tasks.gpu import gpu_slots\nwith gpu_slots(1):\n    print('held', flush=True); time.sleep(600)\n"
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "PREFECT_API_URL": prefect_server}
    )
    assert holder.stdout.readline().strip() == "held"
    assert _active_slots() == 1

    holder.kill()
    holder.wait()
    deadline = time.monotonic() + LEASE_SECONDS + 90
    while _active_slots() and time.monotonic() < deadline:
        time.sleep(2)

    assert _active_slots() == 0
    with gpu_slots(1):
        assert _active_slots() == 1


def test_only_a_server_named_by_prefect_api_url_and_not_started_by_the_run_is_persistent(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv(TEMPORARY_API_URL, raising=False)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert persistent_server()
        monkeypatch.setenv(TEMPORARY_API_URL, "http://127.0.0.1:4200/api")  # `eagle3 run` started it
        assert not persistent_server()
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # Prefect starts a temporary server of its own
        assert not persistent_server()


def test_gpu_limit_without_a_persistent_server_says_runs_take_no_slots(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv(TEMPORARY_API_URL, raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["gpu-limit", "--gpus", "1"]) == 2
    assert "PREFECT_API_URL names no server: runs with a temporary one take no GPU slots" in capsys.readouterr().err


HOLD = """
import sys, time
from tasks.settings import set_prefect_defaults
set_prefect_defaults()
from tasks.gpu import ensure_gpu_limit, gpu_slots
ensure_gpu_limit(1)
with gpu_slots(1):
    print("held", flush=True)
    time.sleep(float(sys.argv[1]))
"""


def test_with_a_temporary_server_a_killed_runs_claim_does_not_hold_back_the_next_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", TEMPORARY_API_URL)}
    env["PREFECT_HOME"] = str(tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD, "600"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert first.stdout.readline().strip() == "held"
    os.killpg(first.pid, signal.SIGKILL)  # the run and its temporary server, as when a job's processes are killed
    first.wait()

    second = subprocess.run([sys.executable, "-c", HOLD, "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)

    assert second.stdout.strip() == "held", second.stderr[-3000:]
