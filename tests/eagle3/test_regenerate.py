from __future__ import annotations

import json
import logging
import time
import urllib.request
from contextlib import contextmanager

import pyarrow.parquet as pq
import pytest
import torch
from conftest import CLAIM_WAIT_S, free_port, run_while_another_run_holds_the_step, work_dir_path, write_jsonl
from tiny_models import CHATML, THINKING, tiny_llama
from transformers import AttentionInterface, MambaConfig, MambaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from vllm_server import ServerFront

from eagle3.config import EndpointConfig, RegenerateConfig, VerifierConfig
from eagle3.data.prepare_dataset import read_user_turns
from eagle3.data.regenerate import (
    ALLOCATOR_SETTINGS,
    RegenerateAttempt,
    RegeneratedManifest,
    _answer_batch,
    _answer_text,
    _generate,
    _shares,
    _transformers_attempt,
    batch_order,
    expandable_segments_env,
    records_named,
    regenerate,
    regenerate_provenance,
)
from eagle3.evaluation.speculative import greedy_decode
from eagle3.runtime.attempts import run_attempt
from eagle3.runtime.faults import FAULT_OOM_ENV
from eagle3.serving.endpoint import EndpointError
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.forward import DynamicForward
from eagle3.verifier.loading import chat_prompt_ids, load_text_model, load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier, verifier_tokenizer

pytestmark = pytest.mark.slow  # generation by the verifier, in child processes and against a vLLM server

CFG = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=2)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% endfor %}" + CHATML
)


@pytest.fixture
def verifier(tiny_verifier, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    return store, resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"id": "a", "prompt": "What is two plus two?"},
            {"question_id": 81, "turns": ["Name a colour.", "Now another one."]},
            {
                "id": "c",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "old answer"},
                ],
            },
        ],
    )


def test_user_turns_are_read_from_every_prompt_shape(prompts):
    assert read_user_turns(prompts, None) == [
        ("a", [], ["What is two plus two?"]),
        ("81", [], ["Name a colour.", "Now another one."]),
        ("c", [{"role": "system", "content": "Be brief."}], ["Hi"]),
    ]


def test_record_without_prompt_names_file_and_record(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])

    with pytest.raises(ArtifactError, match=r"bad\.jsonl: record 0: no prompt field"):
        read_user_turns(path, None)


@pytest.mark.parametrize(
    "turn, field",
    [
        ("hello", r"field 'messages\[0\]' must be an object with 'role' and 'content'"),
        ({"role": "user"}, r"field 'messages\[0\]' must be an object with 'role' and 'content'"),
        ({"role": "user", "content": 5}, r"field 'messages\[0\]\.content' must be a string"),
    ],
)
def test_a_malformed_turn_in_a_prompt_file_names_file_record_and_field(tmp_path, turn, field):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "q1", "messages": [turn]}])

    with pytest.raises(ArtifactError, match=rf"p\.jsonl: record 0 \(id 'q1'\): {field}"):
        read_user_turns(path, None)


@pytest.mark.parametrize(
    "record, field",
    [
        ({"prompt": 5}, r"field 'prompt' must be a string, not int"),
        ({"question": ["a"]}, r"field 'question' must be a string, not list"),
        ({"turns": ["a", 7]}, r"field 'turns\[1\]' must be a string, not int"),
        ({"turns": []}, r"field 'turns' must be a non-empty list of strings"),
        ({"prompt": "  "}, r"\(id '0'\): field 'prompt' is empty"),
        ({"turns": ["a", ""]}, r"\(id '0'\): field 'turns\[1\]' is empty"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": ""}]},
            r"\(id '0'\): field 'messages\[2\]\.content' is empty",
        ),
    ],
)
def test_a_prompt_field_of_the_wrong_type_or_empty_is_named(tmp_path, record, field):
    path = write_jsonl(tmp_path / "p.jsonl", [record])

    with pytest.raises(ArtifactError, match=rf"p\.jsonl: record 0.*{field}"):
        read_user_turns(path, None)


