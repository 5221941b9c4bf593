"""The out-of-memory back-off's log: what lets a re-run start at the batch setting a killed run reached."""

from __future__ import annotations

import pytest

from eagle3.runtime.attempts import BatchBackoff, OutOfMemory, read_backoffs

OOM = OutOfMemory(error="CUDA out of memory", where="on records ['a']")


def _backoff(log, value: int = 16) -> BatchBackoff:
    return BatchBackoff("regenerate.batch_size", value, "regenerate.min_batch_size", 1, kept="Finished records are kept.", log=log)


def test_a_write_a_kill_cut_short_is_cut_from_the_log_so_the_next_back_off_reads(tmp_path):
    log = tmp_path / "backoffs.jsonl"
    killed = _backoff(log)
    killed.after(OOM)
    killed.after(OOM)
    log.write_bytes(log.read_bytes() + b'{"setting": "regenerate.batch_size", "val')  # the next write, cut short

    resumed = _backoff(log)
    resumed.after(OOM)

    assert [(b.value, b.retry_with) for b in read_backoffs(log)] == [(16, 8), (8, 4), (4, 2)]
    assert _backoff(log).value == 2


def test_a_line_that_does_not_read_is_passed_over_naming_file_and_line(tmp_path, caplog):
    log = tmp_path / "backoffs.jsonl"
    _backoff(log).after(OOM)
    log.write_text("not a back-off\n" + log.read_text())

    assert _backoff(log).value == 8
    assert f"{log}: line 1 is not a back-off" in caplog.text


def test_a_configured_value_at_or_below_where_the_log_ended_starts_there_without_its_history(tmp_path):
    log = tmp_path / "backoffs.jsonl"
    _backoff(log).after(OOM)

    lower = _backoff(log, value=8)

    assert (lower.value, lower.taken) == (8, [])


def test_failing_at_the_minimum_says_where_a_re_run_starts_and_how_not_to(tmp_path):
    log = tmp_path / "backoffs.jsonl"
    backoff = _backoff(log, value=2)
    backoff.after(OOM)

    with pytest.raises(RuntimeError, match=r"= \[2, 1\]\).*Finished records are kept\. A re-run starts at 1 \(.*backoffs\.jsonl lists"):
        backoff.after(OOM)


def test_the_back_off_tries_its_minimum_where_halving_passes_it():
    backoff = BatchBackoff("extract.prefill_batch_tokens", 1024, "extract.min_prefill_batch_tokens", 300, kept="Finished shards are kept.")

    tried = [backoff.after(OOM), backoff.after(OOM)]

    assert tried == [512, 300]
    with pytest.raises(RuntimeError, match=r"= \[1024, 512, 300\]\) down to extract.min_prefill_batch_tokens = 300"):
        backoff.after(OOM)
