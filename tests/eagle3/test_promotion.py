from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import publish_evaluation

from eagle3.cli import main
from eagle3.config import ConfigError, PromotionConfig
from eagle3.evaluation.promotion import promote
from eagle3.evaluation.tau import tau_from_counts, tau_standard_error
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.promotions import promoted_checkpoints, read_promotions

DEFAULT = PromotionConfig()


def test_first_checkpoint_is_promoted_and_recorded_in_the_store(tmp_path):
    store = ArtifactStore(tmp_path)
    evaluation = publish_evaluation(store, "first", {3: 2.0})

    record = promote(DEFAULT, evaluation, store, "run-1")

    assert record.promoted and record.best_earlier_tau is None
    assert (record.tau, record.tau_sim, record.key.k) == (2.0, 2.5, 3)
    assert record.checkpoint == evaluation.parents["checkpoint"]
    assert (record.checkpoint_path / "manifest.json").exists()
    assert read_promotions(store) == [record]


def test_worse_checkpoint_is_not_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    best = promote(DEFAULT, publish_evaluation(store, "good", {3: 2.0}), store, "run-1")

    record = promote(DEFAULT, publish_evaluation(store, "worse", {3: 1.8}), store, "run-2")

    assert not record.promoted
    assert (record.best_earlier_checkpoint, record.best_earlier_tau, record.best_earlier_run_id) == (best.checkpoint, 2.0, "run-1")
    assert record.summary().startswith("not promoted: tau 1.800 at k=3 on 4 prompts does not beat the best earlier promoted tau 2.000")


def test_better_checkpoint_is_promoted_and_becomes_the_bar(tmp_path):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "first", {3: 2.0}), store, "run-1")

    better = promote(DEFAULT, publish_evaluation(store, "better", {3: 2.5}), store, "run-2")
    between = promote(DEFAULT, publish_evaluation(store, "between", {3: 2.3}), store, "run-3")

    assert better.promoted and better.best_earlier_tau == 2.0
    assert not between.promoted and between.best_earlier_checkpoint == better.checkpoint
    assert [r.checkpoint for r in promoted_checkpoints(store)] == [better.checkpoint]


def test_improvement_within_the_margin_is_not_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    margin = PromotionConfig(min_improvement=0.1)
    promote(margin, publish_evaluation(store, "first", {3: 2.0}), store, "run-1")

    slightly = promote(margin, publish_evaluation(store, "slightly-better", {3: 2.05}), store, "run-2")
    clearly = promote(margin, publish_evaluation(store, "clearly-better", {3: 2.2}), store, "run-3")

    assert not slightly.promoted and clearly.promoted
    assert clearly.best_earlier_tau == 2.0  # the unpromoted 2.05 is not the bar


def _evaluated(store, name: str, counts: list[tuple[int, int]]):
    return publish_evaluation(store, name, {3: tau_from_counts(counts)}, counts={3: counts})


SAME_ON_EVERY_PROMPT = [(8, 4)] * 4  # tau 2 on each of the 4 prompts
LUCKY_ON_ONE_PROMPT = [(12, 4), (6, 4), (8, 4), (8, 4)]  # tau 34/16 = 2.125, all of the gain from one prompt


def test_the_record_holds_the_gains_standard_error_paired_over_the_prompts(tmp_path):
    store = ArtifactStore(tmp_path)
    first_counts, second_counts = [(10, 4), (6, 4), (8, 4), (8, 4)], [(12, 4), (7, 4), (8, 4), (8, 4)]  # tau 2, 35/16
    promote(DEFAULT, _evaluated(store, "first", first_counts), store, "run-1")

    record = promote(DEFAULT, _evaluated(store, "second", second_counts), store, "run-2")

    # Influences 2/16, -2/16, 0, 0 and 3.25/16, -1.75/16, -0.75/16, -0.75/16; their differences
    # 1.25/16, 0.25/16, -0.75/16, -0.75/16: sqrt(4/3 * 2.75/256) = 0.1197, where the two errors
    # combined as if independent give 0.3442: prompt 1 is easy and prompt 2 hard for both.
    assert record.promoted and record.gain_standard_error == pytest.approx((4 / 3 * 2.75 / 256) ** 0.5)
    unpaired = (tau_standard_error(first_counts) ** 2 + tau_standard_error(second_counts) ** 2) ** 0.5
    assert unpaired == pytest.approx(0.3442, abs=1e-4)
    assert record.summary().endswith("by more than 0.0: +0.188 (SE 0.120)")