def test_a_null_id_falls_back_to_the_records_index(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": None, "prompt": "a"}, {"id": None, "question_id": 7, "prompt": "b"}])

    assert [record_id for record_id, _, _ in read_user_turns(path, None)] == ["0", "7"]


def test_a_repeated_id_names_both_records(tmp_path):
    # The third record has no id: its index, 2, is the second record's id.
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": "x", "prompt": "a"}, {"id": "2", "prompt": "b"}, {"prompt": "c"}])

    with pytest.raises(ArtifactError, match=r"dup\.jsonl: record 2: field 'id': '2' is also the id of record 1"):
        read_user_turns(path, None)


def test_conversations_are_batched_with_others_of_as_many_turns_shortest_first_turn_first():
    records = [
        ("chat-long", [], ["a" * 30, "b"]),
        ("one-long", [], ["a" * 20]),
        ("three", [], ["a", "b", "c"]),
        ("chat-short", [], ["a" * 5, "b" * 90]),
        ("one-short", [], ["a"]),
    ]

    order = [record_id for record_id, _, _ in batch_order(records)]

    assert order == ["one-short", "one-long", "chat-short", "chat-long", "three"]


def test_a_back_off_names_a_few_records_whole_and_a_big_batch_by_count_and_first_ids():
    assert records_named(["81"]) == "records ['81']"
    assert records_named([f"r{i}" for i in range(2000)]) == "2000 records ('r0', 'r1', 'r2', 'r3', 'r4', ...)"


def test_regenerated_turns_are_the_verifiers_greedy_answers_in_order(verifier, prompts):
    store, manifest = verifier

    out = regenerate(CFG, prompts, manifest, store, Provenance())

    rows = {r["id"]: r for r in pq.read_table(out.path / "conversations.parquet").to_pylist()}
    assert out.num_records == 3 and out.failed == {}
    two_turns = rows["81"]["messages"]
    assert [m["role"] for m in two_turns] == ["user", "assistant", "user", "assistant"]
    assert rows["c"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "old answer" not in json.dumps(rows["c"]["messages"])
    tokenizer = load_tokenizer(manifest.path)
    model = load_text_model(manifest.path, torch.float32, "cpu")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is two plus two?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    expected = greedy_decode(DynamicForward(model, None), prompt, CFG.max_new_tokens, {tokenizer.eos_token_id}).tokens
    expected = [t for t in expected if t != tokenizer.eos_token_id]
    assert rows["a"]["messages"][1]["content"] == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_a_record_whose_first_answer_is_empty_fails_alone_and_its_later_turns_are_not_asked(verifier):
    _, manifest = verifier
    tokenizer = load_tokenizer(manifest.path)
    model = load_text_model(manifest.path, torch.float32, "cpu")
    turns = ["Name a colour.", "Now another one."]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": turns[0]}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    model.generation_config.eos_token_id = greedy_decode(DynamicForward(model, None), list(prompt), 1, set()).tokens[
        0
    ]  # ends the answer at once

    entries = _answer_batch(model, tokenizer, [("81", [], turns), ("b", [], ["Name a colour."])], CFG, "cpu")

    assert entries == [{"id": "81", "failed": "empty answer at turn 0"}, {"id": "b", "failed": "empty answer at turn 0"}]


def test_an_answer_that_starts_inside_a_thinking_block_the_template_opened_is_read_with_its_opening(tmp_path):
    """A random model never closes the block the template opened: stripped, nothing is left to train on."""
    path = tiny_llama(tmp_path / "thinking", template=THINKING)
    tokenizer, model = load_tokenizer(path), load_text_model(path, torch.float32, "cpu")
    batch = [("r", [], ["Hi"])]

    stripped = _answer_batch(model, tokenizer, batch, CFG, "cpu")
    kept = _answer_batch(model, tokenizer, batch, CFG.model_copy(update={"strip_thinking": False}), "cpu")

    assert stripped == [{"id": "r", "failed": "empty answer at turn 0"}]
    assert kept[0]["messages"][1]["content"].startswith("<think>\n")


def test_workers_are_dealt_the_batches_one_worker_would_form():
    records = [(f"{turns}-{length}", [], ["a" * length] * turns) for turns in (1, 2) for length in (4, 3, 2, 1)]
    one = [r[0] for r in batch_order(records)]

    shares = _shares(records, 2, 2)

    assert [[r[0] for r in share] for share in shares] == [one[0:2] + one[4:6], one[2:4] + one[6:8]]


def test_a_record_the_chat_template_refuses_fails_alone_with_the_reason(tmp_path):
    """Gemma's template, for one, raises on a system message; the other records are answered."""
    path = tiny_llama(tmp_path / "no-system", template=NO_SYSTEM)
    tokenizer, model = load_tokenizer(path), load_text_model(path, torch.float32, "cpu")
    batch = [("sys", [{"role": "system", "content": "Be brief."}], ["Hi", "Again"]), ("plain", [], ["Hi", "Again"])]

    entries = _answer_batch(model, tokenizer, batch, CFG, "cpu")

    assert entries[0] == {"id": "sys", "failed": "chat template refused turn 0: System role not supported"}
    assert entries[1]["id"] == "plain" and [m["role"] for m in entries[1]["messages"]] == ["user", "assistant", "user", "assistant"]


def test_a_run_in_which_every_record_fails_publishes_nothing_and_says_why(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_llama(tmp_path / "no-system", template=NO_SYSTEM))), store)
    source = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "s", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    )

    with pytest.raises(
        ArtifactError,
        match=r"p\.jsonl: every record failed, record id 's' with: chat template refused turn 0: "
        r"System role not supported\. Nothing is published",
    ):
        regenerate(CFG, source, verifier, store, Provenance())
    assert not list((store.root / "published").glob("regenerated-*"))


