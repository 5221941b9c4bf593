"""The flow's caching contract, against a real `prefect server start`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from uuid import UUID

import pytest
from conftest import SAMPLE, LogSeen

from eagle3.config import PipelineConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = [
    "resolve-verifier",
    "measure-baselines",
    "prepare-dataset",
    "extract-hidden-states",
    "build-vocab-mapping",
    "train-draft",
    "export-checkpoint",
    "evaluate",
]
UNTOUCHED_BY_DATA = {"resolve-verifier": "Cached", "measure-baselines": "Cached"}  # the verifier, and its decoding of the eval prompts


def _config(store, verifier, data, **train) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "store_dir": str(store),
            "verifier": {"path": str(verifier)},
            "dataset": {"path": str(data), "max_seq_len": 256},
            "extract": {"aux_layer_ids": [1, 2, 3], "records_per_shard": 16},
            "vocab": {"draft_vocab_size": 512},
            "train": {"epochs": 1, "total_seq_len": 512, **train},
            "evaluate": {"num_prompts": 2, "max_new_tokens": 16, "ks": [3]},
        }
    )


def _run(config: PipelineConfig):
    """Run the flow; return its result (checkpoint and lineage) and each task's final state name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.train_draft import train_eagle3_draft

    state = train_eagle3_draft(config, return_state=True)
    assert state.is_completed(), state.message
    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    # Task-run states reach the server as events, written shortly after the flow returns.
    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=flow_runs)
            last_reported = any(run.name.startswith("publish-lineage") for run in runs)  # the flow's last task
            settled = last_reported and all(run.state and run.state.is_final() for run in runs)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    states = {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}
    assert states.pop("publish-lineage") == "Completed"  # every run publishes its lineage
    if config.stop_after is None:
        assert states.pop("promote") == "Completed"  # and decides promotion afresh: it depends on history
    return state.result(), states


@pytest.fixture
def first_run(prefect_server, tiny_verifier, conversations, tmp_path):
    """A first run of its own, for a test that edits its data or its store."""
    config = _config(tmp_path / "store", tiny_verifier, conversations)
    result, states = _run(config)
    assert states == dict.fromkeys(STEPS, "Completed")
    return config, result


@pytest.fixture(scope="module")
def shared_first_run(prefect_server, tiny_verifier, tmp_path_factory):
    """One first run for the tests that only read it or add runs beside it: each first run costs a
    minute on two cores. The first of them compares the promotion records, so it runs first."""
    root = tmp_path_factory.mktemp("shared-first-run")
    data = root / "conversations.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    config = _config(root / "store", tiny_verifier, data)
    result, states = _run(config)
    assert states == dict.fromkeys(STEPS, "Completed")
    return config, result


def test_identical_second_run_is_entirely_cached_and_says_nothing_changed(shared_first_run):
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.lineage import lineage, lineage_table
    from eagle3.store.promotions import read_promotions

    config, first = shared_first_run

    second, states = _run(config)

    assert states == dict.fromkeys(STEPS, "Cached")
    assert second.checkpoint.digest == first.checkpoint.digest
    assert (second.checkpoint.path / "model.safetensors").exists()
    # Not compared with itself: the same checkpoint gets the same decision (a random tiny verifier's draft need
    # not beat n-gram lookup); both decisions are in the store and the UI.
    assert second.promotion.promoted == first.promotion.promoted and second.promotion.best_earlier_tau is None
    assert read_promotions(ArtifactStore(config.store_dir)) == [first.promotion, second.promotion]
    assert _published("promotion", second.promotion.run_id).description == second.promotion.summary()
    # What changed comes from the producers in the store: every artifact names the first run.
    assert second.lineage.changes == (
        f"Nothing changed: this run produced no artifact; all 7 artifacts it used come from earlier runs ({first.lineage.run_id})."
    )
    assert second.checkpoint.producer == first.checkpoint.producer
    assert first.checkpoint.producer.flow_run_id == first.lineage.run_id
    assert list((Path(config.store_dir) / "locks").iterdir()) == []  # every step's and shard's lock went with it
    nodes = lineage(ArtifactStore(config.store_dir), [second.checkpoint.digest])
    origins = {row["kind"]: row["origin"] for row in lineage_table(nodes, second.lineage.run_id)}
    assert origins["checkpoint"] == origins["draft"] == f"cached: produced by run {first.lineage.run_id}"


