"""Export: the trained draft as a checkpoint directory that `vllm serve` loads.

speculators' format: `config.json` (`speculators_model_type`, `speculators_config` with the
verifier's `name_or_path`, `transformer_layer_config` whose `vocab_size` is the verifier's,
`draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`) and `model.safetensors` (`fc`, `layers.0`,
`norm`, `lm_head` over the draft vocab, `embed_tokens`, and the `d2t`/`t2d` buffers). Every
required key, shape and field is checked, then the directory is reloaded with
`SpeculatorModel.from_pretrained` before the artifact counts as done.

`eagle_aux_hidden_state_layer_ids` is what a vLLM server captures for the draft; where it is
missing, vLLM falls back to its default layers without a word, and a draft fed other layers than it
was trained on accepts next to nothing (a published 70B draft: tau 2.77 with its ids, 1.04 with the
defaults). So the checkpoint must carry exactly the ids its training states were captured at.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pydantic import Field
from safetensors import safe_open

from eagle3.config import ExportConfig
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import ArtifactManifest, Provenance
from eagle3.training.train import DraftManifest
from eagle3.training.vocab_mapping import VocabManifest, load_vocab_mapping
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["ExportManifest", "export_checkpoint", "validate_checkpoint"]


class ExportManifest(ArtifactManifest):
    kind: str = "checkpoint"
    verifier_name_or_path: str
    tau_sim: float | None = Field(description="simulated from validation; None for a draft trained elsewhere (draft_path)")
    selected_epoch: int | None = Field(None, description="the draft's epoch (from 0) whose weights it holds: the best tau_sim")
    epochs: int | None = Field(None, description="epochs the draft trained")


def _expect(path: Path, field: str, found, expected) -> None:
    if found != expected:
        raise ArtifactError(path, f"field '{field}' is {found!r}, expected {expected!r}")


def _expect_aux_layer_ids(path: Path, found, hidden_states: HiddenStatesManifest) -> None:
    if found != hidden_states.aux_layer_ids:
        raise ArtifactError(
            path,
            f"field 'eagle_aux_hidden_state_layer_ids' is {found!r}, but the hidden states {hidden_states.path} were "
            f"captured at layers {hidden_states.aux_layer_ids}: a server would feed the draft "
            f"{'its default layers' if found is None else 'other layers'} than it was trained on. Export the draft with "
            "the hidden-state artifact it was trained on.",
        )


def validate_checkpoint(path: Path, verifier: VerifierManifest, vocab: VocabManifest, hidden_states: HiddenStatesManifest) -> None:
    """Check what `vllm serve` reads: config fields, weight names and shapes, vocab buffers.

    Raises:
        ArtifactError: naming the file and the field that is missing or wrong.
    """
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    hidden = verifier.hidden_size
    _expect(config_path, "speculators_model_type", config.get("speculators_model_type"), "eagle3")
    _expect(config_path, "draft_vocab_size", config.get("draft_vocab_size"), vocab.draft_vocab_size)
    _expect_aux_layer_ids(config_path, config.get("eagle_aux_hidden_state_layer_ids"), hidden_states)
    layer_config = config.get("transformer_layer_config") or {}
    _expect(config_path, "transformer_layer_config.vocab_size", layer_config.get("vocab_size"), verifier.vocab_size)
    _expect(config_path, "transformer_layer_config.hidden_size", layer_config.get("hidden_size"), hidden)
    name_or_path = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not name_or_path:
        raise ArtifactError(config_path, "field 'speculators_config.verifier.name_or_path' is missing")

    weights_path = path / "model.safetensors"
    with safe_open(weights_path, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    expected = {
        "d2t": (vocab.draft_vocab_size,),
        "t2d": (verifier.vocab_size,),
        "lm_head.weight": (vocab.draft_vocab_size, hidden),
        "fc.weight": (hidden, 3 * hidden),
        "embed_tokens.weight": (verifier.vocab_size, hidden),
        "norm.weight": (hidden,),
    }
    for name, shape in expected.items():
        _expect(weights_path, name, shapes.get(name), shape)
    if not any(k.startswith("layers.0.") for k in shapes):
        raise ArtifactError(weights_path, "no 'layers.0.*' tensors: the draft decoder layer is missing")


def export_checkpoint(
    cfg: ExportConfig,
    draft: DraftManifest,
    verifier: VerifierManifest,
    vocab: VocabManifest,
    hidden_states: HiddenStatesManifest,
    store: ArtifactStore,
    provenance: Provenance,
) -> ExportManifest:
    """Copy the draft's final checkpoint, name its verifier, validate it, reload it, publish it."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    clock = Stopwatch()
    with store.step_work_dir(ExportManifest, provenance) as (work, published):
        if published is not None:
            return published
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(Path(draft.path) / draft.checkpoint / name, work / name)
        name_or_path = cfg.verifier_name_or_path or str(verifier.path)
        config = json.loads((work / "config.json").read_text())
        config["speculators_config"]["verifier"]["name_or_path"] = name_or_path
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        validate_checkpoint(work, verifier, vocab, hidden_states)

        # Reload as vLLM's loader and speculators would; the verifier's weights come from the local
        # directory because `name_or_path` may only be valid on the serving host.
        reload_config = Eagle3DraftModel.config_class.from_pretrained(work)
        reload_config.speculators_config.verifier.name_or_path = str(verifier.path)
        model = Eagle3DraftModel.from_pretrained(work, config=reload_config)
        d2t, t2d = load_vocab_mapping(vocab)
        if not (torch.equal(model.d2t.cpu(), d2t) and torch.equal(model.t2d.cpu(), t2d)):
            raise ArtifactError(work / "model.safetensors", "fields 'd2t'/'t2d' differ from the vocab mapping artifact")
        del model

        manifest = ExportManifest(
            **provenance.model_dump(),
            path=work,
            verifier_name_or_path=name_or_path,
            tau_sim=draft.tau_sim,
            selected_epoch=draft.selected_epoch,
            epochs=len(draft.epochs),
            seconds=clock(),
        )
        return store.publish(work, manifest)