def test_a_rerun_after_a_crash_regenerates_only_what_is_missing(verifier, prompts):
    store, manifest = verifier
    provenance = Provenance(config={"run": "resume"})
    work = work_dir_path(store, "regenerated", provenance.key)
    finished = {
        "id": "a",
        "messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "FOUR"}],
        "finish_reasons": ["stop"],
        "tokens": 1,
    }
    (work / "done.jsonl").write_text(json.dumps(finished) + "\n")

    out = regenerate(CFG, prompts, manifest, store, provenance)

    rows = {r["id"]: r for r in pq.read_table(out.path / "conversations.parquet").to_pylist()}
    assert rows["a"]["messages"][1]["content"] == "FOUR"
    assert len(rows) == 3


def test_a_run_waiting_for_another_run_of_the_step_claims_its_gpu_only_once_it_holds_the_step(verifier, prompts):
    store, manifest = verifier
    provenance = Provenance(config={"run": "claimed"})

    run = run_while_another_run_holds_the_step(
        store, RegeneratedManifest, provenance, lambda claim: regenerate(CFG, prompts, manifest, store, provenance, claim=claim)
    )

    [claimed] = run.claimed_at  # the other run published nothing, so this one did the step, on its claim
    assert claimed >= run.released_at
    assert run.result.num_records == 3
    assert run.result.seconds <= run.finished_at - run.released_at - CLAIM_WAIT_S  # the wait for the GPU is not the step's


def test_a_rerun_with_every_record_finished_claims_no_gpu(verifier, prompts):
    store, manifest = verifier
    provenance = Provenance(config={"run": "all done"})
    answered = pq.read_table(regenerate(CFG, prompts, manifest, store, Provenance(config={"run": "first"})).path / "conversations.parquet")
    (work_dir_path(store, "regenerated", provenance.key) / "done.jsonl").write_text(  # a run killed before publishing
        "".join(json.dumps({**row, "tokens": 1}) + "\n" for row in answered.to_pylist())
    )
    claims = []

    @contextmanager
    def claim():
        claims.append(time.monotonic())
        yield None

    out = regenerate(CFG, prompts, manifest, store, provenance, claim=claim)

    assert claims == [] and out.num_records == 3


def test_a_torn_last_line_of_the_done_log_is_dropped_and_its_record_redone(verifier, prompts):
    store, manifest = verifier
    provenance = Provenance(config={"run": "torn"})
    finished = {
        "id": "a",
        "messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "FOUR"}],
        "finish_reasons": ["stop"],
        "tokens": 1,
    }
    torn = json.dumps({"id": "c", "messages": [{"role": "user", "content": "Hi"}]})[:30]  # a kill cut the write short
    (work_dir_path(store, "regenerated", provenance.key) / "done.jsonl").write_text(json.dumps(finished) + "\n" + torn)

    out = regenerate(CFG, prompts, manifest, store, provenance)

    rows = {r["id"]: r for r in pq.read_table(out.path / "conversations.parquet").to_pylist()}
    assert rows["a"]["messages"][1]["content"] == "FOUR"
    assert sorted(rows) == ["81", "a", "c"] and [m["role"] for m in rows["c"]["messages"]] == ["system", "user", "assistant"]


