"""A draft trained elsewhere (`draft_path`), brought into the store to be evaluated and promoted as
one trained here is: a published EAGLE-3 draft for the verifier, or one this pipeline exported on
another host, measured on this run's prompts beside plain greedy and n-gram decoding without
training anything.

Before anything is copied it is checked against the verifier as a server would read it: speculators'
EAGLE-3 config (the verifier's hidden size and vocabulary, distinct aux layers the verifier has) and
the weights' names and shapes from the safetensors headers. transformers only warns about a missing
weight and speculators skips some on purpose, so a draft without its fc layer would otherwise be
evaluated with random weights. Then it is loaded once with speculators' loader. A misfit fails
here, naming the file and field, with nothing written to the store.

Its files are copied into an artifact named by their content, so the evaluation's key holds the
draft's bytes, not the directory's name, and the source may change or go afterwards. A draft whose
bytes the store already holds (one this store exported) is that artifact, with the figures it was
first published with (its tau_sim, its epochs).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from eagle3.config import ExportConfig
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore, step_provenance
from eagle3.store.manifests import Provenance
from eagle3.training.export import ExportManifest
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["STEP", "check_given_draft", "given_draft", "given_draft_provenance"]

logger = logging.getLogger(__name__)
STEP = "checkpoint/given"  # the checkpoint step's route for a draft trained elsewhere
_COPIED = ("*.json", "*.safetensors")  # a speculators checkpoint: config, weights (one file or shards and their index)


def given_draft_provenance(store: ArtifactStore, draft: Path, cfg: ExportConfig, verifier: VerifierManifest) -> Provenance:
    """Keyed by the directory's content digest, held as a value rather than a parent: the artifact
    is that content (the same digest where the directory holds only the draft's files, and
    `cfg` names no other verifier), and a parent edge would point the checkpoint at itself."""
    return step_provenance(STEP, store, draft=store.input_digest(Path(draft).expanduser()), cfg=cfg, verifier=verifier)


def _field(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _config(path: Path) -> dict:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ArtifactError(path, "draft_path has no config.json: not an exported speculators checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(config_path, f"not a readable JSON file ({exc})") from exc
    if not isinstance(config, dict):
        raise ArtifactError(config_path, "expected a JSON object")
    return config


def _check_config(config_path: Path, config: dict, verifier: VerifierManifest) -> None:
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
    aux, layers = config.get("eagle_aux_hidden_state_layer_ids"), verifier.num_hidden_layers
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and 0 <= i < layers for i in aux) and len(set(aux)) == len(aux)):
        raise ArtifactError(
            config_path,
            f"field 'eagle_aux_hidden_state_layer_ids' is {aux!r}: expected the distinct verifier layers the draft reads, each in 0..{layers - 1}",
        )
    if not isinstance(config.get("draft_vocab_size"), int):
        raise ArtifactError(
            config_path, f"field 'draft_vocab_size' is {config.get('draft_vocab_size')!r}: expected the draft's vocabulary size"
        )


def _check_weights(path: Path, config: dict, verifier: VerifierManifest) -> None:
    """The tensors a server reads, by name and shape, from the headers of every safetensors file."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ArtifactError(path, "draft_path holds no .safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        except Exception as exc:  # safetensors' own error types vary by release
            raise ArtifactError(file, f"not a readable safetensors file ({exc})") from exc
    hidden, draft_vocab, aux = verifier.hidden_size, config["draft_vocab_size"], config["eagle_aux_hidden_state_layer_ids"]
    expected = {
        "d2t": (draft_vocab,),
        "t2d": (verifier.vocab_size,),
        "lm_head.weight": (draft_vocab, hidden),
        "fc.weight": (hidden, len(aux) * hidden),
        "norm.weight": (hidden,),
    }
    where = files[0] if len(files) == 1 else path
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            found = "missing" if name not in shapes else f"of shape {list(shapes[name])}"
            raise ArtifactError(where, f"tensor '{name}' is {found}, expected shape {list(shape)} for this verifier and config")
    if not any(k.startswith("layers.0.") for k in shapes):
        raise ArtifactError(where, "no 'layers.0.*' tensors: the draft decoder layer is missing")


def check_given_draft(path: Path, verifier: VerifierManifest) -> None:
    """Raises ArtifactError naming the file and the field or tensor that is missing or does not fit `verifier`."""
    config = _config(path)
    _check_config(path / "config.json", config, verifier)
    _check_weights(path, config, verifier)


def given_draft(path: Path, cfg: ExportConfig, verifier: VerifierManifest, store: ArtifactStore, provenance: Provenance) -> ExportManifest:
    """Check the draft at `path` against `verifier` and load it once, then copy its files into the
    store (naming `cfg.verifier_name_or_path` as its verifier where set) and publish it."""
    import torch

    from eagle3.evaluation.evaluate import load_draft

    clock = Stopwatch()
    path = Path(path).expanduser()
    check_given_draft(path, verifier)
    try:  # in bfloat16: half the host memory of a large draft's float32 copy
        load_draft(path, verifier.path, torch.device("cpu"), torch.bfloat16)
    except Exception as exc:  # speculators' loader: layer types it does not know, weights it cannot place
        raise ArtifactError(path, f"speculators cannot load it as an EAGLE-3 draft of this verifier: {exc}") from exc
    with store.step_work_dir(ExportManifest, provenance) as (work, published):
        if published is not None:
            return published
        for pattern in _COPIED:
            for file in sorted(path.glob(pattern)):
                shutil.copy2(file, work / file.name)
        config = json.loads((work / "config.json").read_text())
        if cfg.verifier_name_or_path:
            config["speculators_config"]["verifier"]["name_or_path"] = cfg.verifier_name_or_path
            (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        name_or_path = _field(config, "speculators_config.verifier.name_or_path") or ""
        if name_or_path.startswith("/") and not Path(name_or_path).exists():
            logger.warning(
                "%s names its verifier %s, which does not exist on this host: `vllm serve` of it needs export.verifier_name_or_path",
                path / "config.json",
                name_or_path,
            )
        store.publish(
            work,
            ExportManifest(
                **provenance.model_dump(),
                path=work,
                verifier_name_or_path=name_or_path or str(verifier.path),
                tau_sim=None,
                seconds=clock(),
            ),
        )
    found = store.published(ExportManifest, provenance)  # the manifest the store keeps: a later run reads the same
    assert found is not None, "just published"
    return found
