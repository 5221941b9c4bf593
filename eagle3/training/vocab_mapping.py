"""Build the vocab mapping: which verifier tokens the draft can propose.

Uses speculators' `build_vocab_mappings_from_distribution` on the prepared dataset's token
frequencies (supervised positions only). Output `vocab_mapping.safetensors`: `d2t` [draft_vocab]
int64 offsets (verifier id = draft id + d2t[draft id]) and `t2d` [verifier_vocab] bool. Coverage
is the share of supervised tokens the draft vocab contains: the ceiling on draft accuracy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import ConfigError, VocabConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import ArtifactManifest, Provenance

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch

__all__ = ["VocabManifest", "build_vocab_mapping", "load_vocab_mapping"]

logger = logging.getLogger(__name__)
FILE = "vocab_mapping.safetensors"


class VocabManifest(ArtifactManifest):
    kind: str = "vocab_mapping"
    draft_vocab_size: int
    verifier_vocab_size: int
    num_distinct_supervised_tokens: int
    coverage: float
    padded: int


def build_vocab_mapping(
    cfg: VocabConfig, dataset: DatasetManifest, verifier_vocab_size: int, store: ArtifactStore, provenance: Provenance
) -> VocabManifest:
    """Top-`draft_vocab_size` supervised tokens by frequency, as speculators' d2t/t2d.

    A draft vocab larger than the number of distinct supervised tokens is padded by speculators
    with unused low ids; that is reported in `padded`, not an error.

    Raises:
        ConfigError: draft_vocab_size exceeds the verifier's vocabulary.
    """
    import pyarrow.parquet as pq
    from safetensors.torch import save_file
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if cfg.draft_vocab_size > verifier_vocab_size:
        raise ConfigError(
            f"vocab.draft_vocab_size = {cfg.draft_vocab_size} exceeds the verifier's vocabulary "
            f"({verifier_vocab_size}); set it at most {verifier_vocab_size}."
        )
    with store.step_work_dir(VocabManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step
        freq_table = pq.read_table(Path(dataset.path) / "token_freq.parquet").to_pydict()
        freq = dict(zip(freq_table["token_id"], freq_table["count"]))
        d2t, t2d = build_vocab_mappings_from_distribution(freq, cfg.draft_vocab_size, verifier_vocab_size)
        covered = sum(c for t, c in freq.items() if t2d[t])
        padded = max(0, cfg.draft_vocab_size - len(freq))
        if padded:
            logger.warning(
                "vocab.draft_vocab_size = %d but only %d distinct tokens are supervised: %d draft ids are "
                "padding the draft will never learn. Use more data or a smaller draft_vocab_size.",
                cfg.draft_vocab_size,
                len(freq),
                padded,
            )
        save_file({"d2t": d2t, "t2d": t2d}, work / FILE)
        return store.publish(
            work,
            VocabManifest(
                **provenance.model_dump(),
                path=work,
                draft_vocab_size=cfg.draft_vocab_size,
                verifier_vocab_size=verifier_vocab_size,
                num_distinct_supervised_tokens=len(freq),
                coverage=covered / sum(freq.values()),
                padded=padded,
                seconds=clock(),
            ),
        )


def load_vocab_mapping(manifest: VocabManifest) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) tensors of a vocab-mapping artifact."""
    from safetensors.torch import load_file

    tensors = load_file(Path(manifest.path) / FILE)
    return tensors["d2t"], tensors["t2d"]
