"""Prepare dataset: conversations -> token ids and an assistant-only loss mask.

Input: JSONL or parquet, one conversation per record, as OpenAI `messages` ([{role, content}])
or ShareGPT `conversations` ([{from, value}]). Each is rendered with the verifier's own chat
template and tokenized with its tokenizer. The loss mask covers assistant turns only and is
derived from the rendered template, so it works for any template:

- templates with `{% generation %}` markers: the tokenizer's own assistant mask;
- otherwise: the characters each assistant turn adds to the rendering (its text after the
  generation prompt, or after as much of it as the rendering shares, up to and including its
  end-of-turn marker), mapped to tokens by offsets.

Output (`data-NNNNN.parquet`): `input_ids`, `loss_mask`, `seq_len`, `record_id`; and
`token_freq.parquet` (`token_id`, `count`) over supervised positions. Tokenization is the cost:
~1-2 ms per conversation on one core.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from tqdm import tqdm

from eagle3.config import DatasetConfig
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import ArtifactManifest, Provenance

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import pyarrow as pa

__all__ = [
    "SAMPLE_CONVERSATIONS",
    "SAMPLE_EVAL_PROMPTS",
    "DatasetManifest",
    "build_loss_mask",
    "dataset_source",
    "load_dataset_table",
    "prepare_dataset",
    "read_conversations",
    "read_user_turns",
]

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "system": "system",
}
SAMPLE_CONVERSATIONS = Path(__file__).parent / "sample_conversations.jsonl"  # what the default run trains on
SAMPLE_EVAL_PROMPTS = Path(__file__).parent / "sample_eval_prompts.jsonl"  # and measures on
RECORDS_PER_FILE = 50_000
logger = logging.getLogger(__name__)
# What a user can do about each reason a record is dropped.
DROP_FIXES = {
    "no_assistant_turn": "set regenerate.enabled=true to have the verifier answer user-only records",
    "no_supervised_token": "raise dataset.max_seq_len: truncation cut off every assistant token",
}
Record = tuple[str, list[dict[str, str]], list[str]]  # (id, system messages, user turns)
TURN_KEYS = {"messages": ("role", "content"), "conversations": ("from", "value")}  # a conversation's field: its turns' keys


class DatasetManifest(ArtifactManifest):
    kind: str = "dataset"
    num_records: int
    num_tokens: int
    num_supervised_tokens: int
    num_truncated: int
    dropped: dict[str, int]
    files: list[str]


def dataset_source(cfg: DatasetConfig) -> Path:
    """The conversations file to read (the sample shipped with the package when none is set)."""
    if cfg.path:
        path = Path(cfg.path).expanduser().resolve()
        if not path.is_file():
            raise ArtifactError(path, "dataset.path does not exist or is not a file")
        return path
    return SAMPLE_CONVERSATIONS


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, record) pairs; an unreadable record raises naming the file and line."""
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, row
        return
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 1]
                raise ArtifactError(path, f"record {i} (line {i + 1}): not UTF-8 text (byte {exc.start}: {bad!r})") from exc
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ArtifactError(path, f"record {i} (line {i + 1}): not valid JSON ({exc.msg} at column {exc.colno})") from exc


def _record_id(record: dict, index: int, fields: tuple[str, ...] = ("id",)) -> str:
    """The record's id: the first of `fields` it has, not null; else its index."""
    return str(next((record[f] for f in fields if record.get(f) is not None), index))


