"""The cache policy every step task uses: the step's provenance is its cache key.

Prefect's built-in INPUTS policy hashes a Path by its string, so an edited file would still hit;
here files count by content, manifests by digest, and config groups only by the fields that
change the output (batch sizes and devices are left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects

from eagle3.store import ArtifactStore, step_provenance

__all__ = ["StepProvenance", "step_cache_policy"]


@dataclass
class StepProvenance(CachePolicy):
    step_module: ModuleType | None = None

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
        return hash_objects(str(store.root), step_provenance(self.step_module, store, **inputs).key)


def step_cache_policy(step_module: ModuleType) -> CachePolicy:
    """Key = step provenance + the task wrapper's own source."""
    return StepProvenance(step_module=step_module) + TASK_SOURCE
