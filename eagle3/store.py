"""Content-addressed artifact store.

Layout under the store root:

    artifacts/<digest>/            one finished artifact; `manifest.json` is written last
    work/<step>-<key>/             a step's unfinished output, kept across crashes for resume
    locks/                         a lock file per work directory or hidden-state shard in use (or left by a killed run)
    published/<kind>-<key>         the digest of the artifact published for a step's provenance key
    compile-cache/                 torch.compile's cache for GPU training (TORCHINDUCTOR_CACHE_DIR)
    file-digests.json              memo of streamed file digests by (path, size, mtime)

An artifact's digest is the sha256 over its files' relative paths and contents, so two runs
that produce the same bytes share one directory. Publishing is a rename of a finished work
directory whose files are on disk (fsynced), so a reader never sees half an artifact, even
after a power loss. A step holds its work directory's lock while it runs: two runs of a step on
the same inputs take turns instead of writing into one directory, and the later one returns what
the earlier one published (`step_work_dir`) instead of doing the step again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

from pydantic import BaseModel, Field

from eagle3.versions import code_version

__all__ = [
    "ArtifactError",
    "ArtifactManifest",
    "ArtifactStore",
    "Producer",
    "Provenance",
    "Stopwatch",
    "atomic_write_bytes",
    "atomic_write_text",
    "digest_file",
    "digest_tree",
    "exclusive",
    "exclusive_if_free",
    "manifest_types",
    "step_provenance",
]

MANIFEST = "manifest.json"
PUBLISHED = "published"  # <kind>-<provenance key> -> digest of the artifact published for it
SERVED_STATES = "served-states"  # where an extracting vLLM server writes states files by default (`eagle3 extraction-server`)
TEMP_SUFFIX = ".tmp"  # atomic_write_bytes' temp files: one left behind was a write cut short
_CHUNK = 1 << 20

M = TypeVar("M", bound="ArtifactManifest")
T = TypeVar("T")
logger = logging.getLogger(__name__)


class ArtifactError(RuntimeError):
    """An artifact or input file is missing, unreadable or inconsistent."""

    def __init__(self, path: Path | str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = Path(path)
        self.message = message

    def __reduce__(self):  # pickles across the child processes GPU steps run in
        return type(self), (self.path, self.message)


class Provenance(BaseModel):
    """What shapes a step's output: its inputs' digests, its output-affecting config, its code."""

    parents: dict[str, str] = Field(default_factory=dict, description="input name -> digest")
    config: dict[str, Any] = Field(default_factory=dict, description="the output-affecting step config")
    code_version: str = ""

    @property
    def key(self) -> str:
        """The step's cache key: equal provenance, equal output."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class Producer(BaseModel):
    """The flow run and task run that first published an artifact. Not part of the digest: equal
    bytes from a later run are the same artifact, and keep their first producer."""

    flow_run_id: str = Field(description="Prefect flow run id")
    task_run_id: str = Field(description="Prefect task run id")


class ArtifactManifest(Provenance):
    """What a step hands on: where its output is and what shaped it. Never tensors."""

    kind: str
    digest: str = ""
    path: Path
    num_bytes: int = 0
    seconds: float = 0.0
    producer: Producer | None = Field(None, description="who published it; None when published outside a flow run")


def manifest_types() -> dict[str, type[ArtifactManifest]]:
    """Every manifest class of the imported steps, by the `kind` of artifact it describes."""
    found: dict[str, type[ArtifactManifest]] = {}
    todo = list(ArtifactManifest.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.model_fields["kind"].default] = cls
        todo.extend(cls.__subclasses__())
    return found


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
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


@contextmanager
def exclusive(lock: Path, what: str) -> Iterator[bool]:
    """Hold an exclusive lock on the file `lock` (created if missing). While another process holds
    it, log that this one is waiting for `what`, then wait. The system releases it if the holder dies.
    Yields whether it had to wait.

    The holder removes the file before releasing it, so lock files do not pile up (a killed holder's
    stays until the next holder is done); a waiter that then gets the lock on the removed file tries
    again on whatever file the path names now."""
    handle, waited = _acquire(lock, what)
    try:
        yield waited
    finally:
        _release(lock, handle)


