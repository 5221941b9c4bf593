"""Training after a kill, a signal or a full disk: the re-run resumes without hand repair and publishes
the draft an uninterrupted run publishes; settings that would cut supervised tokens are refused.

Kill windows are reproduced in-process: an exception raised where the kill lands (a step callback,
speculators' validation), then the files such a kill leaves cut short by hand.
"""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import speculators.train.trainer as trainer_module
import torch

from eagle3.config import ConfigError, DatasetConfig, ExtractConfig, TrainConfig, VerifierConfig, VocabConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.extraction.shards import hidden_state_files
from eagle3.runtime.faults import FAULT_OOM_ENV
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.training.epochs import best_epoch, epoch_summaries
from eagle3.training.packing import supervised_extent
from eagle3.training.resume import drop_checkpoints_before, prepare_resume
from eagle3.training.train import ship_best_epoch, train_draft
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # each test trains, kills and resumes a draft

TRAIN = TrainConfig(epochs=2, total_seq_len=512)


class Killed(Exception):
    """Stands for a SIGKILL at the moment it is raised: nothing after it runs."""


def _inputs(store: ArtifactStore, tiny_verifier):
    """32 sample conversations, prepared, extracted (two shards) and mapped for a tiny verifier."""
    from conftest import SAMPLE

    conversations = store.root.parent / "conversations.jsonl"
    conversations.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:32]))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256), conversations, load_tokenizer(verifier.path), store, Provenance())
    hidden = extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 3], records_per_shard=16), dataset, verifier, store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    return verifier, dataset, hidden, vocab


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ArtifactStore(tmp_path_factory.mktemp("resume") / "store")


@pytest.fixture(scope="module")
def inputs(store, tiny_verifier):
    return _inputs(store, tiny_verifier)