def _prompt_turns(path: Path, index: int, record: dict) -> tuple[list[dict[str, str]], list[str], list[str]] | None:
    """(system messages, user turns, each user turn's field) of a prompt-shaped record: `prompt`,
    GSM8K `question` or MT-bench `turns`, the first present; None if it has none of them."""
    field = next((f for f in ("prompt", "question", "turns") if f in record), None)
    if field is None:
        return None
    if field != "turns":
        turns, names = [record[field]], [field]
    elif isinstance(record["turns"], list) and record["turns"]:
        turns, names = record["turns"], [f"turns[{t}]" for t in range(len(record["turns"]))]
    else:
        raise ArtifactError(path, f"record {index}: field 'turns' must be a non-empty list of strings")
    for turn, name in zip(turns, names):
        if not isinstance(turn, str):
            raise ArtifactError(path, f"record {index}: field '{name}' must be a string, not {type(turn).__name__}")
    return [], list(turns), names


def read_user_turns(path: Path, limit: int | None) -> list[Record]:
    """(record id, system messages, user turns) per record, from any prompt shape: `prompt`, GSM8K
    `question`, MT-bench `turns`, or the user turns of `messages`/`conversations`.

    Raises:
        ArtifactError: a record has no user turn, an empty one, a prompt field of the wrong type, or
            shares its id (`id`, `question_id`, else its index) with an earlier one: answers are kept
            by id, so one would silently replace the other.
    """
    out: list[Record] = []
    first_with_id: dict[str, int] = {}
    for index, record in read_records(path):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(record, dict):
            raise ArtifactError(path, f"record {index}: expected a JSON object")
        record_id = _record_id(record, index, ("id", "question_id"))
        if record_id in first_with_id:
            raise ArtifactError(
                path,
                f"record {index}: field 'id': {record_id!r} is also the id of record {first_with_id[record_id]}; "
                "answers are kept by id, so ids must be unique",
            )
        first_with_id[record_id] = index
        if (asked := _prompt_turns(path, index, record)) is not None:
            system, users, names = asked
        elif "messages" in record or "conversations" in record:
            _, messages = _normalise(path, index, record)
            field = next(f for f in TURN_KEYS if f in record)
            role_key, text_key = TURN_KEYS[field]
            users = [m["content"] for m in messages if m["role"] == "user"]
            names = [f"{field}[{t}].{text_key}" for t, m in enumerate(messages) if m["role"] == "user"]
            if not users:
                raise ArtifactError(path, f"record {index} (id {record_id!r}): field '{role_key}': no user turn to answer")
            system = [m for m in messages if m["role"] == "system"]
        else:
            raise ArtifactError(
                path, f"record {index}: no prompt field: expected 'prompt', 'question', 'turns', 'messages' or 'conversations'"
            )
        if (empty := next((name for name, turn in zip(names, users) if not turn.strip()), None)) is not None:
            raise ArtifactError(path, f"record {index} (id {record_id!r}): field '{empty}' is empty: no question to answer")
        out.append((record_id, system, users))
    return out


def _normalise(path: Path, index: int, record: Any) -> tuple[str, list[dict[str, str]]]:
    where = f"record {index}"
    if not isinstance(record, dict):
        raise ArtifactError(path, f"{where}: expected a JSON object, got {type(record).__name__}")
    record_id = _record_id(record, index)
    where = f"record {index} (id {record_id!r})"
    field = next((f for f in TURN_KEYS if f in record), None)
    if field is None:
        raise ArtifactError(path, f"{where}: field 'messages' (or ShareGPT 'conversations') is missing; found {sorted(record)}")
    role_key, text_key = TURN_KEYS[field]
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        raise ArtifactError(path, f"{where}: field '{field}' must be a non-empty list of turns")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ArtifactError(path, f"{where}: field '{field}[{t}]' must be an object with '{role_key}' and '{text_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ArtifactError(
                path,
                f"{where}: field '{field}[{t}].{role_key}': unknown role {turn[role_key]!r}; expected one of {sorted(ROLE_ALIASES)}",
            )
        if not isinstance(turn[text_key], str):
            raise ArtifactError(path, f"{where}: field '{field}[{t}].{text_key}' must be a string")
        messages.append({"role": role, "content": turn[text_key]})
    return record_id, messages