@contextmanager
def exclusive_if_free(lock: Path) -> Iterator[bool]:
    """`exclusive` without the wait: yields whether this process got the lock (False, holding
    nothing, while another process holds it)."""
    acquired = _acquire(lock, None)
    if acquired is None:
        yield False
        return
    try:
        yield True
    finally:
        _release(lock, acquired[0])


def _acquire(lock: Path, what: str | None) -> tuple[IO, bool] | None:
    """The open, locked file `lock` names and whether getting it meant waiting; None instead of
    waiting when `what` is None."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        handle = open(lock, "a")
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if what is None:
                    handle.close()
                    return None
                if not waited:
                    logger.warning("waiting for %s (%s is held by another process)", what, lock)
                waited = True
                fcntl.flock(handle, fcntl.LOCK_EX)
        except BaseException:
            handle.close()
            raise
        if _path_still_names(lock, handle):
            return handle, waited
        handle.close()
        waited = True  # the file was removed under us: another run held the lock and finished


def _release(lock: Path, handle: IO) -> None:
    try:
        lock.unlink(missing_ok=True)  # before unlocking: see `exclusive`
    finally:
        handle.close()


def _path_still_names(path: Path, handle: IO) -> bool:
    """Whether `path` still names the open file `handle`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _fsync(path: Path) -> None:
    """Make a file's contents, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def digest_tree(root: Path, file_digest=digest_file) -> str:
    """sha256 over (relative path, content digest) of every file under `root` but the manifest."""
    h = hashlib.sha256()
    for p in _files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + file_digest(p).encode() + b"\n")
    return h.hexdigest()


class ArtifactStore:
    """`producer`, when given, is stamped on every artifact this store object publishes."""

    def __init__(self, root: Path | str, producer: Producer | None = None):
        self.root = Path(root).expanduser()
        self.producer = producer
        (self.root / "artifacts").mkdir(parents=True, exist_ok=True)
        (self.root / "work").mkdir(parents=True, exist_ok=True)

    @contextmanager
    def work_dir(self, step: str, key: str) -> Iterator[Path]:
        """A step's scratch directory, the same for the same key, so a re-run resumes in it; held
        for the step's duration, so a concurrent run of the same step on the same inputs waits."""
        with self._held_work_dir(step, key) as (path, _):
            yield path

    @contextmanager
    def step_work_dir(self, manifest_type: type[M], provenance: Provenance) -> Iterator[tuple[Path, M | None]]:
        """`work_dir` for a step keyed by its provenance, and the artifact another run published for
        the same provenance while this one waited for it: the step returns that instead of running
        again (None: it did not wait, or the other run did not finish)."""
        kind = manifest_type.model_fields["kind"].default
        with self._held_work_dir(kind, provenance.key) as (path, waited):
            done = self.published(manifest_type, provenance) if waited else None
            if done is not None:
                logger.warning("%s: another run published it for the same inputs while this one waited; reusing %s", kind, done.digest[:12])
            yield path, done

    def published(self, manifest_type: type[M], provenance: Provenance) -> M | None:
        """The artifact published for `provenance`, if the store still holds it (None: never, or deleted).
        Its stored manifest is its first publisher's, whose provenance may differ (same bytes): the one
        returned carries `provenance`."""
        pointer = self._pointer(manifest_type.model_fields["kind"].default, provenance.key)
        if pointer.exists() and (self.artifact_dir(digest := pointer.read_text()) / MANIFEST).exists():
            return self.load(manifest_type, digest).model_copy(update=provenance.model_dump())
        return None

    @contextmanager
    def _held_work_dir(self, step: str, key: str) -> Iterator[tuple[Path, bool]]:
        name = f"{step}-{key[:24]}"
        with exclusive(self.root / "locks" / f"{name}.lock", f"another run of step '{step}' on the same inputs") as waited:
            path = self.root / "work" / name
            path.mkdir(parents=True, exist_ok=True)
            for stale in path.rglob(f".*{TEMP_SUFFIX}"):  # a killed run's unfinished write, not part of any output
                stale.unlink()
            try:
                yield path, waited
            finally:
                if path.is_dir() and not any(path.iterdir()):  # nothing to resume (published, or never written)
                    path.rmdir()

    def _pointer(self, kind: str, key: str) -> Path:
        return self.root / PUBLISHED / f"{kind}-{key}"

    def artifact_dir(self, digest: str) -> Path:
        return self.root / "artifacts" / digest

    def input_digest(self, path: Path) -> str:
        """Streamed content digest of an input file or directory, memoised by (size, mtime_ns)."""
        path = Path(path).resolve()
        if path.is_dir():
            return digest_tree(path, self._memo_digest)
        return self._memo_digest(path)

    def _memo_digest(self, path: Path) -> str:
        stat = path.stat()
        memo_path = self.root / "file-digests.json"
        memo = json.loads(memo_path.read_text()) if memo_path.exists() else {}
        tag = f"{stat.st_size}:{stat.st_mtime_ns}"
        entry = memo.get(str(path))
        if entry and entry["tag"] == tag:
            return entry["sha256"]
        digest = digest_file(path)
        memo[str(path)] = {"tag": tag, "sha256": digest}
        atomic_write_text(memo_path, json.dumps(memo, indent=0))
        return digest

    def publish(self, work: Path, manifest: M) -> M:
        """Turn a finished work directory into an artifact named by its content digest.

        `manifest` comes with everything but `digest`, `path`, `num_bytes` and `producer`, which are
        filled here. An artifact already in the store keeps its manifest, so its first producer.
        """
        files = _files(work)
        for path in [*files, *sorted((d for d in work.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))]:
            _fsync(path)  # files, then the directories holding them, deepest first
        digest = digest_tree(work)
        final = self.artifact_dir(digest)
        num_bytes = sum(p.stat().st_size for p in files)
        manifest = manifest.model_copy(update={"digest": digest, "path": final, "num_bytes": num_bytes, "producer": self.producer})
        atomic_write_text(work / MANIFEST, manifest.model_dump_json(indent=2))
        _fsync(work)
        if final.exists():
            shutil.rmtree(work)
            first = type(manifest).model_validate_json((final / MANIFEST).read_text())
            manifest = manifest.model_copy(update={"producer": first.producer})
        else:
            os.replace(work, final)
            _fsync(final.parent)
        source = Provenance.model_validate(manifest.model_dump(include=set(Provenance.model_fields)))
        atomic_write_text(self._pointer(manifest.kind, source.key), digest)
        return manifest

    def load(self, manifest_type: type[M], digest: str) -> M:
        path = self.artifact_dir(digest) / MANIFEST
        if not path.exists():
            raise ArtifactError(path, "no such artifact (deleted, or from another store)")
        return manifest_type.model_validate_json(path.read_text())


def step_provenance(step: str, store: "ArtifactStore", **inputs: Any) -> Provenance:
    """The provenance of `step` (an `eagle3.versions.STEPS` entry) from its inputs: manifests count
    by digest, files and directories by streamed content digest, config groups by their
    output-affecting fields, anything else as is."""
    from eagle3.config import output_affecting

    parents: dict[str, str] = {}
    config: dict[str, Any] = {}
    for name, value in sorted(inputs.items()):
        if isinstance(value, ArtifactManifest):
            parents[name] = value.digest
        elif isinstance(value, Path):
            parents[name] = store.input_digest(value)
        elif isinstance(value, BaseModel):
            config[name] = output_affecting(value)
        else:
            config[name] = value
    return Provenance(parents=parents, config=config, code_version=code_version(step))


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
