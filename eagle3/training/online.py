"""Online hidden states (`train.hidden_states=online`): the verifier computes each training batch's
states while the draft trains (`eagle3.training.online_transfer`), so no hidden-state set is ever
stored: 0 bytes on disk, where offline states take 8*H bytes a token (32 KiB for an 8B verifier,
56 KiB at Kimi-K2.5's width; half in fp8) for as long as the store keeps them.

This step stands where extraction stands in the pipeline: it publishes an `online_states` artifact,
`online.json`, that holds no states but names what they are computed from (the verifier's and the
dataset's digests, the aux layers, the width and the storage precision they are rounded to). The
draft's cache key names it (its route `draft/online` in `eagle3.store.versions`: the code that
computes the states runs in training), and lineage shows the draft came from online states. Export
and evaluation read the aux layers from it as from a hidden-states artifact.

Cost, per epoch: one verifier prefill of every training and validation token (E epochs: E prefills,
where offline extracts once and reads files E times; `train.online_buffer_gb` keeps some states in
host memory from one epoch to the next), on the training GPU beside the draft, one after the other:
on one H100 with an 8B verifier a step runs at 0.35x the rate on states from disk (21.6k against
60.9k tokens/s; `bench/results/`), and counting extraction on the offline side online takes 0.95x
offline's time for 1 epoch, 1.42x for 2 and 1.70x for 3. It never needs the disk.
"""

from __future__ import annotations

import json

from pydantic import Field

from eagle3.config import ConfigError, ExtractConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.store.artifacts import ArtifactStore, step_provenance
from eagle3.store.files import atomic_write_text
from eagle3.store.manifests import Provenance
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["ONLINE_ROUTE", "OnlineStatesManifest", "online_states", "online_states_provenance"]

ONLINE_ROUTE = "hidden_states/online"


class OnlineStatesManifest(HiddenStatesManifest):
    """What training computes the states from; no shards. A `HiddenStatesManifest`, so the steps
    that read only the aux layers and the width (export, evaluation, warm start) take either."""

    kind: str = "online_states"
    shards: list[dict] = Field(default_factory=list, description="none: the states are computed in training")
    extracted_shards: int = 0
    reused_shards: int = 0


def online_states_provenance(store: ArtifactStore, cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest) -> Provenance:
    return step_provenance(ONLINE_ROUTE, store, cfg=cfg, dataset=dataset, verifier=verifier)


def online_states(
    cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest, store: ArtifactStore, provenance: Provenance
) -> OnlineStatesManifest:
    """Publish what training will compute the states from, in place of extracting them.

    Raises:
        ConfigError: `cfg.backend` is not the in-process one (training runs the verifier itself), or
            the aux layer ids do not fit the verifier.
    """
    from eagle3.extraction.extract_hidden_states import resolve_aux_layer_ids

    if cfg.backend != "transformers":
        raise ConfigError(
            f"train.hidden_states=online computes states in the training process: it needs extract.backend="
            f"transformers, not '{cfg.backend}' (or set train.hidden_states=offline)"
        )
    aux = resolve_aux_layer_ids(cfg.aux_layer_ids, verifier.num_hidden_layers, verifier.path)
    recipe = {
        "verifier": verifier.digest,
        "dataset": dataset.digest,
        "aux_layer_ids": aux,
        "hidden_size": verifier.hidden_size,
        "storage": cfg.storage,
    }
    with store.step_work_dir(OnlineStatesManifest, provenance) as (work, published):
        if published is not None:
            return published
        atomic_write_text(work / "online.json", json.dumps(recipe, indent=0))
        return store.publish(
            work,
            OnlineStatesManifest(
                **provenance.model_dump(),
                path=work,
                aux_layer_ids=aux,
                hidden_size=verifier.hidden_size,
                num_records=dataset.num_records,
                num_tokens=dataset.num_tokens,
                storage=cfg.storage,
            ),
        )
