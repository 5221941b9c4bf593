import json

import pytest

from eagle3.training.train_timing import median_tokens_per_s, time_breakdown


def _log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_records_without_a_step_are_not_steps(tmp_path):
    """speculators' own CLI logs its settings to the metrics logger before the first step: that
    record has no step timer, and its time belongs to startup."""
    log = _log(
        tmp_path / "timing.jsonl",
        [
            {"global_step": None, "ended_at": 101.0, "validation": False},  # the CLI's settings
            {"global_step": 0, "ended_at": 110.0, "validation": False, "step_ms": 4000, "fetch_ms": 1000, "tokens_per_s": 10},
            {"global_step": 1, "ended_at": 111.0, "validation": False, "step_ms": 500, "fetch_ms": 100, "tokens_per_s": 30},
            {"global_step": 2, "ended_at": 112.0, "validation": False, "step_ms": 600, "fetch_ms": 50, "tokens_per_s": 20},
            {"global_step": None, "ended_at": 115.0, "validation": True},
        ],
    )

    phases = time_breakdown(log, started_at=100.0, ended_at=120.0)

    assert phases == {
        "startup": 6.0,
        "first_step": 4.0,
        "steps": 1.1,
        "waiting_for_data": 1.15,
        "validation": 3.0,
        "other": pytest.approx(5.9),
    }
    assert median_tokens_per_s(log) == 20
