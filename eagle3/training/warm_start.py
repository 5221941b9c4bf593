"""Warm start: continue from an earlier draft instead of fresh weights (`train.init_from=previous`).

Scheduled retraining on a dataset that grows should keep what the last draft learned
(`eagle3.train.previous_draft` picks which draft). Only trainable weights travel: the embeddings
and the output head are the verifier's own (frozen, and the head's rows follow this dataset's
draft vocabulary), so they stay as the new draft built them. A draft that read other verifier
layers is refused: its `fc` weights combine features the new hidden states do not hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.store.artifacts import ArtifactError

__all__ = ["warm_start"]


def warm_start(model, checkpoint: Path) -> None:
    """Load the trainable weights of the draft checkpoint directory `checkpoint` into `model`.

    Raises:
        ArtifactError: the checkpoint's draft read other aux layers than `model` reads, lacks a
            trainable weight of `model`, or holds it in another shape.
    """
    from safetensors.torch import load_file

    weights_file = checkpoint / "model.safetensors"
    earlier = load_file(weights_file)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    unfit = [
        f"{n} (missing)" if n not in earlier else f"{n} {tuple(earlier[n].shape)} vs {tuple(p.shape)}"
        for n, p in trainable.items()
        if n not in earlier or earlier[n].shape != p.shape
    ]
    if unfit:
        raise ArtifactError(
            weights_file, f"cannot warm-start this draft from it: {', '.join(unfit)}; set train.init_from=scratch to train afresh"
        )
    config_file = checkpoint / "config.json"
    if not config_file.exists():
        raise ArtifactError(
            config_file, "missing: it names the verifier layers that draft read; set train.init_from=scratch to train afresh"
        )
    earlier_ids = json.loads(config_file.read_text()).get("eagle_aux_hidden_state_layer_ids")
    ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    if earlier_ids != ids:
        raise ArtifactError(
            config_file,
            f"field 'eagle_aux_hidden_state_layer_ids' is {earlier_ids!r}: that draft read the verifier's layers "
            f"{earlier_ids}, this one reads {ids}, so its weights would start from features of other layers. Set "
            f"train.init_from=scratch, or extract.aux_layer_ids={earlier_ids} to continue that draft.",
        )
    model.load_state_dict({name: earlier[name] for name in trainable}, strict=False)
