from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import speculators.train.checkpointer as checkpointer_module
import speculators.train.trainer as trainer_module
import torch
from conftest import CLAIM_WAIT_S, first_epoch_steps, run_while_another_run_holds_the_step

from eagle3.config import (
    DatasetConfig,
    EvalConfig,
    ExportConfig,
    ExtractConfig,
    PromotionConfig,
    RegenerateConfig,
    TrainConfig,
    VerifierConfig,
    VocabConfig,
)
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.data.regenerate import regenerate, regenerated_conversations
from eagle3.evaluation.baseline import measure_baselines
from eagle3.evaluation.evaluate import evaluate
from eagle3.evaluation.promotion import promote
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.runtime.faults import FAULT_OOM_ENV
from eagle3.store.artifacts import ArtifactError, ArtifactStore, step_provenance
from eagle3.store.manifests import MANIFEST, Provenance
from eagle3.training import trainer_compat
from eagle3.training.epochs import simulated_acceptance_length
from eagle3.training.export import export_checkpoint, validate_checkpoint
from eagle3.training.train import DraftManifest, _speculators_data_dir, previous_draft, train_draft
from eagle3.training.train_worker import OOM_EXIT, TrainSpec
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # each test trains a draft with speculators' trainer

TRAIN = TrainConfig(epochs=3, total_seq_len=512)


@pytest.fixture(scope="module")
def inputs(tiny_verifier, tmp_path_factory):
    from conftest import SAMPLE

    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    hidden = extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 3]), dataset, verifier, store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    return store, verifier, dataset, hidden, vocab


@pytest.fixture(scope="module")
def draft(inputs):
    store, verifier, dataset, hidden, vocab = inputs
    return train_draft(TRAIN, dataset, hidden, vocab, verifier, store, _as_the_task_keys_it(store, TRAIN, inputs))


def _as_the_task_keys_it(store, cfg, inputs, init=None) -> Provenance:
    """The provenance the training task gives the step (what `previous_draft` reads back)."""
    _, verifier, dataset, hidden, vocab = inputs
    return step_provenance("draft", store, cfg=cfg, dataset=dataset, hidden_states=hidden, vocab=vocab, verifier=verifier, init=init)


def test_simulated_acceptance_length_is_one_plus_sum_of_chain_products():
    assert simulated_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1.875)
    assert simulated_acceptance_length([1.0, 0.0, 1.0]) == 2.0


def test_a_run_waiting_for_another_run_of_the_step_claims_its_gpu_only_once_it_holds_the_step(inputs):
    store, verifier, dataset, hidden, vocab = inputs
    cfg = TrainConfig(epochs=1, total_seq_len=512)
    provenance = Provenance(config={"run": "claimed"})

    run = run_while_another_run_holds_the_step(
        store, DraftManifest, provenance, lambda claim: train_draft(cfg, dataset, hidden, vocab, verifier, store, provenance, claim=claim)
    )

    [claimed] = run.claimed_at
    assert claimed >= run.released_at
    assert len(run.result.epochs) == 1
    assert run.result.seconds <= run.finished_at - run.released_at - CLAIM_WAIT_S
    accounted = sum(seconds for part, seconds in run.result.time_breakdown_s.items() if part != "waiting_for_data")
    assert accounted <= run.finished_at - run.released_at - CLAIM_WAIT_S  # its startup leaves out the wait too


