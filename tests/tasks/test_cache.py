from __future__ import annotations

from eagle3.evaluation import baseline
from tasks.baseline import measure_baselines_task


def test_the_baselines_task_is_cached_under_the_key_its_step_records():
    """Prefect's cache and the store must agree: the baselines key holds the device type, which is
    no input of the task, so both take it from `baseline_provenance`."""
    assert measure_baselines_task.cache_policy.provenance.step_provenance is baseline.baseline_provenance
