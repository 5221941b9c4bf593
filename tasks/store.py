"""The artifact store as a task sees it: what it publishes names the flow run and task run."""

from __future__ import annotations

from prefect.runtime import flow_run, task_run

from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Producer

__all__ = ["run_store"]


def run_store(store_dir: str) -> ArtifactStore:
    """The store at `store_dir`, stamping each artifact it publishes with the current Prefect
    flow run and task run (none when a task function is called outside a flow run)."""
    producer = None
    if flow_run.id and task_run.id:
        producer = Producer(flow_run_id=str(flow_run.id), task_run_id=str(task_run.id))
    return ArtifactStore(store_dir, producer=producer)
