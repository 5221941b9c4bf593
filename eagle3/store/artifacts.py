"""Content-addressed artifact store.

Layout under the store root:

    artifacts/<digest>/            one finished artifact; `manifest.json` is written last
    work/<step>-<key>/             a step's unfinished output, kept across crashes for resume
    locks/                         a lock file per work directory or hidden-state shard in use (or left by a killed run)
    published/<kind>-<key>         the digest of the artifact published for a step's provenance key
    compile-cache/                 torch.compile's cache for GPU training (TORCHINDUCTOR_CACHE_DIR)
    file-digests.json              memo of streamed file digests by path (memo_tag: size, times, inode)

An artifact's digest is the sha256 over its files' relative paths and contents, so two runs
that produce the same bytes share one directory. Publishing is a rename of a finished work
directory whose files are on disk (fsynced), so a reader never sees half an artifact, even
after a power loss. Publishing bytes the store already holds checks the stored copy first
(`artifact_damage`) and replaces it if a file changed since: recomputing repairs an artifact.
A step holds its work directory's lock while it runs: two runs of a step on the same inputs take
turns instead of writing into one directory. The store, not Prefect's result cache, is the record of
what was computed: a step whose provenance the store has published returns that artifact instead of
running again (`step_work_dir`), whether another run published it while this one waited or long
before, from a Prefect setup whose results this one cannot see (another host or PREFECT_HOME, a fresh
container). So a step that is not deterministic (GPU regeneration or training in bfloat16) is not
computed again for a key the store holds, and the keys downstream of it hold. An artifact found
damaged there (`artifact_damage`) is computed again, which repairs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import BaseModel

from eagle3.config import output_affecting, store_path
from eagle3.runtime.locks import exclusive
from eagle3.store.files import TEMP_SUFFIX, atomic_write_text, digest_file, fsync, remove_tree
from eagle3.store.manifests import MANIFEST, ArtifactManifest, Producer, Provenance
from eagle3.store.versions import code_version

__all__ = [
    "PUBLISHED",
    "SERVED_STATES",
    "ArtifactError",
    "ArtifactStore",
    "artifact_damage",
    "digest_tree",
    "log_reuse",
    "memo_tag",
    "read_manifest_record",
    "step_provenance",
]

PUBLISHED = "published"  # <kind>-<provenance key> -> digest of the artifact published for it
SERVED_STATES = "served-states"  # where an extracting vLLM server writes states files by default (`eagle3 extraction-server`)

M = TypeVar("M", bound="ArtifactManifest")
logger = logging.getLogger(__name__)


class ArtifactError(RuntimeError):
    """An artifact or input file is missing, unreadable or inconsistent."""

    def __init__(self, path: Path | str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = Path(path)
        self.message = message

    def __reduce__(self):  # pickles across the child processes GPU steps run in
        return type(self), (self.path, self.message)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def memo_tag(stat: os.stat_result) -> str:
    """What a memoised file digest is valid for: size, mtime, ctime and inode. A new copy that keeps
    the old timestamp (`cp -p`, `rsync -a`, `tar x`) still has a new ctime, which no user sets, or
    a new inode."""
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"


def digest_tree(root: Path, file_digest=digest_file) -> str:
    """sha256 over (relative path, content digest) of every file under `root` but the manifest."""
    h = hashlib.sha256()
    for p in _files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + file_digest(p).encode() + b"\n")
    return h.hexdigest()


def _damaged(manifest: Path, why: str) -> ArtifactError:
    return ArtifactError(
        manifest,
        f"{why}: the artifact is damaged; delete {manifest.parent} and re-run to compute it again "
        "(`eagle3 artifacts verify --remove` removes every damaged artifact)",
    )


def _record_or_problem(manifest: Path) -> dict | str:
    try:
        record = json.loads(manifest.read_text())
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        return f"not readable JSON ({exc})"
    return record if isinstance(record, dict) else "not a JSON object"


def read_manifest_record(manifest: Path) -> dict:
    """An artifact's `manifest.json` as a dict.

    Raises:
        ArtifactError: the file is missing or is not a JSON object (names the file and the fix).
    """
    record = _record_or_problem(manifest)
    if isinstance(record, str):
        raise _damaged(manifest, record)
    return record


def artifact_damage(path: Path, manifest_type: type[ArtifactManifest] | None = None, files: bool = True) -> str | None:
    """What is wrong with the stored artifact `path` (None: its manifest reads, as a `manifest_type`
    of that type's kind where given, and with `files` its files hash to the digest it is stored under)."""
    found = _checked_manifest(path, manifest_type, files)
    return found if isinstance(found, str) else None


def _checked_manifest(path: Path, manifest_type: type[ArtifactManifest] | None, files: bool) -> ArtifactManifest | dict | str:
    """`artifact_damage`'s checks, returning the manifest they read (as `manifest_type` where given,
    else its record) or, as a string, what is wrong."""
    record = _record_or_problem(path / MANIFEST)
    if isinstance(record, str):
        return f"{MANIFEST} is {record}"
    if record.get("digest") != path.name:
        return f"{MANIFEST} does not name this artifact's digest"
    manifest: ArtifactManifest | dict = record
    if manifest_type is not None:
        kind = manifest_type.model_fields["kind"].default  # a step's manifest type names its kind; ArtifactManifest none
        if isinstance(kind, str) and record.get("kind") != kind:
            return f"{MANIFEST} names kind {record.get('kind')!r}, not {kind!r}"
        try:
            manifest = manifest_type.model_validate(record)
        except ValueError as exc:
            return f"{MANIFEST} is not a {manifest_type.__name__} ({str(exc).splitlines()[0]})"
    if files and (found := digest_tree(path)) != path.name:
        return f"its files hash to {found[:12]}, not the digest it is stored under: a file changed, appeared or went since it was published"
    return manifest


class ArtifactStore:
    """`producer`, when given, is stamped on every artifact this store object publishes."""

    def __init__(self, root: Path | str, producer: Producer | None = None):
        self.root = store_path(root)
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
        """`work_dir` for a step keyed by its provenance, and the artifact the store has published for
        the same provenance (by another run while this one waited, or by any earlier run): the step
        returns that instead of running again (None: none published, or it is gone or damaged, see
        `published`)."""
        kind = manifest_type.model_fields["kind"].default
        with self._held_work_dir(kind, provenance.key) as (path, waited):
            done = self.published(manifest_type, provenance, check_files=True)
            if done is not None:
                if waited:
                    logger.warning("%s: another run published it for the same inputs while this one waited", kind)
                log_reuse(done)
                # a run killed between publishing and clearing up left what is no longer needed; best effort (NFS busy files)
                shutil.rmtree(path, ignore_errors=True)
            yield path, done

    def published(self, manifest_type: type[M], provenance: Provenance, check_files: bool = False) -> M | None:
        """The artifact published for `provenance`, if the store still holds it (None: never, deleted,
        or damaged: its manifest does not read as `manifest_type`, or with `check_files` its files no
        longer hash to its digest, which costs a read of them). Its stored manifest is its first
        publisher's, whose provenance and store root may differ (same bytes): the one returned carries
        `provenance` and its path in this store."""
        pointer = self._pointer(manifest_type.model_fields["kind"].default, provenance.key)
        if not pointer.exists() or not (path := self.artifact_dir(pointer.read_text())).joinpath(MANIFEST).exists():
            return None
        found = _checked_manifest(path, manifest_type, files=check_files)
        if isinstance(found, str):
            logger.warning("%s: %s; computing it again", path, found)  # publishing what is computed replaces the copy
            return None
        return cast(M, found).model_copy(update={**provenance.model_dump(), "path": path})

    def work_path(self, step: str, key: str) -> Path:
        """Where `work_dir(step, key)` is, without holding it: for what runs of a step that do not
        take turns share (extraction, which locks shards instead, keeps its back-offs there)."""
        return self.root / "work" / f"{step}-{key[:24]}"

    @contextmanager
    def _held_work_dir(self, step: str, key: str) -> Iterator[tuple[Path, bool]]:
        path = self.work_path(step, key)
        with exclusive(self.root / "locks" / f"{path.name}.lock", f"another run of step '{step}' on the same inputs") as waited:
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
        """Streamed content digest of an input file or directory, memoised by `memo_tag`."""
        path = Path(path).resolve()
        if path.is_dir():
            return digest_tree(path, self._memo_digest)
        return self._memo_digest(path)

    def _memo_digest(self, path: Path) -> str:
        stat = path.stat()
        memo_path = self.root / "file-digests.json"
        memo = self._read_memo(memo_path)
        tag = memo_tag(stat)
        entry = memo.get(str(path))
        if entry and entry["tag"] == tag:
            return entry["sha256"]
        digest = digest_file(path)
        memo[str(path)] = {"tag": tag, "sha256": digest}
        atomic_write_text(memo_path, json.dumps(memo, indent=0))
        return digest

    @staticmethod
    def _read_memo(memo_path: Path) -> dict:
        """The digest memo; a damaged one is only a cache: it is started afresh (and rewritten whole)."""
        try:
            memo = json.loads(memo_path.read_text())
            if isinstance(memo, dict):
                return memo
            raise ValueError("not a JSON object")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("%s: unreadable (%s); digests are computed afresh and the file rewritten", memo_path, exc)
            return {}

    def publish(self, work: Path, manifest: M) -> M:
        """Turn a finished work directory into an artifact named by its content digest.

        `manifest` comes with everything but `digest`, `path`, `num_bytes` and `producer`, which are
        filled here. An artifact already in the store keeps its manifest, so its first producer, unless
        it is damaged (`artifact_damage`): then this directory replaces it.
        """
        files = _files(work)
        for path in [*files, *sorted((d for d in work.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))]:
            fsync(path)  # files, then the directories holding them, deepest first
        digest = digest_tree(work)
        final = self.artifact_dir(digest)
        num_bytes = sum(p.stat().st_size for p in files)
        manifest = manifest.model_copy(update={"digest": digest, "path": final, "num_bytes": num_bytes, "producer": self.producer})
        atomic_write_text(work / MANIFEST, manifest.model_dump_json(indent=2))
        fsync(work)
        if final.exists() and (damage := artifact_damage(final, type(manifest))) is not None:
            logger.warning("%s: %s; replacing it with the copy just computed", final, damage)
            remove_tree(final, "damaged")
        try:
            os.replace(work, final)
            fsync(final.parent)
        except OSError:  # already there (and intact, or another run's copy since)
            if not final.exists():
                raise
            shutil.rmtree(work)
            first = self.load(type(manifest), digest)
            manifest = manifest.model_copy(update={"producer": first.producer})
        source = Provenance.model_validate(manifest.model_dump(include=set(Provenance.model_fields)))
        atomic_write_text(self._pointer(manifest.kind, source.key), digest)
        return manifest

    def load(self, manifest_type: type[M], digest: str) -> M:
        """The stored manifest of artifact `digest`.

        Raises:
            ArtifactError: no such artifact, or its manifest is not a readable `manifest_type`.
        """
        path = self.artifact_dir(digest) / MANIFEST
        if not path.exists():
            raise ArtifactError(path, "no such artifact (deleted, or from another store)")
        try:
            return manifest_type.model_validate(read_manifest_record(path))
        except ValueError as exc:
            raise _damaged(path, f"not a {manifest_type.__name__} ({str(exc).splitlines()[0]})") from exc


def log_reuse(manifest: ArtifactManifest) -> None:
    """Say that a step hands back what the store holds for its inputs instead of running."""
    logger.info("%s: the store already holds it for these inputs; reusing %s", manifest.kind, manifest.digest[:12])


def step_provenance(step: str, store: ArtifactStore, **inputs: Any) -> Provenance:
    """The provenance of `step` (an `eagle3.store.versions.STEPS` entry) from its inputs: manifests count
    by digest, files and directories by streamed content digest, config groups by their
    output-affecting fields, anything else as is."""
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