def test_a_gain_within_the_required_standard_errors_is_not_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    two_errors = PromotionConfig(min_standard_errors=2)
    promote(two_errors, _evaluated(store, "first", SAME_ON_EVERY_PROMPT), store, "run-1")

    # Influences of the lucky one (the first's are all 0): 3.5/16, -2.5/16, -0.5/16, -0.5/16;
    # sqrt(4/3 * 19/256) = 0.3146.
    lucky = promote(two_errors, _evaluated(store, "lucky", LUCKY_ON_ONE_PROMPT), store, "run-2")
    steady = promote(two_errors, _evaluated(store, "steady", [(9, 4)] * 4), store, "run-3")  # +0.25 on every prompt

    assert not lucky.promoted and lucky.gain_standard_error == pytest.approx((4 / 3 * 19 / 256) ** 0.5)
    assert lucky.summary().endswith("by more than 0.0 and 2.0 standard errors: +0.125 (SE 0.315)")
    assert steady.promoted and steady.gain_standard_error == 0.0 and steady.best_earlier_tau == 2.0


def test_the_standard_errors_are_those_of_the_deciding_k(tmp_path):
    store = ArtifactStore(tmp_path)
    at_5 = PromotionConfig(k=5, min_standard_errors=2)
    promote(
        at_5,
        publish_evaluation(store, "first", {3: 2.0, 5: 2.0}, counts={3: SAME_ON_EVERY_PROMPT, 5: SAME_ON_EVERY_PROMPT}),
        store,
        "run-1",
    )

    steady_at_5 = {3: LUCKY_ON_ONE_PROMPT, 5: [(9, 4)] * 4}
    record = promote(at_5, publish_evaluation(store, "second", {3: 2.125, 5: 2.25}, counts=steady_at_5), store, "run-2")

    assert record.promoted and record.key.k == 5 and record.gain_standard_error == 0.0


@pytest.mark.parametrize("earlier", ["without_counts", "deleted"])
def test_where_no_paired_error_can_be_measured_tau_alone_decides_and_the_summary_says_so(tmp_path, earlier):
    store = ArtifactStore(tmp_path)
    two_errors = PromotionConfig(min_standard_errors=2)
    if earlier == "without_counts":  # backend 'vllm', or an evaluation made before counts were kept
        promote(two_errors, publish_evaluation(store, "first", {3: 2.0}), store, "run-1")
    else:
        first = promote(two_errors, _evaluated(store, "first", SAME_ON_EVERY_PROMPT), store, "run-1")
        shutil.rmtree(store.artifact_dir(first.evaluation))

    record = promote(two_errors, _evaluated(store, "lucky", LUCKY_ON_ONE_PROMPT), store, "run-2")

    assert record.promoted and record.gain_standard_error is None
    assert record.summary().endswith("by more than 0.0: +0.125 (2.0 standard errors not checked: no paired standard error measured)")


def test_records_written_before_the_standard_error_was_kept_still_read(tmp_path):
    store = ArtifactStore(tmp_path)
    record = promote(DEFAULT, publish_evaluation(store, "x", {3: 2.0}), store, "run-1")
    [path] = (store.root / "promotions").glob("*.json")
    path.write_text(
        json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k not in ("min_standard_errors", "gain_standard_error")})
    )

    assert read_promotions(store) == [record]


def test_eagle3_promoted_loads_neither_torch_nor_prefect(tmp_path):
    ArtifactStore(tmp_path)
    check = (
        f"import sys; from eagle3.cli import main; assert main(['promoted', '--store', {str(tmp_path)!r}]) == 0; "
        "assert not {'torch', 'prefect'} & set(sys.modules), 'loaded'"
    )

    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)

    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "change",
    [
        {"verifier": "f" * 64},
        {"prompts": "f" * 64},
        {"max_new_tokens": 32},
        {"num_prompts": 8},
        {"dtype": "bfloat16"},
        {"backend": "vllm"},
    ],
    ids=["verifier", "prompts", "max_new_tokens", "num_prompts", "dtype", "backend"],
)
def test_evaluations_on_another_verifier_or_eval_set_are_not_compared(tmp_path, change):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "strong", {3: 3.0}), store, "run-1")

    record = promote(DEFAULT, publish_evaluation(store, "weak", {3: 1.5}, **change), store, "run-2")

    assert record.promoted and record.best_earlier_tau is None
    assert len(promoted_checkpoints(store)) == 2


