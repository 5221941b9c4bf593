"""Lineage: where an artifact came from, read from the artifact store alone (no server needed).

Every manifest names its parents by digest; a parent that is itself an artifact in the store is
followed, any other (a source file, a verifier directory used in place) is shown as an input.
"""

from __future__ import annotations

import json

from eagle3.store import MANIFEST, ArtifactError, ArtifactStore

__all__ = ["find_artifact", "lineage", "lineage_table", "to_mermaid"]


def find_artifact(store: ArtifactStore, prefix: str) -> str:
    """The full digest of the one artifact whose digest starts with `prefix`."""
    matches = [p.name for p in (store.root / "artifacts").iterdir() if p.name.startswith(prefix)]
    if len(matches) != 1:
        raise ArtifactError(store.root / "artifacts", f"digest prefix {prefix!r} matches {len(matches)} artifacts")
    return matches[0]


def lineage(store: ArtifactStore, digests: list[str]) -> dict[str, dict]:
    """digest -> manifest (as a dict) for the given artifacts and all their ancestors in the store;
    inputs that are not artifacts appear as {"kind": "input", "name": ...}."""
    nodes: dict[str, dict] = {}
    stack = [(d, "artifact") for d in digests]
    while stack:
        digest, name = stack.pop()
        if digest in nodes:
            continue
        path = store.artifact_dir(digest) / MANIFEST
        if not path.exists():
            nodes[digest] = {"kind": "input", "name": name, "digest": digest, "parents": {}}
            continue
        manifest = json.loads(path.read_text())
        nodes[digest] = manifest
        stack.extend((parent, parent_name) for parent_name, parent in manifest.get("parents", {}).items())
    return nodes


def lineage_table(nodes: dict[str, dict]) -> list[dict]:
    return [
        {"kind": n["kind"], "digest": d[:16], "parents": ", ".join(f"{k}={v[:12]}" for k, v in n["parents"].items()),
         "path": str(n.get("path", n.get("name", "")))}
        for d, n in sorted(nodes.items(), key=lambda item: item[1]["kind"])
    ]


def to_mermaid(nodes: dict[str, dict]) -> str:
    """A Mermaid flowchart: one node per artifact or input, an edge from each parent to its child."""
    lines = ["flowchart LR"]
    for digest, node in nodes.items():
        label = f"{node['kind']}<br/>{digest[:12]}" if node["kind"] != "input" else f"input: {node['name']}<br/>{digest[:12]}"
        shape = f'(["{label}"])' if node["kind"] == "input" else f'["{label}"]'
        lines.append(f"  n{digest[:12]}{shape}")
    for digest, node in nodes.items():
        for name, parent in node["parents"].items():
            lines.append(f"  n{parent[:12]} -->|{name}| n{digest[:12]}")
    return "\n".join(lines)

