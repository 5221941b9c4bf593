"""A draft trained elsewhere (`draft_path`), brought into the store to be evaluated and promoted as
one trained here is: a published EAGLE-3 draft for the verifier, or one this pipeline exported on
another host, measured on this run's prompts beside plain greedy and n-gram decoding without
training anything.

Its files are copied into an artifact named by their content, so the evaluation's key holds the
draft's bytes, not the directory's name, and the source may change or go afterwards. Before that, it
is checked against the verifier as a server would read it (speculators' EAGLE-3 format, the
verifier's hidden size and vocabulary, aux layers the verifier has) and loaded once with
speculators' loader: a draft for another verifier fails here, naming the file and field, not in the
evaluation's first decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore, step_provenance
from eagle3.store.manifests import Provenance
from eagle3.training.export import ExportManifest
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["STEP", "check_given_draft", "given_draft", "given_draft_provenance"]

STEP = "checkpoint/given"  # the checkpoint step's route for a draft trained elsewhere
_COPIED = ("*.json", "*.safetensors")  # a speculators checkpoint: config, weights (one file or shards and their index)


def given_draft_provenance(store: ArtifactStore, draft: Path, verifier: VerifierManifest) -> Provenance:
    """Keyed by the directory's content digest, held as a value rather than a parent: the artifact
    is that content (the same digest where the directory holds only the draft's files), and a parent
    edge would point the checkpoint at itself."""
    return step_provenance(STEP, store, draft=store.input_digest(Path(draft).expanduser()), verifier=verifier)


def _field(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_given_draft(path: Path, verifier: VerifierManifest) -> list[int]:
    """The draft's aux layer ids, once its config fits `verifier`.

    Raises:
        ArtifactError: naming the file and the field that is missing or does not fit.
    """
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ArtifactError(path, "draft_path has no config.json: not an exported speculators checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(config_path, f"not a readable JSON file ({exc})") from exc
    if not isinstance(config, dict):
        raise ArtifactError(config_path, "expected a JSON object")
    if not any(path.glob("*.safetensors")):
        raise ArtifactError(path, "draft_path holds no .safetensors weights")
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise ArtifactError(config_path, f"field 'speculators_model_type' is {kind!r}: only EAGLE-3 drafts ('eagle3') are evaluated here")
    for field, expected in (
        ("transformer_layer_config.hidden_size", verifier.hidden_size),
        ("transformer_layer_config.vocab_size", verifier.vocab_size),
    ):
        if (found := _field(config, field)) != expected:
            raise ArtifactError(
                config_path, f"field '{field}' is {found!r}, but the verifier {verifier.path} has {expected}: a draft for another verifier"
            )
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    layers = verifier.num_hidden_layers
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and 0 <= i < layers for i in aux)):
        raise ArtifactError(
            config_path,
            f"field 'eagle_aux_hidden_state_layer_ids' is {aux!r}: expected the verifier layers the draft reads, each in 0..{layers - 1}",
        )
    return aux


def given_draft(path: Path, verifier: VerifierManifest, store: ArtifactStore, provenance: Provenance) -> ExportManifest:
    """Check the draft at `path` against `verifier`, copy its files into the store, load it once, publish it."""
    import torch

    from eagle3.evaluation.evaluate import load_draft

    clock = Stopwatch()
    path = Path(path).expanduser()
    check_given_draft(path, verifier)
    with store.step_work_dir(ExportManifest, provenance) as (work, published):
        if published is not None:
            return published
        for pattern in _COPIED:
            for file in sorted(path.glob(pattern)):
                shutil.copy2(file, work / file.name)
        try:  # in bfloat16: half the host memory of a large draft's float32 copy
            load_draft(work, verifier.path, torch.device("cpu"), torch.bfloat16)
        except Exception as exc:  # speculators' loader: missing or misshapen weights, unknown layer types
            raise ArtifactError(path, f"speculators cannot load it as an EAGLE-3 draft of this verifier: {exc}") from exc
        config = json.loads((work / "config.json").read_text())
        manifest = ExportManifest(
            **provenance.model_dump(),
            path=work,
            verifier_name_or_path=_field(config, "speculators_config.verifier.name_or_path") or str(verifier.path),
            tau_sim=None,
            seconds=clock(),
        )
        return store.publish(work, manifest)