def test_training_logs_per_step_accuracies_and_simulated_tau(draft):
    steps = [json.loads(line) for line in (draft.path / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s["train"] for s in steps if "train" in s]

    assert len(train_steps) == draft.num_steps > 0
    assert {f"{m}_{k}" for m in ("loss", "full_acc", "cond_acc") for k in range(3)} <= set(train_steps[0])
    last = draft.epochs[-1]
    assert [e["epoch"] for e in draft.epochs] == [0, 1, 2]
    assert last["tau_sim"] == pytest.approx(simulated_acceptance_length([last[f"cond_acc_{k}"] for k in range(3)]))
    assert draft.tau_sim == draft.epochs[draft.selected_epoch]["tau_sim"] == max(e["tau_sim"] for e in draft.epochs)
    assert draft.epochs[-1]["val_loss"] < draft.epochs[0]["val_loss"]


def test_training_throughput_counts_tokens_per_second_of_step_time(inputs, draft):
    dataset = inputs[2]
    trained_tokens = TRAIN.epochs * dataset.num_tokens * 0.5  # at least half the records train each epoch
    # Steps take part of the step's wall time, so a true tokens-per-second rate covers the trained tokens.
    assert draft.tokens_per_s * draft.seconds > trained_tokens
    assert draft.tokens_per_s < dataset.num_tokens * TRAIN.epochs  # not per millisecond: a step takes > 1 ms here


def test_training_time_is_split_into_phases_that_add_up_to_the_step(draft):
    phases = draft.time_breakdown_s
    counted = {k: v for k, v in phases.items() if k != "waiting_for_data"}  # part of `steps`

    assert set(counted) == {"startup", "first_step", "steps", "validation", "other"}
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(counted.values()) == pytest.approx(draft.seconds, abs=0.05)  # both from the same start and end
    assert phases["steps"] > phases["waiting_for_data"] and phases["validation"] > 0
    assert phases["steps"] > phases["first_step"]  # on CPU nothing is compiled: the later steps outweigh the first


def test_training_draws_its_curves_into_the_draft(draft):
    from PIL import Image

    png = draft.path / draft.curves

    with Image.open(png) as image:
        image.load()
    assert image.format == "PNG" and image.size == (720, 256)
    assert png.stat().st_size < 100_000  # it travels base64-encoded in a Prefect artifact
    colors = {color: count for count, color in image.convert("RGB").getcolors(maxcolors=1 << 16)}
    # matplotlib's first line colour (the train loss curve) is drawn: the image is not blank.
    assert colors.get((31, 119, 180), 0) > 100
    assert len(colors) > 50


def _validated_epochs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "eagle3.training.train_worker"]


def test_interrupted_training_resumes_from_the_last_epoch_checkpoint(inputs, draft, caplog):
    caplog.set_level(logging.INFO, logger="eagle3.training.train_worker")
    store, verifier, dataset, hidden, vocab = inputs
    provenance = Provenance(config={"run": "resume"})
    seen = []
    first_epoch = first_epoch_steps(draft)

    class Killed(Exception):
        pass

    def die_in_second_epoch(step, total, metrics):
        seen.append(step)
        if step > first_epoch + 1:
            raise Killed

    with pytest.raises(Killed):
        train_draft(TRAIN, dataset, hidden, vocab, verifier, store, provenance, on_step=die_in_second_epoch)
    killed_log = _validated_epochs(caplog)
    resumed = []
    caplog.clear()

    manifest = train_draft(TRAIN, dataset, hidden, vocab, verifier, store, provenance, on_step=lambda s, t, m: resumed.append((s, t)))

    # Epoch 1 starts over where epoch 0's checkpoint left off; epoch 0 is not trained again.
    assert 1 < resumed[0][0] <= seen[-1]
    assert [s for s, _ in resumed] == list(range(resumed[0][0], resumed[0][0] + len(resumed)))
    # The planned total is the steps taken (the packing sampler's epochs differ in length): the bar ends full.
    assert {t for _, t in resumed} == {resumed[-1][0]} == {manifest.num_steps}
    assert [e["epoch"] for e in manifest.epochs] == [0, 1, 2]
    # The log says how far the killed run got, and the resumed run's epochs with the figures the draft records.
    first, *later = manifest.epochs
    assert killed_log == [
        f"train draft: epoch 1 of 3 validated: tau_sim {first['tau_sim']:.3f}, loss {first['val_loss']:.3f}, "
        f"acceptance by TTT step {first['cond_acc_0']:.3f} / {first['cond_acc_1']:.3f} / {first['cond_acc_2']:.3f}"
    ]
    assert [line.split(":")[1] for line in _validated_epochs(caplog)] == [" epoch 2 of 3 validated", " epoch 3 of 3 validated"]
    assert [f"tau_sim {e['tau_sim']:.3f}" in line for e, line in zip(later, _validated_epochs(caplog))] == [True, True]


