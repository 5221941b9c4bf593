"""What users watch in the Prefect UI: a table and a markdown summary per step, progress while it runs."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact

from eagle3.store.manifests import ArtifactManifest

__all__ = ["Progress", "decode_rows", "publish_image", "publish_step_report"]


def decode_rows(results: list[dict]) -> list[dict]:
    """Decode summaries (tau per method and k) as table rows, acceptance rates rounded for reading."""
    return [{**r, "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]]} for r in results]


def publish_step_report(manifest: ArtifactManifest, numbers: dict[str, Any]) -> None:
    """Key numbers as a table, provenance as markdown; keys give a history across runs."""
    kind = manifest.kind.replace("_", "-")
    rows = [{"field": k, "value": v} for k, v in {**numbers, "digest": manifest.digest[:16], "seconds": manifest.seconds}.items()]
    create_table_artifact(key=f"{kind}-numbers", table=rows, description=f"{manifest.kind}: key numbers")
    parents = "\n".join(f"- `{name}`: `{digest[:16]}`" for name, digest in manifest.parents.items()) or "- none"
    create_markdown_artifact(
        key=f"{kind}-summary",
        markdown=f"### {manifest.kind} `{manifest.digest[:16]}`\n\nPath: `{manifest.path}`\n\n"
        f"Inputs:\n{parents}\n\nCode version: `{manifest.code_version}`\n",
        description=f"{manifest.kind}: where it is and what it came from",
    )


def publish_image(key: str, png: Path, title: str) -> None:
    """A PNG as a markdown artifact: the open-source UI has no image artifact type, but renders a
    markdown image whose source is a data URI (keep the PNG small: it is stored in the database)."""
    data = base64.b64encode(png.read_bytes()).decode()
    create_markdown_artifact(key=key, markdown=f"### {title}\n\n![{title}](data:image/png;base64,{data})\n", description=title)


class Progress:
    """A Prefect progress artifact fed from a step's callback (percent, updated at most every 1%)."""

    def __init__(self, description: str):
        # Steps run as sync functions, so Prefect's async_dispatch returns the id, not a coroutine.
        self.id = cast(UUID, create_progress_artifact(progress=0.0, description=description))
        self.last = 0.0

    def __call__(self, done: float, total: float, *_: Any) -> None:
        percent = 100.0 * done / max(total, 1)
        if percent - self.last >= 1.0 or done >= total:
            update_progress_artifact(self.id, progress=percent)
            self.last = percent
