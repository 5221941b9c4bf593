from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from eagle3.gc import record_run
from eagle3.lineage import lineage, lineage_table, to_mermaid
from eagle3.store import ArtifactManifest, ArtifactStore


@task(name="publish-lineage", cache_policy=NO_CACHE)
def publish_lineage_task(store_dir: str, manifests: list[ArtifactManifest]) -> str:
    """Every artifact this run used or produced, with its parents, as a table and a Mermaid graph;
    and the run's record in the store, which keeps what it reached safe from `eagle3 artifacts gc`."""
    store = ArtifactStore(store_dir)
    nodes = lineage(store, [m.digest for m in manifests])
    record_run(store, str(flow_run.id or "local"), [m.digest for m in manifests])
    create_table_artifact(key="lineage", table=lineage_table(nodes), description="artifacts of this run and their parents")
    graph = to_mermaid(nodes)
    create_markdown_artifact(key="lineage-graph", markdown=f"```mermaid\n{graph}\n```\n", description="artifact lineage")
    return graph
