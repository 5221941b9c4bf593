"""bench/fault_trials.py's comparison of a restarted run's evaluation with an uninterrupted run's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fault_trials.py"


@pytest.fixture(scope="module")
def trials():
    spec = importlib.util.spec_from_file_location("bench_fault_trials", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _store(root: Path, row: dict) -> tuple[Path, dict]:
    artifact = root / "artifacts" / "e"
    artifact.mkdir(parents=True)
    (artifact / "report.json").write_text(json.dumps({"results": [row], "tau_sim": 2.0}))
    return root, {"evaluation": ["e"]}


def test_evaluations_that_differ_only_in_speeds_are_the_same_and_in_tau_are_not(trials, tmp_path):
    row = {"method": "eagle3", "k": 3, "tau": 2.5, "tokens_per_s": 300.0, "greedy_tokens_per_s": 200.0, "speed_up": 1.5}
    reference = _store(tmp_path / "reference", row)

    slower = _store(tmp_path / "slower", row | {"tokens_per_s": 150.0, "greedy_tokens_per_s": 120.0, "speed_up": 1.25})
    other_tau = _store(tmp_path / "other_tau", row | {"tau": 2.4})

    assert trials.differences(reference, slower) == []
    assert trials.differences(reference, other_tau) == ["evaluation"]
