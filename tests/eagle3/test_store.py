from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from conftest import LogSeen

from eagle3.runtime.locks import exclusive, exclusive_if_free
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.files import TEMP_SUFFIX, atomic_write_text

HOLD = """
import sys
from eagle3.store.artifacts import ArtifactStore
with ArtifactStore(sys.argv[1]).work_dir("dataset", "k" * 64) as work:
    print(work, flush=True)
    sys.stdin.read()  # until the test kills this process
"""


def test_a_run_waits_for_the_work_dir_another_run_holds_until_that_run_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    held_dir = holder.stdout.readline().strip()
    waiting = LogSeen("waiting for another run of step 'dataset'")
    logging.getLogger("eagle3").addHandler(waiting)
    entered = []

    def second_run():
        with ArtifactStore(tmp_path).work_dir("dataset", "k" * 64) as work:
            entered.append(work)

    thread = threading.Thread(target=second_run)
    try:
        thread.start()
        assert waiting.seen.wait(30), "the second run did not report that it waits"
        assert thread.is_alive() and not entered
        holder.kill()  # a killed run's lock goes with it
        thread.join(30)
    finally:
        logging.getLogger("eagle3").removeHandler(waiting)
        holder.kill()
        holder.wait()

    [work] = entered
    assert str(work) == held_dir  # entered only after the holder was killed: it was still waiting just before


def test_different_steps_and_inputs_do_not_wait_for_each_other(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.work_dir("dataset", "a" * 64) as a, store.work_dir("dataset", "b" * 64) as b, store.work_dir("draft", "a" * 64) as c:
        assert len({a, b, c}) == 3 and all(p.is_dir() for p in (a, b, c))


def test_lock_files_go_when_their_holders_finish(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.work_dir("dataset", "a" * 64), store.work_dir("draft", "b" * 64):
        assert len(list((tmp_path / "locks").iterdir())) == 2

    assert list((tmp_path / "locks").iterdir()) == []


def test_a_waiter_that_gets_a_removed_lock_file_waits_again_for_the_one_its_path_names(tmp_path):
    path = tmp_path / "step.lock"
    entered = threading.Event()

    def waiter():
        with exclusive(path, "the step"):
            entered.set()

    waiting = LogSeen("waiting for the step")
    logging.getLogger("eagle3").addHandler(waiting)
    with open(path, "a") as first:
        fcntl.flock(first, fcntl.LOCK_EX)
        thread = threading.Thread(target=waiter)
        thread.start()
        assert waiting.seen.wait(30), "the waiter did not report that it waits"  # it has the first file open
        # The holder removes the file and releases it; a third run creates the path anew and takes it
        # before the waiter wakes on the removed file.
        path.unlink()
        with open(path, "a") as third:
            fcntl.flock(third, fcntl.LOCK_EX)
            first.close()
            assert not entered.wait(1), "the waiter entered on the removed file while the path's file is held"
        thread.join(30)
    logging.getLogger("eagle3").removeHandler(waiting)

    assert entered.is_set()
    assert not path.exists()


def test_entering_a_work_dir_removes_a_write_a_killed_run_left_half_done(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.work_dir("dataset", "k" * 64) as work:
        atomic_write_text(work / "data.parquet", "finished")
        (work / "sub").mkdir()
        (work / "sub" / f".part.parquet.x1y2{TEMP_SUFFIX}").write_text("cut short")  # as atomic_write_bytes names it

    with store.work_dir("dataset", "k" * 64) as work:
        assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) == ["data.parquet", "sub"]


def test_a_stopwatch_does_not_count_the_wait_to_enter_a_claim():
    @contextmanager
    def slow_claim():
        time.sleep(1.0)
        yield ["0"]

    clock = Stopwatch()
    wall_start = clock.wall_start
    with clock.excluding_wait(slow_claim()) as devices:
        time.sleep(0.2)

    assert devices == ["0"]
    assert 0.2 <= clock() < 0.9
    assert clock.wall_start - wall_start >= 1.0  # training's time breakdown starts from here


@pytest.mark.timeout(30)
def test_a_lock_taken_only_if_free_never_waits(tmp_path):
    path = tmp_path / "shard.lock"
    with exclusive(path, "the shard"):
        with exclusive_if_free(path) as mine:
            assert not mine  # held by another holder: no wait, nothing held
        assert path.exists()

    with exclusive_if_free(path) as mine:
        assert mine and path.exists()
    assert not path.exists()