@pytest.mark.parametrize(
    "log, problem",
    [
        ('{"id": "a", "mess\n{"id": "c"}\n', r"line 1 is not JSON"),
        ('{"id": "a", "failed": "x"}\n["c"]\n', r"line 2: field 'id' is missing"),
    ],
)
def test_a_bad_line_inside_the_done_log_names_file_line_and_problem(verifier, prompts, log, problem):
    store, manifest = verifier
    provenance = Provenance(config={"log": log})
    (work_dir_path(store, "regenerated", provenance.key) / "done.jsonl").write_text(log)

    with pytest.raises(ArtifactError, match=rf"done\.jsonl: {problem}"):
        regenerate(CFG, prompts, manifest, store, provenance)


def test_out_of_memory_halves_the_batch_and_publishes_the_same_artifact(verifier, prompts, monkeypatch, tmp_path):
    _, manifest = verifier
    cfg = CFG.model_copy(update={"batch_size": 4})
    direct = regenerate(cfg, prompts, manifest, ArtifactStore(tmp_path / "direct"), Provenance())
    monkeypatch.setenv(FAULT_OOM_ENV, "80")  # the 3 first turns padded to 31 tokens do not fit; 2 of them do

    backed_off = regenerate(cfg, prompts, manifest, ArtifactStore(tmp_path / "oom"), Provenance())

    assert [(b.setting, b.value, b.retry_with) for b in backed_off.backoffs] == [("regenerate.batch_size", 4, 2)]
    assert backed_off.backoffs[0].error == f"simulated out of memory: 3 x 31 padded prompt tokens > {FAULT_OOM_ENV}=80"
    # Greedy answers do not depend on the batch (left padding is masked; fp32 on CPU): the same rows.
    rows = pq.read_table(backed_off.path / "conversations.parquet").to_pylist()
    assert rows == pq.read_table(direct.path / "conversations.parquet").to_pylist()
    assert backed_off.digest == direct.digest


def test_out_of_memory_at_the_minimum_fails_saying_what_was_tried_and_keeps_finished_records(verifier, prompts, monkeypatch):
    store, manifest = verifier
    provenance = Provenance(config={"run": "oom-minimum"})
    monkeypatch.setenv(FAULT_OOM_ENV, "40")  # every first turn fits alone; record 81's second turn (60 tokens) never does

    with pytest.raises(
        RuntimeError,
        match=r"records \['81'\] at every batch size tried \(regenerate.batch_size = \[2, 1\]\) "
        r"down to regenerate.min_batch_size = 1: simulated out of memory.* Finished records are kept",
    ):
        regenerate(CFG, prompts, manifest, store, provenance)

    done_log = work_dir_path(store, "regenerated", provenance.key) / "done.jsonl"
    # The one-turn records are batched before the two-turn one (batch_order), so both were finished
    assert [json.loads(line)["id"] for line in done_log.read_text().splitlines()] == ["c", "a"]
    monkeypatch.delenv(FAULT_OOM_ENV)
    progress = []
    out = regenerate(CFG, prompts, manifest, store, provenance, on_progress=lambda *p: progress.append(p))
    assert out.num_records == 3 and progress[-1] == (1, 1)  # only the unfinished record is regenerated
    # It resumed at the batch size the failed run reached, and the manifest keeps that run's back-off
    assert [(b.value, b.retry_with) for b in out.backoffs] == [(2, 1)]


@pytest.mark.parametrize("killed_after", [1, 4])
def test_a_run_killed_after_backing_off_resumes_at_the_batch_size_it_reached(verifier, tmp_path, monkeypatch, caplog, killed_after):
    store, manifest = verifier
    asks = [f"Say {n}." for n in range(4)]
    prompts = write_jsonl(tmp_path / "four.jsonl", [{"id": str(n), "prompt": ask} for n, ask in enumerate(asks)])
    tokenizer = verifier_tokenizer(manifest)
    longest = max(len(chat_prompt_ids(tokenizer, [{"role": "user", "content": ask}])) for ask in asks)
    monkeypatch.setenv(FAULT_OOM_ENV, str(longest))  # one prompt fits, two padded together do not: every time
    provenance = Provenance(config={"run": f"oom-killed-{killed_after}"})

    class Killed(Exception):
        """Stands for a SIGKILL once `killed_after` records are finished (4: all, before publishing)."""

    def kill(done, total):
        if done == killed_after:
            raise Killed

    with pytest.raises(Killed):
        regenerate(CFG, prompts, manifest, store, provenance, on_progress=kill)
    caplog.set_level(logging.INFO, logger="eagle3")

    out = regenerate(CFG, prompts, manifest, store, provenance)

    assert (out.num_records, out.resumed_records) == (4, killed_after)
    # The killed run's back-off, and no new one: the re-run did not try two records at once again
    assert [(b.value, b.retry_with) for b in out.backoffs] == [(2, 1)]
    if killed_after < 4:
        assert "resuming at regenerate.batch_size=1, where this work backed off to before" in caplog.text


