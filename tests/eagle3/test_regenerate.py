from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import write_jsonl
from eagle3.config import RegenerateConfig, VerifierConfig
from eagle3.regenerate import read_user_turns, regenerate
from eagle3.speculative import greedy_decode
from eagle3.store import ArtifactError, ArtifactStore, Provenance
from eagle3.verifier import load_text_model, load_tokenizer, resolve_verifier

CFG = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=2)


@pytest.fixture
def verifier(tiny_verifier, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    return store, resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "a", "prompt": "What is two plus two?"},
        {"question_id": 81, "turns": ["Name a colour.", "Now another one."]},
        {"id": "c", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "old answer"}]},
    ])


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
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is two plus two?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    expected = greedy_decode(model, prompt, CFG.max_new_tokens, {tokenizer.eos_token_id}).tokens
    expected = [t for t in expected if t != tokenizer.eos_token_id]
    assert rows["a"]["messages"][1]["content"] == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_a_rerun_after_a_crash_regenerates_only_what_is_missing(verifier, prompts):
    store, manifest = verifier
    provenance = Provenance(config={"run": "resume"})
    work = store.work_dir("regenerated", provenance.key)
    finished = {"id": "a", "messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "FOUR"}],
                "finish_reasons": ["stop"], "tokens": 1}
    (work / "done.jsonl").write_text(json.dumps(finished) + "\n")

    out = regenerate(CFG, prompts, manifest, store, provenance)

    rows = {r["id"]: r for r in pq.read_table(out.path / "conversations.parquet").to_pylist()}
    assert rows["a"]["messages"][1]["content"] == "FOUR"
    assert len(rows) == 3
