from __future__ import annotations

import pytest

from eagle3.evaluation.baseline import decode_summary
from eagle3.evaluation.speculative import DecodeStats
from eagle3.evaluation.tau import gain_over, per_prompt_counts, tau_from_counts, tau_standard_error


def _decoded(*accepted_per_prompt: list[int], k: int = 3, first_token_seconds: float | None = None) -> list[DecodeStats]:
    return [
        DecodeStats(
            tokens=[0] * (sum(a) + len(a)),
            verifier_passes=len(a),
            accepted_per_pass=list(a),
            drafted_per_pass=[k] * len(a),
            seconds=1.0,
            first_token_seconds=first_token_seconds,
        )
        for a in accepted_per_prompt
    ]


def _counts(*accepted_per_prompt: list[int]) -> list[tuple[int, int]]:
    return per_prompt_counts(_decoded(*accepted_per_prompt))


def test_tau_standard_error_is_over_prompts():
    # 6 tokens in 2 passes and 4 in 4: tau 10/6, residuals +-8/3, sqrt(2 * 2 * (8/3)^2) / 6 = 8/9
    assert tau_standard_error(_counts([2, 2], [0, 0, 0, 0])) == pytest.approx(8 / 9)
    assert tau_standard_error(_counts([1, 0], [0, 1, 1, 0, 1, 0])) == 0.0  # every prompt at tau 1.5
    assert tau_standard_error(_counts([3, 3, 1])) is None  # one prompt: no spread to measure
    assert tau_standard_error(_counts([], [])) is None  # one-token answers: no verifier pass


def test_tau_standard_error_agrees_with_a_leave_one_prompt_out_jackknife():
    runs = _decoded([3, 3, 0, 1], [0, 0, 1], [2, 3, 3, 3, 1], [0, 1, 0, 0, 0, 2], [1, 1], [3, 0, 0, 2, 3, 3, 1], [0, 0, 0, 1], [2, 2, 3])

    def tau(subset):
        return sum(len(r.tokens) for r in subset) / sum(r.verifier_passes for r in subset)

    leave_one_out = [tau(runs[:i] + runs[i + 1 :]) for i in range(len(runs))]
    mean = sum(leave_one_out) / len(runs)
    jackknife = ((len(runs) - 1) / len(runs) * sum((x - mean) ** 2 for x in leave_one_out)) ** 0.5

    assert tau_standard_error(per_prompt_counts(runs)) == pytest.approx(jackknife, rel=0.05)


def test_a_decode_summary_takes_tau_and_its_error_from_the_per_prompt_counts():
    runs = _decoded([2, 2], [0, 0, 0, 0])
    summary = decode_summary("eagle3", 3, runs, _decoded([0, 0, 0, 0], [0, 0, 0, 0]))

    assert summary["tau"] == tau_from_counts(per_prompt_counts(runs)) == pytest.approx(10 / 6)
    assert summary["tau_standard_error"] == pytest.approx(8 / 9)
    assert summary["acceptance_by_position"] == pytest.approx([2 / 6, 2 / 6, 0.0])
    assert (summary["tokens_per_s"], summary["greedy_tokens_per_s"], summary["speed_up"]) == (5.0, 4.0, 1.25)  # 10 and 8 tokens in 2 s
    one_token_answers = decode_summary("eagle3", 3, _decoded([], [], first_token_seconds=0.1), _decoded([0], [0], first_token_seconds=0.1))
    assert (one_token_answers["tau"], one_token_answers["tau_standard_error"]) == (0.0, None)
    assert (one_token_answers["decode_tokens_per_s"], one_token_answers["decode_speed_up"]) == (None, None)  # nothing after the first


def test_the_speed_after_the_first_token_leaves_each_prompts_pass_out():
    # 10 tokens in 2 s, the first of each prompt's after 0.5 s: 8 tokens in 1 s; greedy 8 in 2 s, 6 in 1 s.
    summary = decode_summary(
        "eagle3", 3, _decoded([2, 2], [0, 0, 0, 0], first_token_seconds=0.5), _decoded([0] * 4, [0] * 4, first_token_seconds=0.5)
    )

    assert (summary["tokens_per_s"], summary["speed_up"]) == (5.0, 1.25)
    assert (summary["decode_tokens_per_s"], summary["greedy_decode_tokens_per_s"]) == (8.0, 6.0)
    assert summary["decode_speed_up"] == pytest.approx(8 / 6)  # a prefill both pay alike no longer dilutes the draft's gain
    # decodes recorded before first tokens were timed: no figure, rather than the whole decode's
    earlier = decode_summary("eagle3", 3, _decoded([2, 2], [0, 0, 0, 0]), _decoded([0] * 4, [0] * 4))
    assert (earlier["decode_tokens_per_s"], earlier["greedy_decode_tokens_per_s"], earlier["decode_speed_up"]) == (None, None, None)
    assert earlier["speed_up"] == 1.25


def test_the_gain_over_a_baseline_is_paired_over_prompts():
    assert gain_over([(5, 2), (3, 3)], [(5, 2), (3, 3)]) == (0.0, 0.0)
    assert gain_over([(6, 2), (3, 1)], [(6, 4), (3, 2)]) == (1.5, 0.0)  # tau 3 against 1.5 on every prompt
    # Prompt 1 easy for both (tau 4 and 2), prompt 2 hard for both (2 and 1): tau 12/4 - 12/8 = 1.5.
    # Influences +-1/2 and +-1/4, differences +-1/4: sqrt(2 * 2 / 16) = 1/2, against
    # sqrt(1 + 1/4) = 1.118 for the two standard errors combined as if independent.
    draft, ngram = _counts([3, 3], [1, 1]), _counts([1, 1, 1, 1], [0, 0, 0, 0])
    assert (draft, ngram) == ([(8, 2), (4, 2)], [(8, 4), (4, 4)])
    assert gain_over(draft, ngram) == pytest.approx((1.5, 0.5))
    assert (tau_standard_error(draft) ** 2 + tau_standard_error(ngram) ** 2) ** 0.5 == pytest.approx(1.25**0.5)
    assert gain_over([(4, 2)], [(4, 4)]) == (1.0, None)  # one prompt: no spread to measure
    assert gain_over([(1, 0), (1, 0)], [(1, 0), (1, 0)]) == (None, None)  # one-token answers: no verifier pass
    with pytest.raises(ValueError, match="2 prompts against a baseline of 1"):
        gain_over(draft, [(4, 4)])


def test_the_gains_standard_error_agrees_with_a_leave_one_prompt_out_jackknife():
    draft = _counts([3, 3, 0, 1], [0, 0, 1], [2, 3, 3, 3, 1], [0, 1, 0, 0, 0, 2], [1, 1], [3, 0, 0, 2, 3, 3, 1])
    ngram = _counts([1, 0, 0, 0, 2, 0], [0, 0, 0], [1, 2, 0, 0, 0, 3, 0], [0, 0, 0, 0, 0, 0, 1], [0, 0, 1], [2, 0, 0, 0, 0, 0, 1, 1])
    n = len(draft)
    leave_one_out = [gain_over(draft[:i] + draft[i + 1 :], ngram[:i] + ngram[i + 1 :])[0] for i in range(n)]
    mean = sum(leave_one_out) / n
    jackknife = ((n - 1) / n * sum((x - mean) ** 2 for x in leave_one_out)) ** 0.5

    assert gain_over(draft, ngram)[1] == pytest.approx(jackknife, rel=0.1)
