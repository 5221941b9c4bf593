"""File locks: the one primitive behind every lock of the pipeline.

Each lock is an flock on a file, which the kernel drops the moment its holder dies, however it
dies, so no lock outlives a killed run. Who holds what:

- a step's work directory and each hidden-state shard (`exclusive`, `exclusive_if_free`): one run
  does the work, another waits for it or turns to other work meanwhile;
- the store's promotion records (`exclusive`): two runs decide one after the other;
- a running flow holds the store (`shared`), and `eagle3 artifacts gc` runs only while none does
  (`exclusive_if_free`);
- a GPU of this host (`exclusive_if_free`), for as long as a step's claim on it.

A lock keyed by work (a step's inputs, a shard) is removed by its holder before it lets go, so
lock files do not pile up (a killed holder's stays until the next holder is done); a waiter that
then gets the lock on the removed file tries again on whatever file the path names now. Locks on
fixed things (the store, a GPU) pass `remove=False`.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, overload

__all__ = ["exclusive", "exclusive_if_free", "shared"]

logger = logging.getLogger(__name__)


@contextmanager
def exclusive(lock: Path, what: str, remove: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the file `lock` (created if missing); while another process holds
    it, log that this one is waiting for `what`, then wait. Yields whether it had to wait."""
    handle, waited = _acquire(lock, fcntl.LOCK_EX, what)
    try:
        yield waited
    finally:
        _release(lock, handle, remove)


@contextmanager
def exclusive_if_free(lock: Path, remove: bool = True) -> Iterator[bool]:
    """`exclusive` without the wait: yields whether this process got the lock (False, holding
    nothing, while another process holds it)."""
    acquired = _acquire(lock, fcntl.LOCK_EX, None)
    if acquired is None:
        yield False
        return
    try:
        yield True
    finally:
        _release(lock, acquired[0], remove)


@contextmanager
def shared(lock: Path, what: str) -> Iterator[None]:
    """Hold a shared lock on `lock`, beside any other shared holders, waiting out an exclusive one."""
    handle, _ = _acquire(lock, fcntl.LOCK_SH, what)
    try:
        yield
    finally:
        _release(lock, handle, remove=False)


@overload
def _acquire(lock: Path, mode: int, what: str) -> tuple[IO, bool]: ...
@overload
def _acquire(lock: Path, mode: int, what: None) -> tuple[IO, bool] | None: ...
def _acquire(lock: Path, mode: int, what: str | None) -> tuple[IO, bool] | None:
    """The open, locked file `lock` names and whether getting it meant waiting; None instead of
    waiting when `what` is None."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        handle = open(lock, "a")  # noqa: SIM115 - the locked handle outlives this call: _release closes it
        try:
            try:
                fcntl.flock(handle, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                if what is None:
                    handle.close()
                    return None
                if not waited:
                    logger.warning("waiting for %s (%s is held by another process)", what, lock)
                waited = True
                fcntl.flock(handle, mode)
        except BaseException:
            handle.close()
            raise
        if _path_still_names(lock, handle):
            return handle, waited
        handle.close()
        waited = True  # the file was removed under us: another run held the lock and finished


def _release(lock: Path, handle: IO, remove: bool) -> None:
    try:
        if remove:
            lock.unlink(missing_ok=True)  # before unlocking: see the module docstring
    finally:
        handle.close()  # closing the descriptor drops its flock


def _path_still_names(path: Path, handle: IO) -> bool:
    """Whether `path` still names the open file `handle`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
