"""bench/quality.py's report, read from a recorded H100 run (`bench/results/quality_h100_sharegpt_27k/`):
the draft's speed-up over plain greedy, the table's columns for the ks measured, and the pairing
with an earlier draft's evaluation."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from eagle3.evaluation.tau import PER_PROMPT

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "results" / "quality_h100_sharegpt_27k"


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("bench_quality", RECORDED.parents[1] / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def evaluation():
    return json.loads((RECORDED / "evaluation_manifest.json").read_text())


def test_the_row_gives_each_methods_tokens_per_second_and_the_drafts_speed_up_over_greedy(quality, evaluation):
    row = quality.eval_row(evaluation, None)

    assert (row["greedy_tok_s"], row["eagle3_k3_tok_s"], row["ngram_k3_tok_s"]) == (201.1, 331.4, 298.6)
    assert (row["eagle3_k3_speedup"], row["ngram_k3_speedup"]) == (1.65, 1.49)  # recorded when both were over the baselines' greedy


def test_the_fc_norm_runs_speed_ups_are_the_ones_the_docs_quote(quality):
    fc_norm = json.loads((RECORDED.with_name("quality_h100_sharegpt_27k_fc_norm") / "evaluation_manifest.json").read_text())

    row = quality.eval_row(fc_norm, None)

    assert (row["greedy_tok_s"], row["eagle3_k3_tok_s"], row["eagle3_k4_tok_s"]) == (285.7, 456.3, 486.5)
    assert (row["eagle3_k3_speedup"], row["eagle3_k4_speedup"]) == (1.6, 1.7)


def test_the_table_has_a_column_group_per_k_measured_and_no_empty_column(quality, evaluation):
    at_k3 = quality.eval_row(evaluation, None)
    at_k4 = {key.replace("_k3", "_k4"): value for key, value in at_k3.items()}

    columns = quality.table_columns({"mt_bench": at_k3, "own": at_k4})

    assert columns[:3] == ["tau_sim", "eagle3_k3", "eagle3_k3_se"]
    assert {"eagle3_k4", "eagle3_k4_speedup", "eagle3_k3_speedup"} <= set(columns)
    assert "eagle3_k5" not in columns and "baseline_seconds" not in columns  # nothing measured there


def test_the_comparison_pairs_prompts_as_the_gain_over_ngram_does(quality, evaluation, tmp_path):
    counts = json.loads((RECORDED / PER_PROMPT).read_text())
    (tmp_path / PER_PROMPT).write_text(json.dumps({"eagle3": counts["ngram"]}))  # n-gram's decodes as the "earlier draft"

    row = quality.vs_earlier(RECORDED, tmp_path)

    gain = next(g for g in evaluation["gains_over_ngram"] if g["k"] == 3)
    assert row == {"eagle3_k3_vs_earlier": round(gain["gain"], 3), "eagle3_k3_vs_earlier_se": round(gain["standard_error"], 3)}
    assert row["eagle3_k3_vs_earlier"] == 0.831


def test_an_earlier_evaluation_of_other_prompts_or_lengths_is_refused_before_anything_runs(quality):
    assert quality.check_comparable(RECORDED, 80, 256) is None
    assert "it holds [80] prompts, this run evaluates 30" in quality.check_comparable(RECORDED, 30, 256)
    assert "it decoded 256 tokens a prompt, this run 64" in quality.check_comparable(RECORDED, 80, 64)


@pytest.mark.parametrize("item", ["mt_bench", "mt_bench=", "gsm8k=DIR", "mt_bench=DIR mt_bench=DIR"])
def test_compare_wants_each_eval_set_once_with_a_directory_holding_per_prompt_counts(quality, item, capsys):
    items = item.replace("DIR", str(RECORDED)).split()

    with pytest.raises(SystemExit):
        quality._compare_dirs(items, ["mt_bench"], argparse.ArgumentParser())

    assert "expected NAME=DIR with NAME one of ['mt_bench'] (once)" in capsys.readouterr().err


def test_the_fc_norm_runs_recorded_gain_over_the_draft_without_it_comes_from_both_runs_prompts(quality):
    fc_norm = RECORDED.with_name("quality_h100_sharegpt_27k_fc_norm")
    recorded = json.loads((fc_norm / "mt_bench.json").read_text())["eval"]["mt_bench"]

    row = quality.vs_earlier(fc_norm, RECORDED)

    assert row == {key: recorded[key] for key in ("eagle3_k3_vs_earlier", "eagle3_k3_vs_earlier_se")}  # k = 4: fc_norm's run alone
    assert (row["eagle3_k3_vs_earlier"], row["eagle3_k3_vs_earlier_se"]) == (0.003, 0.015)  # the figures the docs quote


def test_a_given_drafts_record_has_its_evaluation_and_no_training_figures(quality, evaluation, tmp_path, capsys):
    given = evaluation | {"tau_sim": None}  # a draft trained elsewhere (draft_path) has no validation estimate
    cfg = quality.config("full", tmp_path, tmp_path / "store", [f"draft_path={tmp_path / 'exported-elsewhere'}"])
    args = argparse.Namespace(size="full")

    summary = quality.summarize(
        args, cfg, {}, {"verifier": {"seconds": 28.6}, "evaluation": given}, {"mt_bench": quality.eval_row(given, None)}
    )
    quality.print_summary(summary)

    assert summary["config"]["draft_path"] == str(tmp_path / "exported-elsewhere")
    assert not {"training_mix", "training_samples", "draft", "epochs"} & set(summary)
    assert (
        summary["eval"]["mt_bench"]["tau_sim"] is None
        and summary["eval"]["mt_bench"]["eagle3_k3"] == quality.eval_row(evaluation, None)["eagle3_k3"]
    )
    assert summary["step_seconds"] == {"verifier": 28.6, "evaluation": round(evaluation["seconds"], 1)}
    printed = capsys.readouterr().out
    assert f"the draft given by draft_path {tmp_path / 'exported-elsewhere'}" in printed and "training:" not in printed
    header = next(line for line in printed.splitlines() if line.startswith("| eval set"))
    assert "eagle3_k3" in header and "tau_sim" not in header  # no empty column