def test_a_run_stopped_after_a_step_publishes_up_to_it_and_the_next_goes_on_from_there(
    prefect_server, tiny_verifier, conversations, tmp_path
):
    """stop_after: a verifier that needs the host's GPUs for one stage at a time (a server writing the
    answers, then the extraction engine, then a server with the draft) gets them stage by stage."""
    config = _config(tmp_path / "store", tiny_verifier, conversations)

    answers, states = _run(config.model_copy(update={"stop_after": "dataset"}))

    assert states == {"resolve-verifier": "Completed", "prepare-dataset": "Completed"}  # no baselines: nothing to evaluate yet
    assert (answers.stopped_after, answers.checkpoint, answers.evaluation, answers.promotion) == ("dataset", None, None, None)

    drafted, states = _run(config.model_copy(update={"stop_after": "checkpoint"}))

    assert states == {
        "resolve-verifier": "Cached",
        "prepare-dataset": "Cached",
        "extract-hidden-states": "Completed",
        "build-vocab-mapping": "Completed",
        "train-draft": "Completed",
        "export-checkpoint": "Completed",
    }
    assert drafted.stopped_after == "checkpoint" and drafted.evaluation is None

    finished, states = _run(config)

    assert states == dict.fromkeys(STEPS, "Cached") | {"measure-baselines": "Completed", "evaluate": "Completed"}
    assert finished.stopped_after is None and finished.checkpoint.digest == drafted.checkpoint.digest
    assert finished.promotion is not None


def test_a_draft_trained_elsewhere_is_evaluated_and_promoted_without_any_training_step(shared_first_run, tmp_path):
    """draft_path: a draft exported on another host (here the first run's, copied out of its store) is
    checked against the verifier, copied into this store and measured as the run that trained it measured it."""
    config, first = shared_first_run
    elsewhere = shutil.copytree(first.checkpoint.path, tmp_path / "exported-elsewhere")
    given = config.model_copy(update={"store_dir": str(tmp_path / "store"), "draft_path": str(elsewhere)})

    result, states = _run(given)

    assert states == {
        "resolve-verifier": "Completed",
        "measure-baselines": "Completed",
        "given-draft": "Completed",
        "evaluate": "Completed",
    }
    assert result.draft is None and result.checkpoint.digest == first.checkpoint.digest and result.checkpoint.tau_sim is None
    assert [(r["method"], r["k"], r["tau"]) for r in result.evaluation.results] == [
        (r["method"], r["k"], r["tau"]) for r in first.evaluation.results
    ]
    assert result.promotion is not None and result.promotion.tau_sim is None
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.lineage import lineage

    nodes = lineage(ArtifactStore(given.store_dir), [result.evaluation.digest])
    assert {node["kind"] for node in nodes.values()} == {"evaluation", "baseline", "checkpoint", "input"}  # nothing trained here
    checkpoint = nodes[result.checkpoint.digest]
    assert set(checkpoint["parents"]) == {"verifier"} and checkpoint["config"]["draft"] == first.checkpoint.digest  # its files, by content

    again, states = _run(given)

    assert states == {"resolve-verifier": "Cached", "measure-baselines": "Cached", "given-draft": "Cached", "evaluate": "Cached"}
    assert again.evaluation.digest == result.evaluation.digest


