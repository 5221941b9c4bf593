"""The cache policy every step task uses: the step's provenance is its cache key.

Prefect's built-in INPUTS policy hashes a Path by its string, so an edited file would still hit;
here files count by content, manifests by digest, config groups only by the fields that change the
output (batch sizes and devices are left out), and code by the step's version in
`eagle3.store.versions` (not by the bytes of any source file: moving or commenting code re-runs nothing).
The provenance is computed once per task run, here; the task reads it back (`task_provenance`)
and records it in its artifact, so Prefect's cache and the store agree.

A cached result is a manifest that points into the store, and `eagle3 artifacts gc` may since have
deleted what it points at. Such a result is never handed on: the key moves along a chain of
rebuild keys past every stale result, so the step runs again and its new result is the one found
from then on. Results are stored as manifest JSON and read back by artifact kind
(`ManifestSerializer`), never unpickled: a record that names another serializer (a pickle planted
in a shared result store) is passed over like a stale one, unread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar
from uuid import UUID

from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.results import ResultStore, get_default_result_storage
from prefect.serializers import Serializer
from prefect.utilities.hashing import hash_objects

from eagle3.store.artifacts import ArtifactStore, step_provenance
from eagle3.store.manifests import ArtifactManifest, Provenance, manifest_types

__all__ = ["ManifestSerializer", "StepCache", "step_cache_policy", "step_task", "task_provenance"]

ProvenanceOf = Callable[..., Provenance]  # (store, **the task's inputs but store_dir)
_computed: dict[UUID, Provenance] = {}  # task run id -> the provenance its key was computed from
P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class StepCache(CachePolicy):
    provenance: ProvenanceOf | None = None

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any] | None,
        flow_parameters: dict[str, Any] | None,
        **kwargs: Any,
    ) -> str | None:
        if not inputs or self.provenance is None:
            return None
        inputs = dict(inputs)
        store = ArtifactStore(inputs.pop("store_dir"))
        provenance = self.provenance(store, **inputs)
        _computed[task_ctx.task_run.id] = provenance
        # The store is part of the key: a cached manifest points into the store that holds it.
        key = _hash(str(store.root), provenance.key)
        results = task_ctx.result_store
        while (record := _raw_record(results, key)) is not None and not _usable(record):
            key = _hash(key, "rebuilt after gc")
        return key


def _hash(*parts: str) -> str:
    key = hash_objects(*parts)
    if key is None:  # None only for what neither JSON nor cloudpickle encodes: never strings
        raise ValueError(f"cannot hash {parts!r} into a cache key")
    return key


def _raw_record(results: ResultStore, key: str) -> dict | None:
    """The result record at `key` as JSON, unread by any serializer; None if there is none.
    Prefect reads a record (even to see whether it exists) with the serializer the record names,
    so a record naming pickle, planted in a shared result store, would run whatever it holds."""
    if results.metadata_storage is not None:  # records split over two storages: not this package's setup
        raise ValueError("eagle3 step results need one result storage (no separate metadata storage)")
    storage = results.result_storage or _called_sync(get_default_result_storage)
    try:
        return json.loads(_called_sync(storage.read_path, key))
    except (OSError, ValueError):  # none, or not a record: nothing Prefect would take as a cache hit either
        return None


def _called_sync(dispatched: Callable[..., object], *args: Any) -> Any:
    """Call one of Prefect's `async_dispatch` functions through its sync implementation, which
    `_sync=True` selects. Their signatures take no `_sync` and type the result as (maybe) a coroutine."""
    return dispatched(*args, _sync=True)


def _usable(record: dict) -> bool:
    """A manifest record (by the serializer it names) whose artifact is still in the store."""
    try:
        if record["metadata"]["serializer"]["type"] != ManifestSerializer.model_fields["type"].default:
            return False
        return Path(json.loads(record["result"])["manifest"]["path"]).exists()
    except (KeyError, TypeError, ValueError):
        return False


def step_cache_policy(step: str | ProvenanceOf) -> StepCache:
    """Key = the step's provenance, past results whose artifact is gone. `step`: its
    `eagle3.store.versions` entry, or a function `(store, **inputs) -> Provenance` where the route or
    something else beside the task's inputs shapes the key."""
    return StepCache(provenance=partial(step_provenance, step) if isinstance(step, str) else step)


def task_provenance(task: Task, store: ArtifactStore, **inputs: Any) -> Provenance:
    """The provenance the cache policy computed for this task run; computed here only where the
    policy could not (it raised: the step then raises the same error with its own message)."""
    context = TaskRunContext.get()
    if context is None:
        raise RuntimeError(f"task_provenance({task.name}) is called from outside a running task")
    computed = _computed.pop(context.task_run.id, None)
    if computed is not None:
        return computed
    policy = task.cache_policy
    if not isinstance(policy, StepCache) or policy.provenance is None:
        raise TypeError(f"task {task.name} has no step cache policy (`step_task`) to compute its provenance")
    return policy.provenance(store, **inputs)


class ManifestSerializer(Serializer):
    """A cached result as its manifest's JSON, read back by its `kind`: no pickle (a shared result
    store is then no code-execution surface) and no module path (a moved class still reads)."""

    type: Literal["eagle3-manifest"] = "eagle3-manifest"

    def dumps(self, obj: ArtifactManifest) -> bytes:
        return json.dumps({"kind": obj.kind, "manifest": obj.model_dump(mode="json")}).encode()

    def loads(self, blob: bytes) -> ArtifactManifest:
        record = json.loads(blob)
        return manifest_types()[record["kind"]].model_validate(record["manifest"])


def step_task(name: str, step: str | ProvenanceOf) -> Callable[[Callable[P, R]], Task[P, R]]:
    """`@task` for a step: cached by its provenance, its manifest persisted as JSON."""
    return task(name=name, cache_policy=step_cache_policy(step), persist_result=True, result_serializer=ManifestSerializer())
