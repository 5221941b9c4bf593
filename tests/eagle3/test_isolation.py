"""Child-process attempts and per-host device locks (no GPU needed: the mechanisms are the same)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from eagle3.runtime.attempts import ChildProcessFailed, run_attempt
from eagle3.runtime.devices import GPU_LOCK_DIR, host_gpu_uuids, lock_free_gpus
from eagle3.runtime.locks import exclusive_if_free
from eagle3.store.artifacts import ArtifactError

pytestmark = pytest.mark.slow  # child processes that import torch and transformers


class Steps(BaseModel):
    steps: int = 1


class Failure(BaseModel):
    kind: str


def report_devices(spec: Steps, on_progress) -> dict:
    for step in range(spec.steps):
        on_progress(step + 1, spec.steps)
    return {"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def fail_with(spec: Failure, on_progress) -> None:
    if spec.kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if spec.kind == "artifact":
        raise ArtifactError("/data/train.jsonl", "record 7: field 'messages' is missing")
    os.kill(os.getpid(), signal.SIGKILL)


def test_an_attempt_runs_in_a_child_that_sees_only_its_devices():
    progress = []

    result = run_attempt(report_devices, Steps(steps=3), ["2", "5"], lambda *p: progress.append(p))

    assert result["pid"] != os.getpid()
    assert result["visible"] == "2,5"
    assert progress == [(1, 3), (2, 3), (3, 3)]


def report_env(spec: Steps, on_progress) -> dict:
    return {name: os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "EAGLE3_TEST_USER_SET")}


def test_a_child_sets_the_variables_it_is_given_that_the_user_has_not(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("EAGLE3_TEST_USER_SET", "the user's")
    given = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "EAGLE3_TEST_USER_SET": "the step's"}

    seen = run_attempt(report_env, Steps(), ["0"], child_env=given)

    assert seen == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "EAGLE3_TEST_USER_SET": "the user's"}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # this process's own allocator is left as it was


def log_in_child(spec: Steps, on_progress) -> None:
    logging.getLogger("eagle3.extraction.extract_hidden_states").warning("waiting for shard %d", 3)
    logging.getLogger("eagle3.extraction.extract_hidden_states").debug("below the flow's level: not sent")
    logging.getLogger("other").warning("not the library's: stays in the child")


def test_a_child_s_library_log_records_are_logged_in_this_process(caplog):
    with caplog.at_level(logging.INFO, logger="eagle3"):
        run_attempt(log_in_child, Steps(), ["0"])

    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("eagle3.extraction.extract_hidden_states", logging.WARNING, "waiting for shard 3")
    ]


def test_without_devices_the_attempt_runs_in_this_process():
    assert run_attempt(report_devices, Steps(), None)["pid"] == os.getpid()


def test_out_of_memory_and_input_errors_come_back_as_themselves():
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB"):
        run_attempt(fail_with, Failure(kind="oom"), ["0"])
    with pytest.raises(ArtifactError, match="record 7: field 'messages'") as error:
        run_attempt(fail_with, Failure(kind="artifact"), ["0"])
    assert str(error.value.path) == "/data/train.jsonl"


def test_a_killed_child_is_an_error_with_its_exit_code():
    with pytest.raises(ChildProcessFailed, match=r"fail_with died in its child process \(exit code -9\)"):
        run_attempt(fail_with, Failure(kind="kill"), ["0"])


def report_then_work(spec: Steps, on_progress) -> None:
    on_progress(1, spec.steps)
    time.sleep(spec.steps)  # the rest of a long attempt, holding its GPUs


def test_a_failure_on_this_side_stops_the_child_instead_of_waiting_out_its_work():
    def unreachable_server(*_):
        raise ConnectionError("progress report failed")

    start = time.monotonic()
    with pytest.raises(ConnectionError, match="progress report failed"):
        run_attempt(report_then_work, Steps(steps=60), ["0"], unreachable_server)

    assert time.monotonic() - start < 30  # the child was stopped, not joined after its 60 s of work


def test_device_locks_hand_out_distinct_devices_and_wait_when_all_are_taken(tmp_path):
    with lock_free_gpus(["0", "1"], 1, tmp_path) as first, lock_free_gpus(["0", "1"], 1, tmp_path) as second:
        assert sorted(first + second) == ["0", "1"]
        with (
            pytest.raises(RuntimeError, match=r"no 1 free GPU\(s\) among \['0', '1'\]"),
            lock_free_gpus(["0", "1"], 1, tmp_path, timeout_s=0.5),
        ):
            pass
    with lock_free_gpus(["0", "1"], 2, tmp_path) as both:
        assert both == ["0", "1"]


def test_device_locks_are_where_every_run_on_the_host_looks_whatever_its_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    device = f"test-{os.getpid()}"

    with lock_free_gpus([device], 1):
        assert (GPU_LOCK_DIR / f"gpu-{device}.lock").exists() and not list(tmp_path.iterdir())


def test_without_a_deadline_a_claim_waits_as_long_as_the_holder_keeps_the_device(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="eagle3.runtime.devices")
    released = []

    def hold():
        with lock_free_gpus(["0"], 1, tmp_path):
            time.sleep(2.5)
            released.append(time.monotonic())

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.5)
    with lock_free_gpus(["0"], 1, tmp_path, timeout_s=None) as devices:
        got = time.monotonic()
    holder.join()

    assert devices == ["0"] and released and got >= released[0]
    assert "waiting for 1 free GPU(s) among ['0']: other runs on this host hold them" in caplog.text


def test_a_killed_holder_frees_its_devices_at_once(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from eagle3.runtime.devices import GPU_LOCK_DIR, lock_free_gpus\n"
        f"with lock_free_gpus(['0'], 1, Path({str(tmp_path)!r})):\n"
        "    print('held', flush=True); time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RuntimeError, match="no 1 free GPU"), lock_free_gpus(["0"], 1, tmp_path, timeout_s=0.5):
        pass

    holder.kill()
    holder.wait()
    start = time.monotonic()
    with lock_free_gpus(["0"], 1, tmp_path, timeout_s=5) as devices:
        assert devices == ["0"] and time.monotonic() - start < 1.5


def report_pid_then_wait(spec: Steps, on_progress) -> None:
    on_progress(os.getpid())
    time.sleep(120)


# A flow process that starts a GPU child and is then killed (SIGKILL: no cleanup of its own runs).
ORPHANING_PARENT = {
    "attempt": """