def test_a_signal_mid_training_fails_the_step_and_keeps_finished_epochs(inputs, draft):
    store, verifier, dataset, hidden, vocab = inputs
    provenance = Provenance(config={"run": "sigterm"})
    first_epoch = first_epoch_steps(draft)

    def terminate_in_second_epoch(step, total, metrics):
        if step == first_epoch + 1:
            os.kill(os.getpid(), signal.SIGTERM)  # speculators' handler saves a checkpoint and returns

    published_before = set((store.root / "artifacts").iterdir())

    with pytest.raises(RuntimeError, match=r"interrupted after 1 of 3 epochs; finished epochs are kept in .*checkpoints"):
        train_draft(TRAIN, dataset, hidden, vocab, verifier, store, provenance, on_step=terminate_in_second_epoch)
    assert set((store.root / "artifacts").iterdir()) == published_before
    resumed = []

    manifest = train_draft(TRAIN, dataset, hidden, vocab, verifier, store, provenance, on_step=lambda s, t, m: resumed.append(s))

    assert resumed[0] > 1 and [e["epoch"] for e in manifest.epochs] == [0, 1, 2]


def test_out_of_memory_resumes_from_the_last_checkpoint_with_half_the_batch(inputs, monkeypatch):
    store, verifier, dataset, hidden, vocab = inputs
    monkeypatch.setenv(FAULT_OOM_ENV, "300")

    manifest = train_draft(
        TrainConfig(epochs=1, total_seq_len=512, min_total_seq_len=128),
        dataset,
        hidden,
        vocab,
        verifier,
        store,
        Provenance(config={"run": "oom"}),
    )

    assert [(b.setting, b.value, b.retry_with) for b in manifest.backoffs] == [("train.total_seq_len", 512, 256)]
    assert "simulated out of memory: 512 training tokens" in manifest.backoffs[0].error
    assert manifest.num_steps > 0 and [e["epoch"] for e in manifest.epochs] == [0]


def test_a_run_resumed_after_backing_off_plans_the_steps_it_takes(inputs, draft, monkeypatch):
    """Epoch 0 trained at 512 tokens a batch, the later epochs packed anew at 256 after a back-off:
    the bar's total is the steps taken."""
    store, verifier, dataset, hidden, vocab = inputs
    cfg = TRAIN.model_copy(update={"min_total_seq_len": 128})  # packs epoch 0 as `draft` did
    provenance = Provenance(config={"run": "backed-off-plan"})
    first_epoch = first_epoch_steps(draft)

    class Killed(Exception):
        pass

    def die_in_second_epoch(step, total, metrics):
        if step > first_epoch + 1:
            raise Killed

    with pytest.raises(Killed):
        train_draft(cfg, dataset, hidden, vocab, verifier, store, provenance, on_step=die_in_second_epoch)
    monkeypatch.setenv(FAULT_OOM_ENV, "300")
    bar = []

    manifest = train_draft(cfg, dataset, hidden, vocab, verifier, store, provenance, on_step=lambda s, t, m: bar.append((s, t)))

    assert [(b.value, b.retry_with) for b in manifest.backoffs] == [(512, 256)]
    assert bar[0][0] == first_epoch + 1  # epoch 1, repacked
    assert {t for _, t in bar} == {bar[-1][0]} == {manifest.num_steps}


def test_out_of_memory_at_the_minimum_batch_fails_saying_what_was_tried(inputs, monkeypatch):
    store, verifier, dataset, hidden, vocab = inputs
    monkeypatch.setenv(FAULT_OOM_ENV, "100")
    cfg = TrainConfig(epochs=1, total_seq_len=512, min_total_seq_len=256)

    with pytest.raises(RuntimeError, match=r"train.total_seq_len = \[512, 256\]\) down to train.min_total_seq_len = 256"):
        train_draft(cfg, dataset, hidden, vocab, verifier, store, Provenance(config={"run": "oom-min"}))


