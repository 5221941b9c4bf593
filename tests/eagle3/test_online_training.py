"""Online training (`train.hidden_states=online`): the verifier computes the states inside training,
none is stored, and the draft is the offline one's up to rounding.

What may legitimately differ between an online and an offline draft (same seeds, same data order,
same bf16 rounding of the states): how the verifier's forwards are batched. Extraction pads a
shard's records longest first into 8192-token forwards, online training the records of each training
batch into `total_seq_len`-token ones; other matmul shapes round float32 differently in the last bits,
which now and then moves a state's bf16 rounding by one step. Measured here: validation losses ~1e-7
apart (relative), accuracies equal. On a GPU, non-deterministic kernels add their own noise.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import first_epoch_steps

from eagle3.config import ConfigError, DatasetConfig, ExtractConfig, TrainConfig, VerifierConfig, VocabConfig, load_config
from eagle3.data.prepare_dataset import load_dataset_table, prepare_dataset
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.lineage import lineage
from eagle3.store.manifests import Provenance
from eagle3.training.online import online_states, online_states_provenance
from eagle3.training.train import train_draft, training_provenance
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # six short CPU trainings

EXTRACT = ExtractConfig(aux_layer_ids=[1, 2, 3], records_per_shard=12)
TRAIN = TrainConfig(epochs=2, total_seq_len=512)


class Killed(Exception):
    """Stands for a SIGKILL at the moment it is raised: nothing after it runs."""


def _prepared(store: ArtifactStore, tiny_verifier):
    from conftest import SAMPLE

    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256, max_records=24), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    return verifier, dataset, vocab


@pytest.fixture(scope="module")
def online_store(tiny_verifier, tmp_path_factory):
    """A store where nothing is extracted: the dataset, vocab and online-states artifact only."""
    store = ArtifactStore(tmp_path_factory.mktemp("online") / "store")
    verifier, dataset, vocab = _prepared(store, tiny_verifier)
    states = online_states(EXTRACT, dataset, verifier, store, online_states_provenance(store, EXTRACT, dataset, verifier))
    return store, verifier, dataset, vocab, states


def _online_provenance(online_store) -> Provenance:
    store, verifier, dataset, vocab, states = online_store
    return training_provenance(store, cfg=TRAIN, dataset=dataset, hidden_states=states, vocab=vocab, verifier=verifier, init=None)


@pytest.fixture(scope="module")
def online_draft(online_store):
    store, verifier, dataset, vocab, states = online_store
    return train_draft(TRAIN, dataset, states, vocab, verifier, store, _online_provenance(online_store))


def _hidden_state_bytes(store: ArtifactStore) -> int:
    """Bytes of every hidden-state file anywhere in the store (shards, work directories, links' targets)."""
    return sum(p.stat().st_size for p in store.root.rglob("hs_*.safetensors") if p.is_file() and not p.is_symlink())


def test_online_training_matches_offline_validation_metrics(online_draft, tiny_verifier, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    verifier, dataset, vocab = _prepared(store, tiny_verifier)
    hidden = extract_hidden_states(EXTRACT, dataset, verifier, store, Provenance())

    offline = train_draft(TRAIN, dataset, hidden, vocab, verifier, store, Provenance())

    assert [e["epoch"] for e in online_draft.epochs] == [e["epoch"] for e in offline.epochs] == [0, 1]
    assert online_draft.num_steps == offline.num_steps
    for on, off in zip(online_draft.epochs, offline.epochs, strict=True):
        assert on["val_loss"] == pytest.approx(off["val_loss"], rel=1e-4)
        assert {k: v for k, v in on.items() if "acc" in k or k == "tau_sim"} == pytest.approx(
            {k: v for k, v in off.items() if "acc" in k or k == "tau_sim"}, abs=1e-3
        )


def test_online_training_leaves_no_hidden_state_bytes_on_disk(online_store, online_draft):
    store = online_store[0]

    assert _hidden_state_bytes(store) == 0
    assert not (store.root / "shards").exists() or not any((store.root / "shards").iterdir())
    assert not any((store.root / "work").iterdir())  # the step's work directory (data, checkpoints) is gone
    assert (online_draft.path / "checkpoint" / "model.safetensors").exists()


def test_the_online_draft_is_keyed_and_traced_to_the_online_states(online_store, online_draft):
    store, verifier, dataset, _, states = online_store

    provenance = _online_provenance(online_store)
    nodes = lineage(store, [online_draft.digest])

    assert provenance.code_version.startswith("draft/online v1 (torch ")
    assert provenance.parents["hidden_states"] == states.digest
    recipe = json.loads((states.path / "online.json").read_text())
    assert recipe == {
        "verifier": verifier.digest,
        "dataset": dataset.digest,
        "aux_layer_ids": [1, 2, 3],
        "hidden_size": 64,
        "storage": "bf16",
    }
    [online_node] = [n for n in nodes.values() if n["kind"] == "online_states"]
    assert online_node["parents"] == {"dataset": dataset.digest, "verifier": verifier.digest}
    assert nodes[online_draft.digest]["parents"]["hidden_states"] == states.digest
    assert not any(n["kind"] == "hidden_states" for n in nodes.values())


def test_a_killed_online_training_resumes_to_the_uninterrupted_draft(online_store, online_draft):
    store, verifier, dataset, vocab, states = online_store

    first_epoch = first_epoch_steps(online_draft)

    def kill_in_second_epoch(step, total, metrics):
        if step > first_epoch + 1:
            raise Killed

    with pytest.raises(Killed):
        train_draft(TRAIN, dataset, states, vocab, verifier, store, Provenance(config={"run": "killed"}), on_step=kill_in_second_epoch)
    resumed = []

    draft = train_draft(
        TRAIN, dataset, states, vocab, verifier, store, Provenance(config={"run": "killed"}), on_step=lambda s, t, m: resumed.append(s)
    )

    assert resumed[0] > 1  # the first epoch was not trained again
    assert draft.digest == online_draft.digest  # weights, metrics and curves, byte for byte
    assert _hidden_state_bytes(store) == 0


@pytest.mark.parametrize(("keep_bytes", "prefills"), [(0, 2), (10**9, 1)])
def test_kept_states_are_computed_once_across_epochs(online_store, keep_bytes, prefills):
    from eagle3.training.online_transfer import OnlineStates

    _, verifier, dataset, _, _ = online_store
    ids = load_dataset_table(dataset).column("input_ids").to_pylist()
    samples = {i: torch.tensor(ids[i]) for i in (0, 1, 2)}
    states = OnlineStates(verifier.path, [1, 2, 3], "fp8", torch.device("cpu"), torch.float32, budget=512, keep_bytes=keep_bytes)

    reads = []
    for _epoch in range(2):
        states.prefill(samples)
        reads.append({i: states.get_cached(i) for i in samples})
    states.close()

    assert states.prefilled_tokens == prefills * sum(len(t) for t in samples.values())
    for i, t in samples.items():
        first, second = reads[0][i], reads[1][i]
        assert torch.equal(first["token_ids"], t) and first["hidden_states"].shape == (len(t), 4, 64)
        assert first["hidden_states"].dtype == torch.float32
        assert torch.equal(second["hidden_states"], first["hidden_states"])


def test_online_training_refuses_a_server_extraction_backend():
    with pytest.raises(
        ConfigError, match=r"train\.hidden_states=online computes states in the training process: it needs extract\.backend"
    ):
        load_config(overrides=["train.hidden_states=online", "extract.backend=vllm", "extract.endpoint.model=served"])
