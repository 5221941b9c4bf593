"""Answers earlier regenerations gave: what lets a regeneration over a changed prompt file generate
only for the prompts that are new.

A regenerated artifact is keyed by its whole prompt file, so appending prompts, or changing the
shares of a mix, makes a new artifact. At scale regeneration is the most expensive step there is
(a million answers is hours of the verifier on 8 GPUs), so a new artifact takes, for each prompt an
earlier one already answered, that artifact's answer, and generates the rest.

An answer is reused from a published regeneration of the same *answer settings*: its key without
the prompt file and `max_records` (`answer_settings`), so the same verifier, generation settings and
step version. A record matches on what the verifier was asked (its system messages and user turns),
not on its id. In exact arithmetic a greedy answer does not depend on what else was in the batch
(left padding is masked), so a reused answer is the one this run would generate (on CPU, to the
byte; in bfloat16 on a GPU a few differ, as they do between two full GPU runs); a sampled one is a
sample under the same settings. Failed records are not reused: they are tried again.

The step's key is defined here too (`regenerate_provenance`), beside the one function that takes
it apart.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from eagle3.config import RegenerateConfig
from eagle3.data.prepare_dataset import Record
from eagle3.store.artifacts import PUBLISHED, ArtifactError, ArtifactStore, read_manifest_record, step_provenance
from eagle3.store.manifests import MANIFEST, Provenance
from eagle3.store.versions import route
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["CONVERSATIONS", "EarlierAnswers", "answer_settings", "earlier_answers", "regenerate_provenance"]

logger = logging.getLogger(__name__)

CONVERSATIONS = "conversations.parquet"


def regenerate_provenance(store: ArtifactStore, cfg: RegenerateConfig, source: Path, verifier: VerifierManifest) -> Provenance:
    """The regeneration step's provenance: a server's answers are keyed by its served model name, not by local code."""
    step = route("regenerated", cfg.backend, local="transformers")
    return step_provenance(step, store, cfg=cfg, source=source, verifier=verifier)


class EarlierAnswers(BaseModel):
    entries: dict[str, dict] = Field(description="a finished entry per record id, as the step's done log holds them")
    donors: list[str] = Field(description="digests of the artifacts the answers come from")


def answer_settings(provenance: Provenance) -> str:
    """The key of what an answer depends on: `provenance` without the prompt file and the record limit."""
    config = dict(provenance.config)
    if isinstance(config.get("cfg"), dict):  # regenerate_provenance's names: `cfg` the settings, `source` the prompt file
        config["cfg"] = {name: value for name, value in config["cfg"].items() if name != "max_records"}
    parents = {name: digest for name, digest in provenance.parents.items() if name != "source"}
    return Provenance(parents=parents, config=config, code_version=provenance.code_version).key


def _asked(system: list[dict], users: list[str]) -> str:
    return json.dumps([system, users], sort_keys=True)


def _donors(store: ArtifactStore, settings: str) -> Iterator[tuple[str, Path]]:
    """(digest, directory) of each published regeneration with answer settings `settings`, the
    latest published first: a dataset that grows run by run finds every earlier answer in its last
    regeneration, and the older ones are not read."""
    seen = set()
    pointers = sorted((store.root / PUBLISHED).glob("regenerated-*"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for pointer in pointers:
        directory = store.artifact_dir(pointer.read_text())
        if directory.name in seen or not (directory / CONVERSATIONS).exists():  # removed by gc since
            continue
        seen.add(directory.name)
        try:
            record = read_manifest_record(directory / MANIFEST)
        except ArtifactError as exc:
            logger.warning("%s; its answers are not reused", exc)
            continue
        if answer_settings(Provenance.model_validate(record)) == settings:
            yield directory.name, directory


def earlier_answers(store: ArtifactStore, provenance: Provenance, records: list[Record]) -> EarlierAnswers:
    """The answers published regenerations of the same answer settings gave to any of `records`. An
    earlier artifact that does not read is passed over with a warning: its answers are generated again."""
    import pyarrow.parquet as pq

    wanted: dict[str, list[str]] = {}
    for record_id, system, users in records:
        wanted.setdefault(_asked(system, users), []).append(record_id)
    entries: dict[str, dict] = {}
    donors = []
    for digest, directory in _donors(store, answer_settings(provenance)):
        if not wanted:
            break
        path = directory / CONVERSATIONS
        try:
            rows = pq.read_table(path, columns=["messages", "finish_reasons"]).to_pylist()
        except (OSError, ValueError) as exc:
            logger.warning("%s: an earlier regeneration's answers do not read (%s); they are generated again", path, exc)
            continue
        used = False
        for row in rows:
            messages = row["messages"]
            asked = _asked([m for m in messages if m["role"] == "system"], [m["content"] for m in messages if m["role"] == "user"])
            for record_id in wanted.pop(asked, []):
                entries[record_id] = {"id": record_id, "messages": messages, "finish_reasons": row["finish_reasons"], "tokens": 0}
                used = True
        if used:
            donors.append(digest)
    return EarlierAnswers(entries=entries, donors=donors)
