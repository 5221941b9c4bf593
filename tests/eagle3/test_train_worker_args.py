"""The settings an attempt hands speculators' trainer: who reads the hidden-state files, how the aux states are normalized."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.config import TrainConfig, output_affecting
from eagle3.training.train_worker import TrainSpec, speculators_train_config
from eagle3.training.vocab_mapping import VocabManifest


def _flat(device: str, online_storage: str | None = None, **train) -> dict:
    vocab = VocabManifest(
        path=Path("vocab"), draft_vocab_size=32, verifier_vocab_size=64, num_distinct_supervised_tokens=40, coverage=1.0, padded=0
    )
    spec = TrainSpec(
        cfg=TrainConfig(**train),
        work=Path("work"),
        verifier_path=Path("verifier"),
        aux_layer_ids=[0, 1, 2],
        hidden_size=64,
        vocab=vocab,
        total_seq_len=512,
        device=device,
        online_storage=online_storage,
    )
    return speculators_train_config(spec).flatten()


@pytest.mark.parametrize("workers", [4, 12])
def test_a_gpu_attempt_reads_its_files_with_train_loader_workers_processes(workers):
    assert _flat("cuda:0", loader_workers=workers)["num_workers"] == workers


def test_cpu_and_online_attempts_read_in_their_own_process():
    assert _flat("cpu", loader_workers=12)["num_workers"] == 0
    assert _flat("cuda:0", online_storage="fp8", loader_workers=12)["num_workers"] == 0  # one verifier computes every state


def test_the_number_of_readers_stays_out_of_the_draft_key():
    assert output_affecting(TrainConfig(loader_workers=12)) == output_affecting(TrainConfig())


def test_eagle_3_1_fc_norm_replaces_the_norm_over_the_concatenated_states():
    assert (_flat("cpu")["norm_before_fc"], _flat("cpu")["fc_norm"]) == (True, False)  # speculators' EAGLE-3 default
    assert (_flat("cpu", fc_norm=True)["norm_before_fc"], _flat("cpu", fc_norm=True)["fc_norm"]) == (False, True)


def test_fc_norm_joins_the_draft_key_only_when_set():
    """Added after drafts were cached: at its default it computes what training computed before it
    existed, so the key stays the one pinned then (tests/tasks/test_cache_keys.py); set, it is keyed."""
    assert "fc_norm" not in output_affecting(TrainConfig())
    assert output_affecting(TrainConfig(fc_norm=True))["fc_norm"] is True
