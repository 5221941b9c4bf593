"""bench/data_parallel.py on CPU workers: the run a host with several GPUs makes, at a tiny shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each run spawns worker processes that import torch
BENCH = Path(__file__).resolve().parents[2] / "bench" / "data_parallel.py"
TINY = ["--layers", "8", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--samples", "16", "--seq-len", "64"]


def test_one_and_two_workers_extract_the_same_states_and_the_table_says_so(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_data_parallel", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    result = bench.main(["--workers", "cpu", "cpu,cpu", *TINY, "--records-per-shard", "4", "--json", str(tmp_path / "dp.json")])

    one, two = result["runs"]
    assert (one["workers"], two["workers"]) == (1, 2)
    assert one["digest"] == two["digest"] and two["same_digest"]  # workers take whole shards: the artifact is the same
    assert one["efficiency_tok_s"] == 1.0
    assert two["efficiency_tok_s"] == pytest.approx(two["tok_s"] / (2 * one["tok_s"]))
    assert two["tok_s"] == pytest.approx(16 * 64 / two["seconds"])
    assert json.loads((tmp_path / "dp.json").read_text()) == result
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| cpu")]
    assert [line.split(" | ")[:2] for line in table] == [["| cpu", "1"], ["| cpu,cpu", "2"]]