def test_appending_prompts_generates_only_for_the_new_ones_and_publishes_what_a_fresh_run_does(verifier, prompts, tiny_verifier, tmp_path):
    store, manifest = verifier
    first = regenerate(CFG, prompts, manifest, store, regenerate_provenance(store, CFG, prompts, manifest))
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    records[0]["id"] = "renamed"  # a record matches on what it asks, not on its id
    grown = write_jsonl(tmp_path / "grown.jsonl", [*records, {"id": "new", "prompt": "Count to three."}])
    progress = []

    second = regenerate(
        CFG, grown, manifest, store, regenerate_provenance(store, CFG, grown, manifest), on_progress=lambda *p: progress.append(p)
    )

    assert (second.reused_records, second.reused_from, second.num_records) == (3, [first.digest], 4)
    assert progress[-1] == (1, 1)  # the new record alone was generated
    assert second.num_generated_tokens < first.num_generated_tokens
    fresh_store = ArtifactStore(tmp_path / "fresh")
    fresh_verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), fresh_store)
    fresh = regenerate(CFG, grown, fresh_verifier, fresh_store, regenerate_provenance(fresh_store, CFG, grown, fresh_verifier))
    assert fresh.reused_records == 0 and second.digest == fresh.digest  # the same bytes as generating every answer
    again = write_jsonl(tmp_path / "again.jsonl", [*map(json.loads, grown.read_text().splitlines()), {"id": "newer", "prompt": "Hi"}])
    third = regenerate(CFG, again, manifest, store, regenerate_provenance(store, CFG, again, manifest))
    assert (third.reused_records, third.reused_from) == (4, [second.digest])  # the latest holds them all: the first is not read


def test_answers_are_reused_only_under_the_same_settings_and_limit_changes_keep_them(verifier, prompts):
    store, manifest = verifier
    regenerate(CFG, prompts, manifest, store, regenerate_provenance(store, CFG, prompts, manifest))

    limited = CFG.model_copy(update={"max_records": 2})
    longer = CFG.model_copy(update={"max_new_tokens": CFG.max_new_tokens + 1})

    assert regenerate(limited, prompts, manifest, store, regenerate_provenance(store, limited, prompts, manifest)).reused_records == 2
    assert regenerate(longer, prompts, manifest, store, regenerate_provenance(store, longer, prompts, manifest)).reused_records == 0


def test_an_earlier_regeneration_that_does_not_read_is_passed_over_and_its_answers_generated_again(verifier, prompts, tmp_path, caplog):
    store, manifest = verifier
    first = regenerate(CFG, prompts, manifest, store, regenerate_provenance(store, CFG, prompts, manifest))
    (first.path / "conversations.parquet").write_bytes(b"not parquet")
    grown = write_jsonl(tmp_path / "grown.jsonl", [*map(json.loads, prompts.read_text().splitlines()), {"id": "new", "prompt": "Hi"}])

    second = regenerate(CFG, grown, manifest, store, regenerate_provenance(store, CFG, grown, manifest))

    assert second.reused_records == 0 and second.num_records == 4
    assert "conversations.parquet: an earlier regeneration's answers do not read" in caplog.text


def test_an_attempt_in_a_child_process_writes_what_it_writes_in_process(verifier, prompts, tmp_path):
    _, manifest = verifier
    attempt = RegenerateAttempt(
        todo=read_user_turns(prompts, None), cfg=CFG, verifier=manifest, device="cpu", batch_size=2, done_log=tmp_path / "in_process.jsonl"
    )
    progress = []

    in_process = run_attempt(_transformers_attempt, attempt, None)
    in_child = run_attempt(
        _transformers_attempt, attempt.model_copy(update={"done_log": tmp_path / "in_child.jsonl"}), ["0"], progress.append
    )

    assert in_process is None and in_child is None
    assert (tmp_path / "in_child.jsonl").read_text() == (tmp_path / "in_process.jsonl").read_text()
    assert progress == [2, 1]


