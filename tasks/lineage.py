from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.lineage import lineage, lineage_table, to_mermaid
from eagle3.store import ArtifactManifest, ArtifactStore


@task(name="publish-lineage", cache_policy=NO_CACHE)
def publish_lineage_task(store_dir: str, manifests: list[ArtifactManifest]) -> str:
    """Every artifact this run used or produced, with its parents, as a table and a Mermaid graph."""
    nodes = lineage(ArtifactStore(store_dir), [m.digest for m in manifests])
    create_table_artifact(key="lineage", table=lineage_table(nodes), description="artifacts of this run and their parents")
    graph = to_mermaid(nodes)
    create_markdown_artifact(key="lineage-graph", markdown=f"```mermaid\n{graph}\n```\n", description="artifact lineage")
    return graph
