"""What a step hands on (a manifest: where its artifact is and what shaped it, never tensors) and
its provenance, whose digest is the step's cache key."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MANIFEST", "ArtifactManifest", "Producer", "Provenance", "manifest_types"]

MANIFEST = "manifest.json"


class Provenance(BaseModel):
    """What shapes a step's output: its inputs' digests, its output-affecting config, its code."""

    parents: dict[str, str] = Field(default_factory=dict, description="input name -> digest")
    config: dict[str, Any] = Field(default_factory=dict, description="the output-affecting step config")
    code_version: str = ""

    @property
    def key(self) -> str:
        """The step's cache key: equal provenance, equal output."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class Producer(BaseModel):
    """The flow run and task run that first published an artifact. Not part of the digest: equal
    bytes from a later run are the same artifact, and keep their first producer."""

    flow_run_id: str = Field(description="Prefect flow run id")
    task_run_id: str = Field(description="Prefect task run id")


class ArtifactManifest(Provenance):
    """What a step hands on: where its output is and what shaped it. Never tensors. A NaN (a
    diverged validation loss) is written as NaN, not null, so the manifest reads back."""

    model_config = ConfigDict(ser_json_inf_nan="constants")

    kind: str
    digest: str = ""
    path: Path
    num_bytes: int = 0
    seconds: float = 0.0
    producer: Producer | None = Field(None, description="who published it; None when published outside a flow run")


def manifest_types() -> dict[str, type[ArtifactManifest]]:
    """Every manifest class of the imported steps, by the `kind` of artifact it describes."""
    found: dict[str, type[ArtifactManifest]] = {}
    todo = list(ArtifactManifest.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.model_fields["kind"].default] = cls
        todo.extend(cls.__subclasses__())
    return found