def _served(served_draft, **kw) -> RegenerateConfig:
    endpoint = EndpointConfig(base_url=served_draft.base_url, model=served_draft.model, **kw)
    return CFG.model_copy(update={"backend": "openai", "endpoint": endpoint})


def _served_requests(served_draft) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(served_draft.base_url.removesuffix("/v1") + "/metrics").read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:request_success_total")


@pytest.mark.vllm
def test_server_answers_equal_the_embedded_backends_turn_by_turn(served_draft, prompts):
    store = served_draft.store

    embedded = regenerate(CFG, prompts, served_draft.verifier, store, Provenance(config={"run": "embedded"}))
    served = regenerate(_served(served_draft), prompts, served_draft.verifier, store, Provenance(config={"run": "served"}))

    rows = pq.read_table(served.path / "conversations.parquet").to_pylist()
    assert rows == pq.read_table(embedded.path / "conversations.parquet").to_pylist()
    assert [m["role"] for m in next(r for r in rows if r["id"] == "81")["messages"]] == ["user", "assistant"] * 2
    assert served.failed == {} and served.num_generated_tokens > 0


@pytest.mark.vllm
def test_a_prompt_longer_than_the_served_context_is_listed_with_the_servers_reason(served_draft, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"id": "short", "prompt": "Hi"}, {"id": "long", "prompt": "word " * 1500}])

    out = regenerate(_served(served_draft), path, served_draft.verifier, served_draft.store, Provenance(config={"run": "long"}))

    assert out.num_records == 1
    assert list(out.failed) == ["long"]
    assert out.failed["long"].startswith("server rejected turn 0: HTTP 400") and "maximum context length" in out.failed["long"]


@pytest.mark.vllm
def test_a_rerun_after_a_crash_asks_the_server_only_for_what_is_missing(served_draft, prompts):
    store = served_draft.store
    provenance = Provenance(config={"run": "served-resume"})
    finished = {
        "id": "a",
        "messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "FOUR"}],
        "finish_reasons": ["stop"],
        "tokens": 1,
    }
    (work_dir_path(store, "regenerated", provenance.key) / "done.jsonl").write_text(json.dumps(finished) + "\n")
    before = _served_requests(served_draft)

    out = regenerate(_served(served_draft), prompts, served_draft.verifier, store, provenance)

    rows = {r["id"]: r for r in pq.read_table(out.path / "conversations.parquet").to_pylist()}
    assert rows["a"]["messages"][1]["content"] == "FOUR" and len(rows) == 3
    assert _served_requests(served_draft) - before == 3  # record 81: two turns, record c: one


@pytest.mark.vllm
def test_records_spread_over_several_servers_and_a_server_that_dies_loses_only_its_requests(served_draft, prompts, caplog):
    store = served_draft.store
    alone = regenerate(_served(served_draft), prompts, served_draft.verifier, store, Provenance(config={"run": "one server"}))
    dying = ServerFront(served_draft.base_url, answers=1)  # record 81's first turn, then it dies asking for its second
    cfg = _served(served_draft, concurrency=1, max_retries=1).model_copy(update={"more_base_urls": [dying.base_url]})

    with caplog.at_level("WARNING", logger="eagle3"):
        spread = regenerate(cfg, prompts, served_draft.verifier, store, Provenance(config={"run": "two servers"}))

    assert dying.posts == 2  # it answered one request and died on the next
    assert (
        pq.read_table(spread.path / "conversations.parquet").to_pylist() == pq.read_table(alone.path / "conversations.parquet").to_pylist()
    )
    assert spread.failed == {}
    [dropped] = [r.getMessage() for r in caplog.records if "in flight go to the other" in r.getMessage()]
    assert dropped.startswith(f"{dying.base_url}: the server did not answer after 1 retries")


@pytest.mark.vllm
def test_a_server_of_several_that_does_not_answer_at_the_start_is_left_out_with_a_warning(served_draft, prompts, caplog):
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    cfg = _served(served_draft, max_retries=0).model_copy(update={"more_base_urls": [closed]})

    with caplog.at_level("WARNING", logger="eagle3"):
        out = regenerate(cfg, prompts, served_draft.verifier, served_draft.store, Provenance(config={"run": "one of two answers"}))

    assert out.failed == {} and out.num_records == 3
    assert any(
        r.getMessage().startswith(f"{closed}: the server did not answer") and "other 1 server(s)" in r.getMessage() for r in caplog.records
    )