def test_default_k_is_the_first_evaluated_and_k_is_part_of_the_comparison(tmp_path):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "first", {3: 2.0, 5: 2.6}), store, "run-1")
    second = publish_evaluation(store, "second", {3: 2.2, 5: 2.4})

    at_default = promote(DEFAULT, second, store, "run-2")
    at_5 = promote(PromotionConfig(k=5), second, store, "run-3")

    assert at_default.key.k == 3 and at_default.promoted and at_default.best_earlier_tau == 2.0
    assert at_5.key.k == 5 and at_5.promoted and at_5.best_earlier_tau is None
    assert not promote(PromotionConfig(k=5), publish_evaluation(store, "third", {3: 9.0, 5: 2.3}), store, "run-4").promoted


def test_rerun_of_the_best_checkpoint_stays_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "first", {3: 2.0}), store, "run-1")
    best = promote(DEFAULT, publish_evaluation(store, "best", {3: 2.5}), store, "run-2")

    again = promote(DEFAULT, publish_evaluation(store, "best", {3: 2.5}), store, "run-3")

    assert again.promoted and again.checkpoint == best.checkpoint
    assert again.best_earlier_tau == 2.0  # compared with the earlier champion, not with itself
    assert [r.run_id for r in promoted_checkpoints(store)] == ["run-2"]


def test_rerun_of_the_only_checkpoint_stays_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "only", {3: 2.0}), store, "run-1")

    again = promote(DEFAULT, publish_evaluation(store, "only", {3: 2.0}), store, "run-2")

    assert again.promoted and again.best_earlier_tau is None


def test_rerun_of_a_superseded_checkpoint_is_not_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "old", {3: 2.0}), store, "run-1")
    newer = promote(DEFAULT, publish_evaluation(store, "newer", {3: 2.5}), store, "run-2")

    again = promote(DEFAULT, publish_evaluation(store, "old", {3: 2.0}), store, "run-3")

    assert not again.promoted and again.best_earlier_checkpoint == newer.checkpoint


def test_k_the_evaluation_did_not_measure_is_a_config_error(tmp_path):
    store = ArtifactStore(tmp_path)

    with pytest.raises(ConfigError, match=r"promotion.k=7: .*manifest.json measured EAGLE-3 tau only at k in \[3, 5\]"):
        promote(PromotionConfig(k=7), publish_evaluation(store, "x", {3: 2.0, 5: 2.5}), store, "run-1")


def test_evaluation_without_its_inputs_names_the_missing_fields(tmp_path):
    store = ArtifactStore(tmp_path)
    evaluation = publish_evaluation(store, "x", {3: 2.0})
    stripped = evaluation.model_copy(update={"parents": {"checkpoint": "c" * 64}, "config": {}})

    with pytest.raises(ArtifactError, match=r"manifest.json: no field parents.verifier, parents.prompts, config.cfg.max_new_tokens"):
        promote(DEFAULT, stripped, store, "run-1")


def test_corrupt_record_names_the_file_and_field(tmp_path):
    store = ArtifactStore(tmp_path)
    record = promote(DEFAULT, publish_evaluation(store, "x", {3: 2.0}), store, "run-1")
    [path] = (store.root / "promotions").glob("*.json")
    path.write_text(json.dumps({**json.loads(record.model_dump_json()), "tau": "high"}))

    with pytest.raises(ArtifactError, match=rf"{path.name}: not a promotion record \(field 'tau'"):
        read_promotions(store)


