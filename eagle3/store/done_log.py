"""Finished units of a step's work, one JSON line each, appended as each one completes: what lets a
step killed midway resume where it stopped instead of starting over (regeneration's records, the
baselines' and evaluation's prompts). The log lives in the step's work directory, which is keyed
by the step's inputs, so every line in it was computed from the same inputs."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TextIO

from eagle3.store.artifacts import ArtifactError

__all__ = ["DONE_LOG", "append_done", "parse_done", "read_done"]

logger = logging.getLogger(__name__)
DONE_LOG = "done.jsonl"


def append_done(log: TextIO, entry: dict) -> None:
    """Append one finished unit (`entry["id"]` names it) and flush it to the file."""
    log.write(json.dumps(entry) + "\n")  # one write per line: a kill leaves at most the last one torn
    log.flush()


def read_done(path: Path, unit: str) -> dict:
    """Finished entries by id. A last line without its newline is a write cut short by a kill: it is
    cut from the file (so appends start on a fresh line) and its `unit` (record, prompt) is redone.

    Raises:
        ArtifactError: a complete line is not JSON (names the file and line).
    """
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        logger.warning(
            "%s: dropping an incomplete last line (%d bytes, a write cut short); its %s is redone", path, len(data) - complete, unit
        )
        os.truncate(path, complete)
    return parse_done(data, path, unit)


def parse_done(data: bytes, path: Path, unit: str) -> dict:
    """Finished entries by id from a log's bytes (`path` names it in errors): a last line without
    its newline is left out, and of a unit logged twice (decoded again on resume) the later entry counts.

    Raises:
        ArtifactError: a complete line is not JSON (names the file and line).
    """
    done = {}
    for number, line in enumerate(data[: data.rfind(b"\n") + 1].decode().splitlines(), 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ArtifactError(
                path, f"line {number} is not JSON ({exc}); delete that line (its {unit} is redone) or the file (all are)"
            ) from exc
        if not isinstance(entry, dict) or "id" not in entry:
            raise ArtifactError(
                path,
                f"line {number}: field 'id' is missing: not a finished {unit}; delete that line "
                f"(its {unit} is redone) or the file (all are)",
            )
        done[entry["id"]] = entry
    return done