def _train(store, inputs, run: str, cfg: TrainConfig = TRAIN, **kwargs):
    verifier, dataset, hidden, vocab = inputs
    return train_draft(cfg, dataset, hidden, vocab, verifier, store, Provenance(config={"run": run}), **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(store, inputs):
    return {epochs: _train(store, inputs, f"uninterrupted-{epochs}", TRAIN.model_copy(update={"epochs": epochs})) for epochs in (1, 2)}


def _work(store, run: str):
    """Where a killed run of `_train(..., run)` left its work (the step's work directory)."""
    return store.root / "work" / f"draft-{Provenance(config={'run': run}).key[:24]}"


def _kill_in_second_epoch(store, run: str):
    """A step callback for `_train(..., run)` that kills it at its first step after the first epoch's
    validation reached its metrics log, whatever the epochs' lengths (each epoch is packed anew)."""

    def on_step(step, total, metrics):
        if '"val":' in (_work(store, run) / "metrics.jsonl").read_text():
            raise Killed

    return on_step


def _kill_in_validation_of(epoch: int, monkeypatch):
    validate = trainer_module.Trainer.val_epoch

    def val_epoch(self, e):
        if e == epoch:
            raise Killed
        return validate(self, e)

    monkeypatch.setattr(trainer_module.Trainer, "val_epoch", val_epoch)


def test_a_resumed_training_publishes_the_draft_an_uninterrupted_one_does(store, inputs, uninterrupted):
    with pytest.raises(Killed):
        _train(store, inputs, "killed", on_step=_kill_in_second_epoch(store, "killed"))
    resumed = []

    draft = _train(store, inputs, "killed", on_step=lambda s, t, m: resumed.append(s))

    assert resumed[0] > 1  # the first epoch was not trained again
    assert draft.digest == uninterrupted[2].digest  # weights, metrics and curves, byte for byte


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_kill_during_the_last_validation_is_validated_again_on_resume(store, inputs, uninterrupted, epochs, monkeypatch):
    cfg = TRAIN.model_copy(update={"epochs": epochs})
    with monkeypatch.context() as patch:
        _kill_in_validation_of(epochs - 1, patch)
        with pytest.raises(Killed):
            _train(store, inputs, f"killed-in-validation-{epochs}", cfg)

    draft = _train(store, inputs, f"killed-in-validation-{epochs}", cfg)

    assert [e["epoch"] for e in draft.epochs] == list(range(epochs))
    assert draft.tau_sim == uninterrupted[epochs].tau_sim
    assert draft.digest == uninterrupted[epochs].digest


def test_an_epoch_checkpoint_cut_short_is_skipped_for_the_one_before_it(store, inputs, uninterrupted, monkeypatch):
    with monkeypatch.context() as patch:
        _kill_in_validation_of(1, patch)
        with pytest.raises(Killed):
            _train(store, inputs, "torn-checkpoint")
    last = _work(store, "torn-checkpoint") / "checkpoints" / "1"
    weights = (last / "model.safetensors").read_bytes()
    for written_after_the_weights in ("optimizer_state_dict.pt", "scheduler_state_dict.pt", "training_state.json"):
        (last / written_after_the_weights).unlink()
    (last / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # killed while speculators wrote it

    draft = _train(store, inputs, "torn-checkpoint")

    assert draft.digest == uninterrupted[2].digest


def test_lines_of_the_training_logs_a_full_disk_cut_short_are_dropped(store, inputs, uninterrupted):
    with pytest.raises(Killed):
        _train(store, inputs, "full-disk", on_step=_kill_in_second_epoch(store, "full-disk"))
    work = _work(store, "full-disk")
    with open(work / "metrics.jsonl", "a") as log:
        log.write('{"train": {"loss_0": 0.5, "full_acc')
    with open(work / "timing.jsonl", "a") as log:
        log.write('{"global_step": 7, "ended_at": 17')

    draft = _train(store, inputs, "full-disk")

    assert draft.digest == uninterrupted[2].digest


def test_a_signal_mid_training_resumes_from_the_last_epoch_without_renaming_anything(store, inputs, uninterrupted, caplog):
    def terminate_in_second_epoch(step, total, metrics):
        if step == total // TRAIN.epochs + 2:
            os.kill(os.getpid(), signal.SIGTERM)  # speculators' handler saves checkpoints/interrupted and returns

    with pytest.raises(RuntimeError, match="interrupted after 1 of 2 epochs"):
        _train(store, inputs, "sigterm", on_step=terminate_in_second_epoch)
    assert (_work(store, "sigterm") / "checkpoints" / "interrupted").is_dir()
    caplog.set_level(logging.INFO)

    draft = _train(store, inputs, "sigterm")

    assert "rename it to an epoch number" not in caplog.text
    assert draft.digest == uninterrupted[2].digest


def test_a_signal_after_the_last_epoch_s_validation_still_fails_the_step_and_a_rerun_publishes_the_same_draft(
    store, inputs, uninterrupted, monkeypatch
):
    """Every epoch is validated by then, so only speculators' interrupted/ checkpoint tells of the
    signal; a step that published would let the run go on as if it had not been told to stop."""
    update = trainer_module.Trainer.maybe_update_best

    def maybe_update_best(self, epoch, *args, **kwargs):
        if epoch == TRAIN.epochs - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # speculators' handler saves checkpoints/interrupted and returns
        return update(self, epoch, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module.Trainer, "maybe_update_best", maybe_update_best)
        with pytest.raises(RuntimeError, match=f"interrupted after {TRAIN.epochs} of {TRAIN.epochs} epochs"):
            _train(store, inputs, "sigterm-after-the-last-epoch")

    assert _train(store, inputs, "sigterm-after-the-last-epoch").digest == uninterrupted[2].digest


def test_speculators_batches_lose_exactly_the_supervised_tokens_the_extent_says(inputs):
    """The reading of speculators' sampler and collate that `packing` rests on, checked on its own code."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from eagle3.data.prepare_dataset import load_dataset_table

    dataset = inputs[1]
    table = load_dataset_table(dataset)
    masks = [torch.tensor(m) for m in table.column("loss_mask").to_pylist()]
    extent = supervised_extent(dataset)

    def trained(total_seq_len: int) -> int:
        sampler = MultipackDistributedBatchSamplerV2(total_seq_len, [len(m) for m in masks], num_replicas=1, rank=0)
        collate = CollateFn(total_seq_len, hidden_size=2, num_target_layers=1, preprocess=shift_batch)
        records = [
            {
                "input_ids": torch.zeros(len(m), dtype=torch.long),
                "hidden_states": torch.zeros(len(m), 2),
                "verifier_last_hidden_states": torch.zeros(len(m), 2),
                "loss_mask": m,
                "lengths": torch.tensor([len(m)]),
                "position_ids": torch.arange(len(m)),
            }
            for m in masks
        ]
        return sum(int(collate([records[i] for i in batch])["loss_mask"].sum()) for batch in sampler)

    supervised = sum(int(m[1:].sum()) for m in masks)  # position 0 is never a target
    for total_seq_len in (extent.tokens, extent.tokens - 1, 64, 16):
        assert supervised - trained(total_seq_len) == supervised_extent(dataset, total_seq_len).cut_tokens
    assert supervised_extent(dataset, extent.tokens - 1).cut_tokens > 0


def test_a_total_seq_len_that_cuts_supervised_tokens_is_refused_before_training(store, inputs):
    extent = supervised_extent(inputs[1])

    with pytest.raises(
        ConfigError,
        match=rf"train.total_seq_len = 16 would cut \d+ supervised tokens .* record {extent.record} "
        rf"\('{extent.record_id}', {extent.seq_len} tokens, supervised up to position {extent.tokens}\)"
        r".*dataset.max_seq_len",
    ):
        _train(store, inputs, "cut", TrainConfig(epochs=1, total_seq_len=16))
    assert not _work(store, "cut").exists()  # refused before the step started


def test_a_total_seq_len_down_to_the_last_supervised_position_trains(store, inputs):
    extent = supervised_extent(inputs[1])

    draft = _train(store, inputs, "tight", TrainConfig(epochs=1, total_seq_len=extent.tokens))

    assert draft.num_steps > 0


def test_out_of_memory_backs_off_no_further_than_the_last_supervised_position(store, inputs, monkeypatch):
    extent = supervised_extent(inputs[1])
    assert 128 < extent.tokens < 256  # so halving 256 would cut: the back-off tries the extent instead
    monkeypatch.setenv(FAULT_OOM_ENV, str(extent.tokens))

    draft = _train(store, inputs, "oom-extent", TrainConfig(epochs=1, total_seq_len=512, min_total_seq_len=16))

    assert [(b.value, b.retry_with) for b in draft.backoffs] == [(512, 256), (256, extent.tokens)]


def test_a_run_killed_after_backing_off_resumes_at_the_total_seq_len_it_reached(store, inputs, monkeypatch, caplog):
    extent = supervised_extent(inputs[1])
    monkeypatch.setenv(FAULT_OOM_ENV, str(extent.tokens))  # 512 and 256 run out of memory, every time
    cfg = TRAIN.model_copy(update={"total_seq_len": 512, "min_total_seq_len": 16})
    with pytest.raises(Killed):
        _train(store, inputs, "oom-killed", cfg, on_step=_kill_in_second_epoch(store, "oom-killed"))
    caplog.set_level(logging.INFO, logger="eagle3")

    draft = _train(store, inputs, "oom-killed", cfg)

    # The killed run's back-offs, and no new one: the re-run did not try 512 and 256 again
    assert [(b.value, b.retry_with) for b in draft.backoffs] == [(512, 256), (256, extent.tokens)]
    assert f"resuming at train.total_seq_len={extent.tokens}, where this work backed off to before" in caplog.text
    assert [e["epoch"] for e in draft.epochs] == [0, 1]


def test_out_of_memory_below_the_last_supervised_position_fails_naming_the_record(store, inputs, monkeypatch):
    extent = supervised_extent(inputs[1])
    monkeypatch.setenv(FAULT_OOM_ENV, str(extent.tokens - 1))

    with pytest.raises(
        RuntimeError,
        match=rf"train.total_seq_len = \[512, 256, {extent.tokens}\]\) down to the longest record's "
        rf"last supervised position \(record {extent.record}.*lower dataset.max_seq_len",
    ):
        _train(store, inputs, "oom-cut", TrainConfig(epochs=1, total_seq_len=512, min_total_seq_len=16))


@pytest.mark.parametrize("damage", ["same_size_edit", "truncated"])
def test_training_refuses_a_changed_shard_file_and_the_rerun_extracts_it_again(tiny_verifier, tmp_path, damage):
    store = ArtifactStore(tmp_path / "store")
    verifier, dataset, hidden, vocab = _inputs(store, tiny_verifier)
    victim = hidden_state_files(hidden)[5]
    data = bytearray(victim.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[-3] ^= 0xFF  # in the last hidden state's bytes: the file still loads
    victim.write_bytes(bytes(data))
    cfg = TrainConfig(epochs=1, total_seq_len=512)

    with pytest.raises(ArtifactError, match=rf"{victim.parent}: {victim.name} hashes to \w+, but done.json recorded \w+ .*re-run"):
        train_draft(cfg, dataset, hidden, vocab, verifier, store, Provenance())
    assert not victim.parent.exists() and not hidden.path.exists()

    again = extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 3], records_per_shard=16), dataset, verifier, store, Provenance())
    draft = train_draft(cfg, dataset, again, vocab, verifier, store, Provenance())

    assert again.extracted_shards == 1 and again.digest == hidden.digest  # the same bytes as first extracted
    assert draft.num_steps > 0


def _validation(epoch: int, cond_acc: list[float]) -> dict:
    val = {
        "loss_epoch": 1.0,
        **{f"cond_acc_{k}_epoch": a for k, a in enumerate(cond_acc)},
        **{f"full_acc_{k}_epoch": a for k, a in enumerate(cond_acc)},
    }
    return {"epoch": epoch, "val": val}


def test_the_draft_ships_the_epoch_with_the_best_simulated_acceptance_the_later_on_a_tie():
    summaries = epoch_summaries(
        [
            _validation(0, [0.6, 0.5, 0.4]),
            _validation(1, [0.7, 0.5, 0.4]),
            _validation(2, [0.7, 0.5, 0.4]),
            _validation(3, [0.5, 0.5, 0.5]),
        ],
        ttt_steps=3,
    )

    assert [round(s["tau_sim"], 3) for s in summaries] == [2.02, 2.19, 2.19, 1.875]  # 1 + 0.6 + 0.6 x 0.5 + 0.6 x 0.5 x 0.4, ...
    assert best_epoch(summaries) == 2 and best_epoch([]) is None


def test_a_trained_draft_records_the_epoch_it_ships(uninterrupted):
    draft = uninterrupted[2]

    assert draft.selected_epoch == best_epoch(draft.epochs)
    assert draft.tau_sim == draft.epochs[draft.selected_epoch]["tau_sim"]


def test_the_weights_shipped_are_those_of_the_best_validated_epoch_not_the_last(tmp_path):
    from safetensors.torch import load_file, save_file

    checkpoints = tmp_path / "checkpoints"
    for epoch in range(3):  # each epoch's float32 weights tell it apart
        (checkpoints / str(epoch)).mkdir(parents=True)
        save_file({"fc.weight": torch.full((2, 2), epoch + 0.5)}, checkpoints / str(epoch) / "model.safetensors")
        (checkpoints / str(epoch) / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    records = [_validation(0, [0.5, 0.4, 0.3]), _validation(1, [0.9, 0.8, 0.7]), _validation(2, [0.6, 0.5, 0.4])]

    shipped = ship_best_epoch(checkpoints, epoch_summaries(records, 3), tmp_path / "out")

    assert shipped == 1
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["fc.weight"].unique().tolist() == [1.5]


def _whole_checkpoint(checkpoints, epoch: int) -> None:
    from safetensors.torch import save_file

    folder = checkpoints / str(epoch)
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, folder / "model.safetensors")
    (folder / "optimizer_state_dict.pt").write_bytes(b"state")
    (folder / "training_state.json").write_text(json.dumps({"epoch": epoch, "local_step": 0}))


def test_resuming_keeps_the_best_validated_checkpoint_beside_the_one_it_resumes_from(tmp_path):
    checkpoints, metrics = tmp_path / "checkpoints", tmp_path / "metrics.jsonl"
    for epoch in range(3):
        _whole_checkpoint(checkpoints, epoch)
    records = [_validation(0, [0.9, 0.9, 0.9]), _validation(1, [0.2, 0.2, 0.2]), _validation(2, [0.3, 0.3, 0.3])]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))

    drop_checkpoints_before(checkpoints, 2, keep=0)
    point = prepare_resume(checkpoints, metrics, tmp_path / "timing.jsonl", ttt_steps=3)

    assert point.epoch == 2 and sorted(p.name for p in checkpoints.iterdir()) == ["0", "2"]
