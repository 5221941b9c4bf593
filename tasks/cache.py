"""The cache policy every step task uses: the step's provenance is its cache key.

Prefect's built-in INPUTS policy hashes a Path by its string, so an edited file would still hit;
here files count by content, manifests by digest, and config groups only by the fields that
change the output (batch sizes and devices are left out).

A cached result is a manifest that points into the store, and `eagle3 artifacts gc` may since have
deleted what it points at. Such a result is never handed on: the key moves along a chain of
rebuild keys past every stale result, so the step runs again and its new result is the one found
from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects

from eagle3.store import ArtifactStore, Provenance, step_provenance

__all__ = ["StepCache", "step_cache_policy"]


@dataclass
class StepCache(CachePolicy):
    step_module: ModuleType | None = None
    provenance: Callable[..., Provenance] | None = None  # (store, **inputs); None: step_provenance of step_module

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any] | None,
        flow_parameters: dict[str, Any] | None,
        **kwargs: Any,
    ) -> str | None:
        if not inputs or self.step_module is None:
            return None
        inputs = dict(inputs)
        store = ArtifactStore(inputs.pop("store_dir"))
        # The store is part of the key: a cached manifest points into the store that holds it.
        provenance = self.provenance(store, **inputs) if self.provenance else step_provenance(self.step_module, store, **inputs)
        key = hash_objects(
            str(store.root),
            provenance.key,
            TASK_SOURCE.compute_key(task_ctx=task_ctx, inputs=inputs, flow_parameters=flow_parameters),
        )
        results = task_ctx.result_store
        while results.exists(key) and not Path(results.read(key).result.path).exists():
            key = hash_objects(key, "rebuilt after gc")
        return key


def step_cache_policy(step_module: ModuleType, provenance: Callable[..., Provenance] | None = None) -> CachePolicy:
    """Key = step provenance + the task wrapper's own source, past results whose artifact is gone.
    `provenance(store, **inputs)`: the one the task itself records, where it is not `step_provenance`
    of the task's inputs (the two must agree, or the two caches reuse different results)."""
    return StepCache(step_module=step_module, provenance=provenance)