def test_the_worker_process_trains_and_reports_out_of_memory_by_exit_code(inputs, tmp_path):
    """The protocol torchrun runs on GPUs, exercised on CPU: spec file in, checkpoints, metrics and
    an out-of-memory marker out."""
    _store, verifier, dataset, hidden, vocab = inputs
    _speculators_data_dir(tmp_path, dataset, hidden)
    spec = TrainSpec(
        cfg=TrainConfig(epochs=1, total_seq_len=512),
        work=tmp_path,
        verifier_path=verifier.path,
        aux_layer_ids=hidden.aux_layer_ids,
        hidden_size=hidden.hidden_size,
        vocab=vocab,
        total_seq_len=512,
        device="cpu",
    )
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    run = [sys.executable, "-m", "eagle3.training.train_worker", str(tmp_path / "spec.json")]

    failed = subprocess.run(run, env={**os.environ, FAULT_OOM_ENV: "300"}, capture_output=True, text=True, timeout=600)
    trained = subprocess.run(run, capture_output=True, text=True, timeout=600)

    assert failed.returncode == OOM_EXIT, failed.stderr[-2000:]
    assert "512 training tokens" in json.loads((tmp_path / "oom-rank0.json").read_text())["error"]
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "0" / "model.safetensors").exists()
    total = json.loads((tmp_path / "plan.json").read_text())["total_steps"]
    assert sum("train" in json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()) == total


def test_warm_start_continues_from_the_earlier_drafts_weights(inputs, draft):
    store, verifier, dataset, hidden, vocab = inputs
    one_epoch = TRAIN.model_copy(update={"epochs": 1})

    warm = train_draft(
        one_epoch, dataset, hidden, vocab, verifier, store, _as_the_task_keys_it(store, one_epoch, inputs, draft), init=draft
    )

    assert warm.parents["init"] == draft.digest and "init" not in draft.parents
    # It starts where three epochs ended: one epoch in, it validates better than a first epoch from scratch.
    assert warm.epochs[0]["val_loss"] < draft.epochs[0]["val_loss"]


def test_warm_start_from_a_draft_of_another_shape_names_the_file_and_weight(inputs, draft, tmp_path):
    from safetensors.torch import load_file, save_file

    store, verifier, dataset, hidden, vocab = inputs
    (tmp_path / "checkpoint").mkdir()
    weights = load_file(draft.path / "checkpoint" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, tmp_path / "checkpoint" / "model.safetensors")
    broken = draft.model_copy(update={"path": tmp_path})

    with pytest.raises(ArtifactError, match=r"checkpoint/model.safetensors: cannot warm-start this draft from it: fc.weight \(missing\)"):
        train_draft(TRAIN, dataset, hidden, vocab, verifier, store, Provenance(config={"run": "broken"}), init=broken)


def test_previous_draft_is_the_latest_for_this_verifier_and_shape_trained_on_other_data(inputs, draft):
    from conftest import SAMPLE

    store, verifier, dataset, hidden, _vocab = inputs
    grown = prepare_dataset(
        DatasetConfig(max_seq_len=200), SAMPLE, load_tokenizer(verifier.path), store, Provenance(config={"grown": True})
    )

    found = previous_draft(store, TRAIN, verifier, hidden, grown)

    assert found is not None and found.parents["dataset"] == dataset.digest and found.finished_at >= draft.finished_at
    assert previous_draft(store, TRAIN, verifier, hidden, dataset) is None  # none was trained on other data
    assert previous_draft(store, TRAIN.model_copy(update={"num_layers": 2}), verifier, hidden, grown) is None
    assert previous_draft(store, TRAIN.model_copy(update={"fc_norm": True}), verifier, hidden, grown) is None  # other norms
    assert previous_draft(store, TRAIN, verifier, hidden.model_copy(update={"aux_layer_ids": [0, 1, 2]}), grown) is None


def test_previous_draft_in_a_copied_store_is_the_copy_there(inputs, draft, tmp_path):
    _, verifier, dataset, hidden, _ = inputs
    copy = ArtifactStore(tmp_path / "copy")  # another host's copy, or another mount point
    shutil.copytree(Path(draft.path).parent, copy.root / "artifacts", dirs_exist_ok=True)

    found = previous_draft(copy, TRAIN, verifier, hidden, dataset.model_copy(update={"digest": "0" * 64}))

    assert found is not None and found.path.parent == copy.root / "artifacts" and (found.path / found.checkpoint).is_dir()