def test_eagle3_promoted_prints_the_best_checkpoint_per_eval_set(tmp_path, capsys):
    store = ArtifactStore(tmp_path)
    promote(DEFAULT, publish_evaluation(store, "first", {3: 2.0}), store, "run-1")
    best = promote(DEFAULT, publish_evaluation(store, "better", {3: 2.5}), store, "run-2")
    other = promote(DEFAULT, publish_evaluation(store, "elsewhere", {3: 1.5}, prompts="f" * 64), store, "run-3")
    half = promote(DEFAULT, publish_evaluation(store, "in bfloat16", {3: 1.9}, dtype="bfloat16"), store, "run-4")

    assert main(["promoted", "--store", str(tmp_path)]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("tau 2.500 at k=3") and lines[0].endswith(str(best.checkpoint_path))
    assert lines[1].startswith("tau 1.500 at k=3") and lines[1].endswith(str(other.checkpoint_path))
    assert lines[2].startswith("tau 1.900 at k=3") and lines[2].endswith(str(half.checkpoint_path))
    assert "transformers float32;" in lines[0] and "transformers bfloat16;" in lines[2]  # another comparison key, said so


def test_a_draft_that_does_not_beat_ngram_lookup_is_not_promoted_even_as_the_first(tmp_path):
    store = ArtifactStore(tmp_path)

    record = promote(DEFAULT, publish_evaluation(store, "demo", {3: 1.1}, ngram_tau=1.45), store, "run-1")

    assert not record.promoted and record.beats_ngram is False and record.ngram_tau == 1.45
    assert record.summary() == (
        "not promoted: tau 1.100 at k=3 on 4 prompts does not beat n-gram prompt lookup's tau 1.450 on the same prompts: "
        "not worth serving, since n-gram lookup needs no training"
    )
    with_margin = record.model_copy(update={"min_gain_over_ngram": 0.5})
    assert "the same prompts by more than 0.5: not worth serving" in with_margin.summary()
    assert promoted_checkpoints(store) == []


def test_a_draft_never_asked_to_draft_is_not_promoted(tmp_path):
    store = ArtifactStore(tmp_path)
    one_token_answers = [(0, 0)] * 4  # each answer came from the prefill: no verifier pass, nothing drafted
    evaluation = publish_evaluation(
        store, "unmeasured", {3: tau_from_counts(one_token_answers)}, counts={3: one_token_answers}, ngram_tau=0.0
    )

    record = promote(
        DEFAULT, evaluation.model_copy(update={"gains_over_ngram": [{"k": 3, "gain": None, "standard_error": None}]}), store, "run-1"
    )

    assert not record.promoted and record.beats_ngram is None
    assert record.summary() == (
        "not promoted: no verifier pass on 4 prompts at max_new_tokens=64: every answer was one token long, "
        "so nothing was drafted to measure; raise evaluate.max_new_tokens"
    )
    assert promoted_checkpoints(store) == []


def test_a_served_draft_none_of_whose_tokens_was_accepted_is_not_promoted(tmp_path):
    store = ArtifactStore(tmp_path)

    record = promote(DEFAULT, publish_evaluation(store, "rejected", {3: 1.0}, ngram_tau=None, backend="vllm"), store, "run-1")

    assert not record.promoted
    assert record.summary() == (
        "not promoted: tau 1.000 at k=3 on 4 prompts: no drafted token was accepted, so the draft saves no verifier pass"
    )


def test_the_margin_over_ngram_lookup_is_a_setting(tmp_path):
    store = ArtifactStore(tmp_path)
    wide_margin = PromotionConfig(min_gain_over_ngram=0.5)

    narrow = promote(wide_margin, publish_evaluation(store, "narrow", {3: 1.6}, ngram_tau=1.2), store, "run-1")
    clear = promote(wide_margin, publish_evaluation(store, "clear", {3: 1.8}, ngram_tau=1.2), store, "run-2")

    assert (narrow.promoted, clear.promoted) == (False, True)
    assert clear.summary().startswith("promoted: tau 1.800 at k=3 on 4 prompts; first checkpoint evaluated")


def test_without_an_ngram_baseline_the_summary_says_it_was_not_compared(tmp_path):
    store = ArtifactStore(tmp_path)

    record = promote(DEFAULT, publish_evaluation(store, "served", {3: 2.0}, ngram_tau=None, backend="vllm"), store, "run-1")

    assert record.promoted and record.beats_ngram is None
    assert record.summary().endswith("; n-gram lookup not measured here, so not compared")