@pytest.mark.vllm
def test_a_model_the_server_does_not_serve_is_named_with_what_it_serves(served_draft, prompts):
    cfg = _served(served_draft).model_copy(update={"endpoint": EndpointConfig(base_url=served_draft.base_url, model="other")})

    with pytest.raises(EndpointError, match=r"endpoint.model is 'other', but the server serves \['tiny-verifier'\]"):
        regenerate(cfg, prompts, served_draft.verifier, served_draft.store, Provenance(config={"run": "other"}))


def test_an_unreachable_server_stops_the_step_and_keeps_finished_records(verifier, prompts):
    store, manifest = verifier
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    cfg = CFG.model_copy(update={"backend": "openai", "endpoint": EndpointConfig(base_url=closed, model="m", max_retries=0)})

    with pytest.raises(
        EndpointError, match=r"did not answer after 0 retries .*APIConnectionError.* Finished records are kept in .*done\.jsonl"
    ):
        regenerate(cfg, prompts, manifest, store, Provenance(config={"run": "unreachable"}))


def test_thinking_is_stripped_or_kept_from_the_answer_and_a_servers_reasoning_field():
    assert _answer_text("<think>\nplan\n</think>\n\nFour.", None, strip_thinking=True) == "Four."
    assert _answer_text("plan opened by the template\n</think>\n\nFour.", None, strip_thinking=True) == "Four."
    assert _answer_text("<think>\nplan cut off by max_new_tok", None, strip_thinking=True) == ""
    assert _answer_text("<think>plan</think>Four.", None, strip_thinking=False) == "<think>plan</think>Four."
    assert _answer_text("Four.", "plan", strip_thinking=True) == "Four."
    assert _answer_text("Four.", "plan", strip_thinking=False) == "<think>\nplan\n</think>\n\nFour."


def test_a_regeneration_the_store_already_published_is_handed_back_not_generated_or_reused_again(verifier, prompts, monkeypatch):
    """What a fresh Prefect setup (another host, a new PREFECT_HOME) meets: no cached task result, the
    store's artifact. On a GPU in bfloat16 a second regeneration would differ, and so every key after it."""
    store, manifest = verifier
    provenance = regenerate_provenance(store, CFG, prompts, manifest)
    first = regenerate(CFG, prompts, manifest, store, provenance)
    monkeypatch.setenv(FAULT_OOM_ENV, "1")  # any batch the verifier were given would fail

    again = regenerate(CFG, prompts, manifest, store, provenance)

    assert again == first  # not a new artifact built from the first one's answers (reused_records 0)


def test_each_batch_decodes_over_a_cache_as_long_as_its_own_prompts_and_answers(tiny_verifier):
    """`generate`'s own static cache would keep the longest length any earlier call asked for."""
    lengths = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] == 1 and module.layer_idx == 0:  # a decode step's keys: the whole cache
            lengths.append(key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("recording_sdpa", recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register("recording_sdpa", sdpa_mask)
    model = load_text_model(tiny_verifier, torch.float32, "cpu")
    model.set_attn_implementation("recording_sdpa")
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4)

    for width in (60, 5):
        lengths.clear()
        _generate(model, load_tokenizer(tiny_verifier), [[7] * width, [8, 9]], cfg, "cpu")
        assert set(lengths) == {width + cfg.max_new_tokens}


def test_a_batch_generates_on_a_model_with_state_of_its_own_or_a_cache_named_by_its_generation_config(tiny_verifier):
    tokenizer = load_tokenizer(tiny_verifier)
    torch.manual_seed(0)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, state_size=4))
    llama = load_text_model(tiny_verifier, torch.float32, "cpu")
    expected = _generate(llama, tokenizer, [[7] * 6, [8, 9]], CFG, "cpu")
    llama.generation_config.cache_implementation = "dynamic"  # as a checkpoint's generation_config.json may set it

    assert _generate(llama, tokenizer, [[7] * 6, [8, 9]], CFG, "cpu") == expected
    answers = _generate(mamba.eval(), tokenizer, [[7] * 6, [8, 9]], CFG, "cpu")  # generate keeps its own state
    assert len(answers) == 2 and all(len(tokens) <= CFG.max_new_tokens for tokens, _ in answers)


def test_regeneration_grows_its_allocator_segments_unless_the_user_set_the_allocator_under_any_name(monkeypatch):
    for name in ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert expandable_segments_env() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")  # torch's newer name, which the older one overrides
    assert expandable_segments_env() == {}
