"""Lineage: where an artifact came from, read from the artifact store alone (no server needed).

Every manifest names its parents by digest; a parent that is itself an artifact in the store is
followed, any other (a source file, a verifier directory used in place) is shown as an input.
Every manifest also names its producer (the flow run and task run that first published it), so
for one flow run the graph tells what the run produced and what it took from earlier runs.

Equal bytes are one artifact, so a stored manifest names its first publisher's parents: a run
whose step produced the same bytes from other inputs (a draft trained on records that differ only
in the validation split) reached it from its own. A run's lineage therefore takes the parents the
run itself handed on, as its record keeps them, and the store's only beyond them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel

from eagle3.store.artifacts import ArtifactError, ArtifactStore, read_manifest_record
from eagle3.store.manifests import MANIFEST

__all__ = ["RunLineage", "change_summary", "find_artifact", "lineage", "lineage_table", "to_mermaid"]


class RunLineage(BaseModel):
    """What a flow run hands back about its lineage."""

    run_id: str
    changes: str  # what the run produced, or "Nothing changed: ..."
    config_file: Path  # the run's resolved configuration: `eagle3 run --config <it>` replays the run


def find_artifact(store: ArtifactStore, prefix: str) -> str:
    """The full digest of the one artifact whose digest starts with `prefix`."""
    matches = [p.name for p in (store.root / "artifacts").iterdir() if p.name.startswith(prefix)]
    if len(matches) != 1:
        raise ArtifactError(store.root / "artifacts", f"digest prefix {prefix!r} matches {len(matches)} artifacts")
    return matches[0]


def lineage(
    store: ArtifactStore, digests: list[str], leaf_edges: frozenset[str] = frozenset(), parents: Mapping[str, dict[str, str]] | None = None
) -> dict[str, dict]:
    """digest -> manifest (as a dict) for the given artifacts and all their ancestors in the store;
    inputs that are not artifacts appear as {"kind": "input", "name": ...}. A parent reached through
    an edge named in `leaf_edges` is included without its own ancestors. `parents` (digest -> the
    parents a run handed on with it) takes the place of the stored manifests' own."""
    parents = parents or {}
    nodes: dict[str, dict] = {}
    expanded: set[str] = set()  # nodes whose parents are on the stack
    stack = [(d, "artifact", True) for d in digests]
    while stack:
        digest, name, follow = stack.pop()
        if digest not in nodes:
            path = store.artifact_dir(digest) / MANIFEST
            if not path.exists():
                nodes[digest] = {"kind": "input", "name": name, "digest": digest, "parents": {}}
                continue
            nodes[digest] = read_manifest_record(path)
            if digest in parents:
                nodes[digest]["parents"] = parents[digest]
        if follow and digest not in expanded:  # a node first reached as a leaf is expanded when reached otherwise
            expanded.add(digest)
            stack.extend((parent, edge, edge not in leaf_edges) for edge, parent in nodes[digest].get("parents", {}).items())
    return nodes


def _producing_run(node: dict) -> str | None:
    """The flow run that first published the artifact; None for inputs and for artifacts
    published outside a flow run."""
    return (node.get("producer") or {}).get("flow_run_id")


def _origin(node: dict, run_id: str | None) -> str:
    producer = _producing_run(node)
    if node["kind"] == "input":
        return "input"
    if producer is None:
        return "published outside a flow run"
    if producer == run_id:
        return "produced by this run"
    return f"{'cached: ' if run_id else ''}produced by run {producer}"


def lineage_table(nodes: dict[str, dict], run_id: str | None = None) -> list[dict]:
    """One row per node: digest, parents' digests, producing task run and flow run; `run_id` (the
    run the table is for) tells this run's artifacts from cached ones."""
    return [
        {
            "kind": n["kind"],
            "digest": d[:16],
            "parents": ", ".join(f"{k}={v[:12]}" for k, v in n["parents"].items()),
            "origin": _origin(n, run_id),
            "task_run": (n.get("producer") or {}).get("task_run_id", ""),
            "path": str(n.get("path", n.get("name", ""))),
        }
        for d, n in sorted(nodes.items(), key=lambda item: item[1]["kind"])
    ]


def to_mermaid(nodes: dict[str, dict], run_id: str | None = None) -> str:
    """A Mermaid flowchart: one node per artifact or input, labelled with its producing run, an
    edge from each parent to its child; with `run_id`, this run's artifacts are drawn as new."""
    lines = ["flowchart LR"]
    for digest, node in nodes.items():
        if node["kind"] == "input":
            lines.append(f'  n{digest[:12]}(["input: {node["name"]}<br/>{digest[:12]}"])')
            continue
        producer = _producing_run(node)
        by = f"<br/>run {producer[:8]}" if producer else ""
        style = "" if run_id is None else ":::new" if producer == run_id else ":::cached"
        lines.append(f'  n{digest[:12]}["{node["kind"]}<br/>{digest[:12]}{by}"]{style}')
    for digest, node in nodes.items():
        for name, parent in node["parents"].items():
            lines.append(f"  n{parent[:12]} -->|{name}| n{digest[:12]}")
    if run_id is not None:
        lines += ["  classDef new fill:#d6f5d6,stroke:#2e7d32", "  classDef cached fill:#e8e8e8,stroke:#757575"]
    return "\n".join(lines)


def change_summary(nodes: dict[str, dict], run_id: str) -> str:
    """What run `run_id` changed, from the producers in the store: nothing, when every artifact
    it used was produced by an earlier run."""
    artifacts = [n for n in nodes.values() if n["kind"] != "input"]
    new = sorted(n["kind"] for n in artifacts if _producing_run(n) == run_id)
    if new:
        return f"This run produced {len(new)} of its {len(artifacts)} artifacts: {', '.join(new)}."
    earlier = sorted({r for n in artifacts if (r := _producing_run(n))}) or ["outside a flow run"]
    return (
        f"Nothing changed: this run produced no artifact; all {len(artifacts)} artifacts it used "
        f"come from earlier runs ({', '.join(earlier)})."
    )