def _published(key: str, run_id: str):
    """The artifact with `key` that flow run `run_id` published, read back from the server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    of_run = ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]))
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=of_run)
    return artifact


def test_eagle3_lineage_of_a_flow_run_id_prints_the_graph_the_run_published_without_a_server(shared_first_run):
    config, first = shared_first_run
    published = _published("lineage-graph", first.lineage.run_id)

    no_server = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens on port 9

    cli = subprocess.run(
        [sys.executable, "-m", "eagle3.cli", "lineage", first.lineage.run_id, "--store", config.store_dir],
        cwd=REPO,
        env=no_server,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert cli.returncode == 0, cli.stderr
    assert f"```mermaid\n{cli.stdout}```" in published.data
    assert cli.stderr == first.lineage.changes + "\n"
    assert first.lineage.changes.startswith("This run produced 7 of its 7 artifacts")


def test_a_runs_recorded_configuration_replays_it(shared_first_run):
    from eagle3.config import load_config

    config, first = shared_first_run

    assert first.lineage.config_file.parent == Path(config.store_dir) / "runs"
    assert load_config(first.lineage.config_file) == config


def test_a_run_that_trains_attaches_the_drafts_training_curves(shared_first_run):
    import base64

    from eagle3.store.artifacts import ArtifactStore
    from eagle3.training.train import DraftManifest

    config, first = shared_first_run

    attached = _published("training-curves", first.lineage.run_id)

    draft = ArtifactStore(config.store_dir).load(DraftManifest, first.checkpoint.parents["draft"])
    encoded = attached.data.split("(data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(encoded) == (draft.path / draft.curves).read_bytes()


def test_changing_only_training_hyperparameters_reruns_train_export_and_evaluation_but_not_the_baselines(shared_first_run):
    config, first = shared_first_run

    result, states = _run(config.model_copy(update={"train": config.train.model_copy(update={"lr": 3e-4})}))

    assert states == {**dict.fromkeys(STEPS[:5], "Cached"), **dict.fromkeys(STEPS[5:], "Completed")}
    assert result.checkpoint.digest != first.checkpoint.digest
    assert result.evaluation.parents["baselines"] == first.evaluation.parents["baselines"]
    assert result.lineage.changes == "This run produced 3 of its 7 artifacts: checkpoint, draft, evaluation."


def test_changing_only_batch_knobs_file_locations_or_settings_of_an_unused_backend_reruns_nothing(shared_first_run, tmp_path):
    from eagle3.evaluation.evaluate import eval_prompts_source

    config, first = shared_first_run
    moved = tmp_path / "moved"
    shutil.copytree(config.verifier.path, moved / "verifier")
    shutil.copy(config.dataset.path, moved / "conversations.jsonl")
    shutil.copy(eval_prompts_source(config.evaluate), moved / "prompts.jsonl")
    changed = config.model_validate(
        config.model_dump()
        | {
            "verifier": {"path": str(moved / "verifier")},
            "dataset": config.dataset.model_dump() | {"path": str(moved / "conversations.jsonl")},
            "extract": config.extract.model_dump() | {"prefill_batch_tokens": 64},
            "evaluate": config.evaluate.model_dump() | {"prompts_path": str(moved / "prompts.jsonl"), "endpoint": {"model": "verifier"}},
        }
    )

    result, states = _run(changed)

    assert states == dict.fromkeys(STEPS, "Cached")
    assert result.checkpoint.digest == first.checkpoint.digest


def test_the_runs_log_in_prefect_shows_each_validated_training_epoch(shared_first_run):
    """The library's INFO lines reach the flow run's log that the UI shows (they were dropped at the
    root's WARNING level): here the training's progress, one line per validated epoch."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    config, first = shared_first_run
    only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(first.lineage.run_id)]))
    deadline, epochs = time.monotonic() + 30, []  # logs reach the server in batches
    while not epochs and time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            epochs = [log.message for log in client.read_logs(log_filter=only_this_run) if "validated: tau_sim" in log.message]
        time.sleep(0.5)

    assert config.train.epochs == 1
    assert [line.split(", loss")[0] for line in epochs] == [
        f"train draft: epoch 1 of 1 validated: tau_sim {first.checkpoint.tau_sim:.3f}"  # the one epoch is the one shipped
    ]


