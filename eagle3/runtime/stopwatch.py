"""How long a step took, not counting the time it spent waiting for another run or for a GPU."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

__all__ = ["Stopwatch"]

T = TypeVar("T")


class Stopwatch:
    """Seconds since construction, for manifests' `seconds`, less any time spent waiting to enter
    something through `excluding_wait` (a GPU another run holds is not this step's time)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.wall_start = time.time()  # the same moment by the wall clock, moved by the same waits

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 3)

    @contextmanager
    def excluding_wait(self, manager: AbstractContextManager[T]) -> Iterator[T]:
        """Enter `manager` without counting the wait to enter it."""
        before = time.perf_counter()
        with manager as value:
            waited = time.perf_counter() - before
            self.start += waited
            self.wall_start += waited
            yield value
