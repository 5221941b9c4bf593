"""The logs a training appends to, one JSON object a line: `metrics.jsonl` (speculators' records, one
per step and per validation) and `timing.jsonl` (when each arrived, and the step timer's figures).

Appends are not atomic: a kill, or a disk that fills mid-write, leaves the last line cut short, and
the next run's first append would then land on the same line. Readers here drop such a line (and
any other line that is not a JSON object, naming the file and line) instead of failing every later
run; `rewrite_log` writes a log back whole, atomically, before a resumed run appends to it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from eagle3.store.files import atomic_write_text

__all__ = ["log_lines", "read_log", "rewrite_log"]

logger = logging.getLogger(__name__)


def log_lines(path: Path) -> list[tuple[str, dict]]:
    """Each readable line of the log with its record, in order (none: no such file)."""
    if not path.exists():
        return []
    text = path.read_bytes().decode(errors="replace")
    lines = text.split("\n")
    if torn := lines.pop():  # what follows the last newline: a line cut short
        logger.warning("%s: dropping its last line, cut short (%d bytes): a write a kill or a full disk interrupted", path, len(torn))
    readable = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            logger.warning("%s: line %d is not JSON (%s): dropped", path, number, exc)
            continue
        if not isinstance(record, dict):
            logger.warning("%s: line %d is not a JSON object: dropped", path, number)
            continue
        readable.append((line, record))
    return readable


def read_log(path: Path) -> list[dict]:
    """The log's readable records, in order."""
    return [record for _, record in log_lines(path)]


def rewrite_log(path: Path, keep: Callable[[dict], bool] = lambda _: True) -> None:
    """Write the log back with only its readable lines that `keep` accepts (as they were written),
    so appends start on a fresh line; a log with nothing to drop is left alone."""
    if not path.exists():
        return
    kept = [line for line, record in log_lines(path) if keep(record)]
    text = "".join(line + "\n" for line in kept)
    if text.encode() != path.read_bytes():
        atomic_write_text(path, text)