def test_a_prefect_setup_without_the_cached_results_reuses_the_stores_artifacts_and_computes_nothing(
    shared_first_run, tmp_path, monkeypatch
):
    """The store is the record of what was computed, not Prefect's result storage: a run from
    another host or PREFECT_HOME (a fresh container) finds every step's artifact there."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from eagle3.runtime.faults import FAULT_OOM_ENV

    config, first = shared_first_run
    monkeypatch.setenv(FAULT_OOM_ENV, "1")  # a step that extracted or trained anything would fail
    reused = LogSeen("the store already holds it for these inputs")  # at INFO, the level the tasks give the library
    store_log = logging.getLogger("eagle3.store.artifacts")
    store_log.addHandler(reused)

    try:
        with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: str(tmp_path / "fresh-results")}):
            second, states = _run(config)
            third, states_again = _run(config)
    finally:
        store_log.removeHandler(reused)

    assert states == dict.fromkeys(STEPS, "Completed")  # no cached result: each task ran, and found its artifact
    kinds = {"baseline", "dataset", "hidden_states", "vocab_mapping", "draft", "checkpoint", "evaluation"}
    assert {message.split(":")[0] for message in reused.messages} == kinds  # each step handed back the store's
    assert second.lineage.changes == (
        f"Nothing changed: this run produced no artifact; all 7 artifacts it used come from earlier runs ({first.lineage.run_id})."
    )
    assert second.checkpoint == first.checkpoint and second.evaluation == first.evaluation
    assert states_again == dict.fromkeys(STEPS, "Cached")  # the results are Prefect's again from then on
    assert third.checkpoint == first.checkpoint


def test_editing_the_dataset_in_place_reruns_everything_downstream(first_run, conversations):
    config, first = first_run
    lines = conversations.read_text().splitlines()
    record = json.loads(lines[0])
    record["messages"][1]["content"] = "A different answer, so the data changed."
    conversations.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")

    result, states = _run(config)

    assert states == {**UNTOUCHED_BY_DATA, **dict.fromkeys(STEPS[2:], "Completed")}
    assert result.checkpoint.digest != first.checkpoint.digest


def test_appending_records_extracts_only_the_new_shard(first_run, conversations):
    from eagle3.extraction.shards import HiddenStatesManifest
    from eagle3.store.artifacts import ArtifactStore

    config, _first = first_run
    more = "".join(SAMPLE.read_text().splitlines(keepends=True)[40:48])
    conversations.write_text(conversations.read_text() + more)

    result, states = _run(config)

    assert states == {**UNTOUCHED_BY_DATA, **dict.fromkeys(STEPS[2:], "Completed")}
    hidden = ArtifactStore(config.store_dir).load(HiddenStatesManifest, result.checkpoint.parents["hidden_states"])
    # 40 records in shards of 16 -> 48 records: shards 0-1 are reused, only shard 2 (now 16 records) is extracted
    assert (hidden.num_records, hidden.extracted_shards, hidden.reused_shards) == (48, 1, 2)


def test_retraining_on_grown_data_continues_from_the_previous_draft_and_then_stays_cached(first_run, conversations):
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.training.train import DraftManifest

    config, first = first_run
    config = config.model_copy(update={"train": config.train.model_copy(update={"init_from": "previous"})})
    more = "".join(SAMPLE.read_text().splitlines(keepends=True)[40:48])
    conversations.write_text(conversations.read_text() + more)

    grown, states = _run(config)
    again, states_again = _run(config)

    assert states == {**UNTOUCHED_BY_DATA, **dict.fromkeys(STEPS[2:], "Completed"), "find-previous-draft": "Completed"}
    draft = ArtifactStore(config.store_dir).load(DraftManifest, grown.checkpoint.parents["draft"])
    assert draft.parents["init"] == first.checkpoint.parents["draft"]
    assert states_again == {**dict.fromkeys(STEPS, "Cached"), "find-previous-draft": "Completed"}
    assert again.checkpoint.digest == grown.checkpoint.digest


def test_a_step_whose_cached_artifact_gc_deleted_runs_again_instead_of_handing_on_nothing(first_run):
    from eagle3.cli import main
    from eagle3.store.artifacts import ArtifactStore

    config, first = first_run
    _run(config.model_copy(update={"train": config.train.model_copy(update={"lr": 3e-4})}))
    assert main(["artifacts", "gc", "--keep-runs", "1", "--store", config.store_dir]) == 0
    first_draft = ArtifactStore(config.store_dir).artifact_dir(first.checkpoint.parents["draft"])
    assert not first_draft.exists()  # Prefect still holds the first run's cached draft manifest

    rebuilt, states = _run(config)
    again, states_again = _run(config)

    assert {s: states[s] for s in STEPS[:6]} == {**dict.fromkeys(STEPS[:5], "Cached"), "train-draft": "Completed"}
    assert ArtifactStore(config.store_dir).artifact_dir(rebuilt.checkpoint.parents["draft"]).exists()
    assert rebuilt.checkpoint.path.exists()
    assert states_again == dict.fromkeys(STEPS, "Cached") and again.checkpoint.digest == rebuilt.checkpoint.digest


def test_regeneration_feeds_the_verifiers_answers_into_the_dataset(prefect_server, tiny_verifier, conversations, tmp_path):
    from eagle3.data.regenerate import RegeneratedManifest, regenerated_conversations
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.files import digest_file
    from eagle3.store.lineage import lineage

    regenerate = PipelineConfig().regenerate.model_copy(update={"enabled": True, "max_records": 12, "max_new_tokens": 16})
    config = _config(tmp_path / "store", tiny_verifier, conversations).model_copy(update={"regenerate": regenerate})

    result, states = _run(config)

    assert states == dict.fromkeys(["regenerate", *STEPS], "Completed")
    store = ArtifactStore(config.store_dir)
    [regenerated] = [
        store.load(RegeneratedManifest, p.name)
        for p in (store.root / "artifacts").iterdir()
        if '"kind": "regenerated"' in (p / "manifest.json").read_text()
    ]
    [dataset] = [n for n in lineage(store, [result.checkpoint.digest]).values() if n["kind"] == "dataset"]
    assert regenerated.num_records == dataset["num_records"] == 12
    assert dataset["parents"]["source"] == digest_file(regenerated_conversations(regenerated))


def test_gc_after_a_run_keeps_everything_the_run_reached(first_run):
    from eagle3.cli import main

    config, first = first_run
    artifacts = set((Path(config.store_dir) / "artifacts").iterdir())

    assert main(["artifacts", "gc", "--keep-runs", "1", "--store", config.store_dir]) == 0

    assert set((Path(config.store_dir) / "artifacts").iterdir()) == artifacts
    assert (first.checkpoint.path / "model.safetensors").exists()


def _served_requests(base_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics").read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:request_success_total")


@pytest.mark.vllm
def test_a_draft_trains_on_a_vllm_servers_states_and_where_the_server_is_stays_out_of_the_key(
    prefect_server, extraction_server, conversations, tmp_path
):
    from vllm_server import EXTRACTED_AUX, EXTRACTION_CONTEXT, SERVED_NAME

    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.lineage import lineage

    def served(base_url: str, concurrency: int) -> PipelineConfig:
        config = _config(tmp_path / "store", extraction_server.verifier_dir, conversations)
        return config.model_validate(
            config.model_dump()
            | {
                "dataset": config.dataset.model_dump() | {"max_seq_len": EXTRACTION_CONTEXT - 1},
                "extract": {
                    "aux_layer_ids": EXTRACTED_AUX,
                    "records_per_shard": 16,
                    "backend": "vllm",
                    "served_states_dir": str(extraction_server.storage),
                    "endpoint": {"base_url": base_url, "model": SERVED_NAME, "concurrency": concurrency},
                },
            }
        )

    before = _served_requests(extraction_server.base_url)

    first, states = _run(served(extraction_server.base_url, 4))
    asked = _served_requests(extraction_server.base_url) - before
    again, cached = _run(served(extraction_server.base_url.replace("127.0.0.1", "localhost"), 1))

    assert states == dict.fromkeys(STEPS, "Completed") and cached == dict.fromkeys(STEPS, "Cached")
    [hidden] = [n for n in lineage(ArtifactStore(tmp_path / "store"), [first.checkpoint.digest]).values() if n["kind"] == "hidden_states"]
    assert asked == hidden["num_records"] > 0  # one request per sample, and none the second time
    assert _served_requests(extraction_server.base_url) - before == asked
    assert again.checkpoint.digest == first.checkpoint.digest