def test_previous_draft_prefers_the_latest_draft_behind_a_promoted_checkpoint(inputs, tmp_path):
    from conftest import publish_evaluation, publish_text_artifact

    _, verifier, dataset, hidden, _ = inputs
    store = ArtifactStore(tmp_path)  # drafts as manifests alone: the choice reads nothing else

    def trained(name: str, dataset_digest: str, finished_at: datetime):
        return publish_text_artifact(
            store,
            "draft",
            name,
            {"verifier": verifier.digest, "dataset": dataset_digest},
            manifest_type=DraftManifest,
            config={"cfg": {"num_layers": TRAIN.num_layers}},
            epochs=[],
            num_steps=1,
            tau_sim=1.5,
            aux_layer_ids=hidden.aux_layer_ids,
            finished_at=finished_at,
        )

    served = trained("served", "1" * 64, datetime(2026, 11, 1, tzinfo=UTC))
    smoke = trained("smoke test", "2" * 64, datetime(2026, 11, 2, tzinfo=UTC))
    assert previous_draft(store, TRAIN, verifier, hidden, dataset).digest == smoke.digest  # nothing promoted: the latest

    evaluation = publish_evaluation(store, "served checkpoint", {3: 2.0}, verifier=verifier.digest, draft=served.digest)
    promote(PromotionConfig(), evaluation, store, "run")

    assert previous_draft(store, TRAIN, verifier, hidden, dataset).digest == served.digest
    (store.artifact_dir(evaluation.parents["checkpoint"]) / MANIFEST).write_text('{"parents": {"dra')  # cut short
    assert previous_draft(store, TRAIN, verifier, hidden, dataset).digest == smoke.digest  # it names no draft now


def test_previous_draft_passes_over_an_artifact_whose_manifest_is_damaged(inputs, tmp_path, caplog):
    from conftest import publish_text_artifact

    _, verifier, dataset, hidden, _ = inputs
    store = ArtifactStore(tmp_path)
    draft = publish_text_artifact(
        store,
        "draft",
        "draft",
        {"verifier": verifier.digest, "dataset": "1" * 64},
        manifest_type=DraftManifest,
        config={"cfg": {"num_layers": TRAIN.num_layers}},
        epochs=[],
        num_steps=1,
        tau_sim=1.5,
        aux_layer_ids=hidden.aux_layer_ids,
        finished_at=datetime(2026, 11, 1, tzinfo=UTC),
    )
    damaged = publish_text_artifact(store, "dataset", "records", {})
    (damaged.path / "manifest.json").write_text('{"kind": "dat')  # a disk that filled mid-write

    found = previous_draft(store, TRAIN, verifier, hidden, dataset)

    assert found.digest == draft.digest
    assert f"{damaged.path / 'manifest.json'}: not readable JSON" in caplog.text


