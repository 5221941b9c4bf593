from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from eagle3.config import PipelineConfig
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.lineage import RunLineage, change_summary, lineage, lineage_table, to_mermaid
from eagle3.store.manifests import ArtifactManifest
from eagle3.store.runs import record_run, replay_file, run_roots


@task(name="publish-lineage", cache_policy=NO_CACHE, persist_result=False)  # nothing pickled: docs/security.md
def publish_lineage_task(store_dir: str, manifests: list[ArtifactManifest], config: PipelineConfig) -> RunLineage:
    """Every artifact this run used or produced, with its parents and producer, as a table and a
    Mermaid graph; the run's record in the store, which keeps what it reached safe from
    `eagle3 artifacts gc` and lets `eagle3 lineage <run id>` redraw the graph; the run's resolved
    configuration beside it, to replay the run; and what the run changed ("Nothing changed: ..."
    when every artifact came from earlier runs)."""
    store = ArtifactStore(store_dir)
    run_id = str(flow_run.id or "local")
    roots = run_roots(manifests)  # with the parents this run handed on: a stored manifest names its first publisher's
    nodes = lineage(store, list(roots), parents=roots)
    record = record_run(store, run_id, manifests, config.model_dump(mode="json"))
    summary = change_summary(nodes, run_id)
    get_run_logger().info(summary)
    create_table_artifact(key="lineage", table=lineage_table(nodes, run_id), description=summary)
    graph = to_mermaid(nodes, run_id)
    create_markdown_artifact(key="lineage-graph", markdown=f"{summary}\n\n```mermaid\n{graph}\n```\n", description="artifact lineage")
    return RunLineage(run_id=run_id, changes=summary, config_file=replay_file(record))