def read_conversations(path: Path, limit: int | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(record id, messages) for each record, validated; roles normalised to user/assistant/system."""
    for n, (index, record) in enumerate(read_records(path)):
        if limit is not None and n >= limit:
            return
        yield _normalise(path, index, record)


def _render(tokenizer, messages, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def _shared_length(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def build_loss_mask(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on assistant tokens."""
    if "{% generation %}" in (tokenizer.chat_template or "") or "{%- generation %}" in (tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])

    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # Where the rendering leaves the generation prompt: a thinking model's prompt may open a
        # `<think>` block its rendered answers do not hold (DeepSeek-R1's), and those characters are the answer's.
        start = _shared_length(_render(tokenizer, messages[:i], add_generation_prompt=True), text)
        end = len(_render(tokenizer, messages[: i + 1]).rstrip())
        if not text.startswith(_render(tokenizer, messages[: i + 1]).rstrip()):
            raise ValueError("the chat template does not render conversations prefix-consistently")
        spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def prepare_dataset(cfg: DatasetConfig, source: Path, tokenizer, store: ArtifactStore, provenance: Provenance) -> DatasetManifest:
    """Tokenize `source` into parquet files in a work dir, then publish them.

    Raises:
        ArtifactError: a record is unreadable, lacks its turns, or has an unknown role.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    with store.step_work_dir(DatasetManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step
        for old in work.glob("*.parquet"):
            old.unlink()
        freq: Counter[int] = Counter()
        dropped: Counter[str] = Counter()
        rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": [], "record_id": []}
        files: list[str] = []
        num_tokens = num_truncated = num_records = 0

        def flush() -> None:
            if rows["seq_len"]:
                name = f"data-{len(files):05d}.parquet"
                pq.write_table(pa.table(rows), work / name)
                files.append(name)
                for column in rows.values():
                    column.clear()

        for record_id, messages in tqdm(read_conversations(source, cfg.max_records), desc="prepare dataset", unit="rec"):
            if not any(m["role"] == "assistant" for m in messages):
                dropped["no_assistant_turn"] += 1
                continue
            try:
                ids, mask = build_loss_mask(tokenizer, messages)
            except (ValueError, TemplateError) as exc:  # e.g. a template that needs alternating roles
                raise ArtifactError(source, f"record id {record_id!r}: field 'messages': {exc}") from exc
            truncated = len(ids) > cfg.max_seq_len
            ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
            if not any(mask):
                dropped["no_supervised_token"] += 1
                continue
            num_truncated += truncated
            freq.update(t for t, m in zip(ids, mask) if m)
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
            rows["seq_len"].append(len(ids))
            rows["record_id"].append(record_id)
            num_tokens += len(ids)
            num_records += 1
            if len(rows["seq_len"]) >= RECORDS_PER_FILE:
                flush()
        flush()
        if num_records == 0:
            raise ArtifactError(source, f"no record has a supervised (assistant) token; dropped: {dict(dropped)}")
        for reason, count in sorted(dropped.items()):
            logger.warning("%s: %d record(s) dropped, %s: %s", source, count, reason, DROP_FIXES[reason])
        if num_truncated:
            logger.warning("%s: %d record(s) truncated to dataset.max_seq_len=%d tokens", source, num_truncated, cfg.max_seq_len)
        token_ids = sorted(freq)
        pq.write_table(pa.table({"token_id": token_ids, "count": [freq[t] for t in token_ids]}), work / "token_freq.parquet")
        return store.publish(
            work,
            DatasetManifest(
                **provenance.model_dump(),
                path=work,
                num_records=num_records,
                num_tokens=num_tokens,
                num_supervised_tokens=sum(freq.values()),
                num_truncated=num_truncated,
                dropped=dict(dropped),
                files=files,
                seconds=clock(),
            ),
        )


def load_dataset_table(manifest: DatasetManifest) -> pa.Table:
    """All records of a prepared dataset, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(Path(manifest.path) / f) for f in manifest.files])