def test_export_reloads_and_names_the_serving_verifier(inputs, draft):
    store, verifier, _dataset, hidden, vocab = inputs

    manifest = export_checkpoint(ExportConfig(verifier_name_or_path="org/verifier"), draft, verifier, vocab, hidden, store, Provenance())

    config = json.loads((manifest.path / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/verifier"
    assert config["transformer_layer_config"]["vocab_size"] == verifier.vocab_size == 1024
    assert config["draft_vocab_size"] == 512
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert manifest.tau_sim == draft.tau_sim


def test_validate_checkpoint_names_the_wrong_field(inputs, draft, tmp_path):
    _store, verifier, _dataset, hidden, vocab = inputs
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((draft.path / "checkpoint" / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 512
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ArtifactError, match=r"config\.json: field 'transformer_layer_config.vocab_size' is 512, expected 1024"):
        validate_checkpoint(tmp_path, verifier, vocab, hidden)


def test_export_refuses_hidden_states_of_other_layers_than_the_draft_was_trained_on(inputs, draft):
    store, verifier, _, hidden, vocab = inputs
    other_layers = hidden.model_copy(update={"aux_layer_ids": [0, 1, 2]})

    with pytest.raises(
        ArtifactError,
        match=r"config\.json: field 'eagle_aux_hidden_state_layer_ids' is \[1, 2, 3\], but the hidden "
        r"states .* were captured at layers \[0, 1, 2\]: a server would feed the draft other layers",
    ):
        export_checkpoint(ExportConfig(), draft, verifier, vocab, other_layers, store, Provenance(config={"run": "other layers"}))


def test_a_checkpoint_without_aux_layer_ids_is_refused_since_vllm_would_use_its_defaults(inputs, draft, tmp_path):
    _, verifier, _, hidden, vocab = inputs
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((draft.path / "checkpoint" / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ArtifactError, match=r"field 'eagle_aux_hidden_state_layer_ids' is None, .* feed the draft its default layers"):
        validate_checkpoint(tmp_path, verifier, vocab, hidden)


def test_warm_start_from_a_draft_of_other_aux_layers_names_the_field_and_the_fix(inputs, draft, tmp_path):
    store, verifier, dataset, hidden, vocab = inputs
    (tmp_path / "checkpoint").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "checkpoint" / name).write_bytes((draft.path / "checkpoint" / name).read_bytes())
    config = json.loads((tmp_path / "checkpoint" / "config.json").read_text())
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}))
    other_layers = draft.model_copy(update={"path": tmp_path})

    with pytest.raises(
        ArtifactError,
        match=r"checkpoint/config\.json: field 'eagle_aux_hidden_state_layer_ids' is \[0, 1, 2\]: .* this one "
        r"reads \[1, 2, 3\].*train\.init_from=scratch, or extract\.aux_layer_ids=\[0, 1, 2\]",
    ):
        train_draft(TRAIN, dataset, hidden, vocab, verifier, store, Provenance(config={"run": "other layers"}), init=other_layers)


def test_cpu_adaptation_is_undone_on_exit():
    saved = trainer_module._StepTimer, checkpointer_module.get_current_device

    with trainer_compat.trainer_class(torch.device("cpu")) as trainer_cls:
        assert trainer_cls is trainer_compat.CpuTrainer
        assert checkpointer_module.get_current_device() == "cpu"

    assert (trainer_module._StepTimer, checkpointer_module.get_current_device) == saved


# Llava; Kimi-K2.5 (MLA attention, per-expert checkpoint tensors), also with its INT4 routed experts;
# Qwen3-VL-MoE (multimodal rotary positions, no text *ForCausalLM)
@pytest.mark.parametrize("nested", ["tiny_nested_verifier", "tiny_kimi_verifier", "tiny_kimi_int4_verifier", "tiny_qwen_vl_moe_verifier"])
def test_nested_verifier_regenerates_trains_exports_and_decodes_with_its_text_vocab(nested, request, tmp_path):
    from conftest import SAMPLE, write_jsonl

    store = ArtifactStore(tmp_path)
    verifier = resolve_verifier(VerifierConfig(path=str(request.getfixturevalue(nested))), store)
    answers = regenerate(RegenerateConfig(enabled=True, max_records=16, max_new_tokens=12), SAMPLE, verifier, store, Provenance())
    dataset = prepare_dataset(
        DatasetConfig(max_seq_len=128), regenerated_conversations(answers), load_tokenizer(verifier.path), store, Provenance()
    )
    hidden = extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 3]), dataset, verifier, store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=256), dataset, verifier.vocab_size, store, Provenance())
    draft = train_draft(TrainConfig(epochs=1, total_seq_len=256), dataset, hidden, vocab, verifier, store, Provenance())
    manifest = export_checkpoint(ExportConfig(), draft, verifier, vocab, hidden, store, Provenance())
    cfg = EvalConfig(num_prompts=2, max_new_tokens=16, ks=[3])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is 2 + 3?"}, {"prompt": "Count to five."}])
    baselines = measure_baselines(cfg, verifier, prompts, store, Provenance())

    evaluation = evaluate(cfg, manifest, verifier, prompts, store, Provenance(), baselines)

    config = json.loads((manifest.path / "config.json").read_text())
    assert verifier.nested and answers.num_records == 16 and not answers.failed and answers.num_generated_tokens > 16
    assert config["transformer_layer_config"]["vocab_size"] == verifier.vocab_size == 1024
    assert evaluation.mismatches == 0 and evaluation.num_tokens == 32  # the draft's decodes are the verifier's greedy ones