import sys
sys.path.insert(0, sys.argv[1])
from eagle3.runtime.attempts import run_attempt
from test_isolation import Steps, report_pid_then_wait
run_attempt(report_pid_then_wait, Steps(), ["0"], lambda pid: print(pid, flush=True))
""",
    "command": """
import subprocess, sys
from eagle3.runtime.attempts import dying_with_parent
subprocess.Popen(dying_with_parent([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"])).wait()
""",
}


def _gone(pid: int, within_s: float) -> bool:
    """Exited (or a zombie waiting for a reaper) within `within_s` seconds."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("kind", sorted(ORPHANING_PARENT))
def test_a_gpu_child_does_not_outlive_a_killed_flow_process(kind):
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING_PARENT[kind], os.path.dirname(__file__)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert not _gone(child, 0.5)  # alive while its parent is
        parent.kill()
        parent.wait()
        assert _gone(child, 20), f"the {kind} child outlived its killed parent"
    finally:
        if not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


FAKE_NVIDIA_SMI = """#!/bin/sh
# The driver's tool on a host of two GPUs, as much as host_gpu_uuids asks of it (listed out of bus order).
echo "00000000:1B:00.0, GPU-bbbb2222"
echo "00000000:0A:00.0, GPU-aaaa1111"
"""


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """Point PATH at a stand-in nvidia-smi (CI has no driver), or at none: `use(False)`."""
    with_tool, without = tmp_path / "with-nvidia-smi", tmp_path / "without-nvidia-smi"
    with_tool.mkdir()
    without.mkdir()
    (with_tool / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (with_tool / "nvidia-smi").chmod(0o755)

    def use(present: bool = True) -> None:
        monkeypatch.setenv("PATH", str(with_tool if present else without))
        host_gpu_uuids.cache_clear()

    yield use
    host_gpu_uuids.cache_clear()


def test_runs_naming_a_gpu_by_index_or_by_uuid_with_or_without_nvidia_smi_meet_at_a_lock(nvidia_smi, tmp_path):
    locks = tmp_path / "locks"
    nvidia_smi()

    with lock_free_gpus(["0", "1"], 1, locks) as by_index:
        assert by_index == ["0"]  # the names the run was given, for its children's CUDA_VISIBLE_DEVICES
        for told in (["GPU-aaaa1111"], ["GPU-aaaa"]):  # a UUID, or a prefix of one as CUDA takes
            with pytest.raises(RuntimeError, match="no 1 free GPU"), lock_free_gpus(told, 1, locks, timeout_s=0.3):
                pass
        with lock_free_gpus(["GPU-bbbb2222", "0"], 1, locks) as other:
            assert other == ["GPU-bbbb2222"]  # index 1 in bus order
        nvidia_smi(present=False)
        with pytest.raises(RuntimeError, match="no 1 free GPU"), lock_free_gpus(["0"], 1, locks, timeout_s=0.3):
            pass
    assert sorted(p.name for p in locks.iterdir()) == ["gpu-0.lock", "gpu-1.lock", "gpu-GPU-aaaa1111.lock", "gpu-GPU-bbbb2222.lock"]


def test_mig_instances_of_one_gpu_are_claimed_apart_and_a_held_name_frees_the_devices_other_names(nvidia_smi, tmp_path):
    locks = tmp_path / "locks"
    nvidia_smi()

    with lock_free_gpus(["MIG-a1", "MIG-a2"], 2, locks) as slices:
        assert slices == ["MIG-a1", "MIG-a2"]
    with exclusive_if_free(locks / "gpu-GPU-aaaa1111.lock", remove=False) as held_elsewhere:  # a run told the UUID, no nvidia-smi
        assert held_elsewhere
        with lock_free_gpus(["0", "1"], 1, locks) as free:
            assert free == ["1"]
            with exclusive_if_free(locks / "gpu-0.lock", remove=False) as index:
                assert index  # the claim of "0", refused on its UUID, let its index go at once
