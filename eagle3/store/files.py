"""Files written whole or not at all, and read by streamed digest: what every artifact and log is made of."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["TEMP_SUFFIX", "atomic_write_bytes", "atomic_write_text", "digest_file", "fsync", "remove_tree"]

TEMP_SUFFIX = ".tmp"  # atomic_write_bytes' temp files: one left behind was a write cut short
_CHUNK = 1 << 20


def atomic_write_bytes(path: Path, data: bytes, sync: bool = True) -> None:
    """`data` in `path` whole or not at all: written to a temp file beside it, synced, renamed over it.
    `sync=False` leaves the flush to the caller, who must `fsync` the file before anything says it
    is there (extraction syncs a shard's files together, so the disk writes them back meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def digest_file(path: Path) -> str:
    """sha256 of a file, streamed in 1 MiB chunks (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync(path: Path) -> None:
    """Make a file's contents, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path, why: str) -> None:
    """Rename `path` away first, then delete it: readers see the whole directory or none of it (a
    deletion killed midway otherwise leaves a manifest or done.json beside missing files). The name
    it is renamed to starts with a dot, so no digest or shard key: gc removes what a kill leaves."""
    import shutil

    doomed = path.with_name(f".{path.name}.{why}-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return  # another process removed it first
    shutil.rmtree(doomed)
