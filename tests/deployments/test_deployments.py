"""prefect.yaml against a real server: registration, the typed form, server-side validation, and a
run from the UI's code path (create_flow_run_from_deployment) executed by a real process worker."""

from __future__ import annotations

import time

import pytest

from eagle3.config import TrainConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_both_deployments_register_on_the_process_pool(deployments):
    assert {d.work_pool_name for d in deployments.values()} == {"eagle3"}
    [schedule] = deployments["scheduled-retrain"].schedules
    assert schedule.schedule.cron == "0 3 * * 1" and schedule.active
    retrain = deployments["scheduled-retrain"].parameters["config"]
    assert retrain["dataset"]["path"] == "data/retrain/conversations.jsonl"
    assert retrain["train"]["init_from"] == "previous"
    for deployment in deployments.values():  # library warnings reach each run's log; no verifier code runs
        assert deployment.job_variables["env"] == {
            "PREFECT_LOGGING_EXTRA_LOGGERS": "eagle3",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "EAGLE3_ALLOW_REMOTE_CODE": "false",
        }


def test_the_form_schema_carries_descriptions_defaults_and_bounds(deployments):
    schema = deployments["train-on-demand"].parameter_openapi_schema
    train = schema["definitions"]["TrainConfig"]["properties"]

    assert train["lr"]["exclusiveMinimum"] == 0 and train["lr"]["default"] == TrainConfig.model_fields["lr"].default == 1e-3
    assert "learning rate" in train["lr"]["description"]
    assert train["loss_fn"]["enum"] == ["kl_div", "ce", "tv"]
    assert train["init_from"]["enum"] == ["scratch", "previous"] and train["init_from"]["default"] == "scratch"
    # the store is the worker's user's, not the home of whoever ran `prefect deploy`
    assert schema["properties"]["config"]["default"]["store_dir"] == "~/.local/share/eagle3-pipeline/store"


def test_the_server_rejects_invalid_parameters_before_a_run_starts(deployments):
    from prefect.client.orchestration import get_client

    with (
        get_client(sync_client=True) as client,
        pytest.raises(Exception, match=r"Validation failed for field 'config.train.lr'.*less than or equal to the minimum of 0"),
    ):
        client.create_flow_run_from_deployment(deployments["train-on-demand"].id, parameters={"config": {"train": {"lr": -1.0}}})


def test_a_triggered_run_completes_on_a_worker_with_its_artifacts_and_library_warnings(deployments, tiny_run_config, start_worker):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployments["train-on-demand"].id, parameters={"config": tiny_run_config})
    worker_log = start_worker()
    deadline = time.time() + 600
    with get_client(sync_client=True) as client:
        while not client.read_flow_run(run.id).state.is_final():
            assert time.time() < deadline, "flow run did not finish"
            time.sleep(3)
        state = client.read_flow_run(run.id).state
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        logs = [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]

    assert state.is_completed(), worker_log.read_text()[-3000:]
    keys = {a.key for a in artifacts}
    assert {"lineage", "acceptance-length", "promotion", "draft-numbers", "hidden-states-numbers"} <= keys
    # 9 of its 40 conversations are longer than its dataset.max_seq_len: eagle3.data.prepare_dataset warns, and the UI shows it
    assert any("9 record(s) truncated to dataset.max_seq_len=256 tokens" in message for message in logs), logs
