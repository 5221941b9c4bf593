"""What reaches a flow run's log on the server: the library's records from the threads that drive
data-parallel workers (extraction's and regeneration's pools)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from eagle3.runtime.attempts import submit_in_context

pytestmark = pytest.mark.e2e


def test_a_record_logged_on_a_workers_thread_reaches_the_runs_log_when_submitted_in_context(prefect_server):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker
    from prefect.runtime import flow_run

    import tasks  # noqa: F401  (as every run imports it: the library's level)

    library = logging.getLogger("eagle3.extraction.extract_hidden_states")

    @flow
    def drive_workers() -> str:
        with ThreadPoolExecutor(2, thread_name_prefix="extract-worker") as pool:
            submit_in_context(pool, library.warning, "worker 0 backed off, in context").result()
            pool.submit(library.warning, "worker 1 backed off, plainly").result()
        return flow_run.get_id()

    run_id = drive_workers()
    APILogWorker.drain_all(timeout=10)
    deadline, messages = time.monotonic() + 30, []
    while "worker 0 backed off, in context" not in messages and time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            messages = [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]
        time.sleep(0.5)

    assert "worker 0 backed off, in context" in messages
    assert "worker 1 backed off, plainly" not in messages  # a pool thread starts without the run's context
