from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import write_jsonl
from tiny_models import CHATML, GENERATION, LLAMA3, THINKING, tiny_tokenizer

from eagle3.config import DatasetConfig
from eagle3.data.prepare_dataset import DatasetManifest, build_loss_mask, prepare_dataset, read_conversations
from eagle3.store.artifacts import ArtifactError, ArtifactStore, artifact_damage
from eagle3.store.manifests import Provenance

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "More"},
    {"role": "assistant", "content": "Sure"},
]


@pytest.fixture(
    scope="module",
    params=[
        (CHATML, "Hello there<|im_end|>Sure<|im_end|>"),
        (LLAMA3, "Hello there<|eot_id|>Sure<|eot_id|>"),
        (GENERATION, "Hello there<|im_end|>Sure<|im_end|>"),
        (GENERATION.replace("<|im_end|>{% endgeneration %}", "{% endgeneration %}<|im_end|>"), "Hello thereSure"),
        (THINKING, "Hello there<|im_end|>Sure<|im_end|>"),
    ],
    ids=["chatml", "llama3", "generation-markers", "generation-markers-content-only", "thinking-prompt"],
)
def template_case(request):
    template, supervised = request.param
    return tiny_tokenizer(template), supervised


def _segments(mask: list[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def test_loss_mask_covers_exactly_the_assistant_turns(template_case):
    """Where the template marks what is generated, its markers decide (the content-only case differs
    from what the rendering's prefixes would give)."""
    tokenizer, expected_supervised = template_case

    ids, mask = build_loss_mask(tokenizer, CONVERSATION)

    assert len(ids) == len(mask)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == expected_supervised
    assert _segments(mask) == 2
    unsupervised = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Hi" in unsupervised and "More" in unsupervised and "Be brief." in unsupervised
    assert "Hello" not in unsupervised


@pytest.fixture(scope="module")
def chatml():
    return tiny_tokenizer(CHATML)


def test_sharegpt_records_read_like_messages(tmp_path):
    path = write_jsonl(
        tmp_path / "sg.jsonl", [{"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]
    )

    [(record_id, messages)] = list(read_conversations(path))

    assert record_id == "a"
    assert messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_unknown_role_names_file_record_and_field(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"id": "r7", "messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
        ],
    )

    with pytest.raises(ArtifactError, match=r"bad\.jsonl: record 1 \(id 'r7'\): field 'messages\[1\]\.role': unknown role 'robot'"):
        list(read_conversations(path))


def test_unreadable_record_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [\n')

    with pytest.raises(ArtifactError, match=r"broken\.jsonl: record 1 \(line 2\): not valid JSON"):
        list(read_conversations(path))


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": "caf\u00e9"}\n'.encode("latin-1"))

    with pytest.raises(ArtifactError, match=r"latin1\.jsonl: record 1 \(line 2\): not UTF-8 text \(byte 17: b'\\xe9'\)"):
        list(read_conversations(path))


def test_a_conversation_the_chat_template_refuses_names_file_and_record(tmp_path):
    """Templates such as Llama 2's and Mistral's raise on turns that do not alternate."""
    strict = tiny_tokenizer(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "id": "twice",
                "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
            }
        ],
    )

    with pytest.raises(ArtifactError, match=r"c\.jsonl: record id 'twice': field 'messages': Conversation roles must alternate"):
        prepare_dataset(DatasetConfig(), path, strict, ArtifactStore(tmp_path / "store"), Provenance())


def test_missing_turns_field_names_it(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"id": 3, "text": "hello"}])

    with pytest.raises(ArtifactError, match=r"x\.jsonl: record 0 \(id '3'\): field 'messages' .* is missing"):
        list(read_conversations(path))


def test_prepare_drops_and_counts_unsupervised_records_and_truncates(tmp_path, chatml, caplog):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": "only a question"}]},
            {"messages": [{"role": "user", "content": "q " * 300}, {"role": "assistant", "content": "late answer"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer " * 100}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "short"}]},
        ],
    )
    store = ArtifactStore(tmp_path / "store")

    manifest = prepare_dataset(DatasetConfig(max_seq_len=64), path, chatml, store, Provenance())

    assert manifest.dropped == {"no_assistant_turn": 1, "no_supervised_token": 1}
    assert manifest.num_records == 2
    assert manifest.num_truncated == 1  # the record truncated to no answer at all counts as dropped only
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"{path}: 1 record(s) dropped, no_assistant_turn: set regenerate.enabled=true to have the verifier answer user-only records",
        f"{path}: 1 record(s) dropped, no_supervised_token: raise dataset.max_seq_len: truncation cut off every assistant token",
        f"{path}: 1 record(s) truncated to dataset.max_seq_len=64 tokens",
    ]
    table = pq.read_table(manifest.path / manifest.files[0])
    assert table.column("seq_len").to_pylist() == [64, len(table.column("input_ids")[1])]
    assert table.column("record_id").to_pylist() == ["2", "3"]
    freq = pq.read_table(manifest.path / "token_freq.parquet").to_pydict()
    supervised = sum(sum(m) for m in table.column("loss_mask").to_pylist())
    assert sum(freq["count"]) == supervised == manifest.num_supervised_tokens


def test_prepare_is_content_addressed(tmp_path, chatml, conversations):
    store = ArtifactStore(tmp_path / "store")

    first = prepare_dataset(DatasetConfig(), conversations, chatml, store, Provenance(config={"run": 1}))
    second = prepare_dataset(DatasetConfig(), conversations, chatml, store, Provenance(config={"run": 2}))

    assert first.digest == second.digest
    assert (first.path / "manifest.json").exists()


FIRST_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tiny_models import CHATML, tiny_tokenizer
from eagle3.config import DatasetConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
print(prepare_dataset(DatasetConfig(), Path(sys.argv[2]), tiny_tokenizer(CHATML), ArtifactStore(sys.argv[1]), Provenance(config={"run": "same"})).model_dump_json())
"""


def _held_by_another_process(lock: Path) -> bool:
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def _write_once_read(fifo: Path, text: str, deadline: float) -> None:
    """Write `text` into `fifo` once a reader has it open, failing at `deadline` rather than hanging."""
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # no reader yet
            assert time.monotonic() < deadline, f"nothing opened {fifo} for reading"
            time.sleep(0.1)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@pytest.mark.slow
def test_a_run_that_waited_for_the_same_step_returns_what_the_other_run_published(tmp_path, chatml, conversations):
    """The source is a FIFO: the first run blocks reading it while it holds the step's work dir, and
    a second run that read it too would block for good, as nothing writes to it a second time."""
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "same"})
    source = tmp_path / "conversations.fifo"
    os.mkfifo(source)
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST_RUN, str(store.root), str(source), str(Path(__file__).parents[1])], stdout=subprocess.PIPE, text=True
    )
    lock = store.root / "locks" / f"dataset-{provenance.key[:24]}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60
    while not _held_by_another_process(lock):
        assert time.monotonic() < deadline and first.poll() is None, "the first run never took the step's work dir"
        time.sleep(0.1)
    waits = []
    waiting = logging.Handler()
    waiting.emit = lambda record: waits.append(record.getMessage())
    logging.getLogger("eagle3").addHandler(waiting)
    second = []
    thread = threading.Thread(target=lambda: second.append(prepare_dataset(DatasetConfig(), source, chatml, store, provenance)))
    try:
        thread.start()
        while not any("waiting for another run of step 'dataset'" in m for m in waits):
            assert time.monotonic() < deadline, "the second run did not wait"
            time.sleep(0.1)
        _write_once_read(source, conversations.read_text(), deadline)  # the first run reads it, publishes, releases
        published = DatasetManifest.model_validate_json(first.communicate(timeout=60)[0])
        thread.join(30)
        assert not thread.is_alive(), "the second run did the step again: it is blocked reading the source"
    finally:
        logging.getLogger("eagle3").removeHandler(waiting)
        first.kill()
        if thread.is_alive():
            os.close(os.open(source, os.O_WRONLY))  # let it read an empty source and fail
            thread.join(30)

    assert second == [published]  # the same manifest: its run time and producer too, so not a second run's
    assert any("another run published it for the same inputs" in m for m in waits)


def test_a_step_the_store_already_published_returns_it_without_reading_its_inputs(tmp_path, chatml, conversations):
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "same"})
    first = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)
    conversations.unlink()  # a run that did the step again would fail reading it

    again = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)

    assert again == first  # the stored manifest: the first run's time and producer
    with store.step_work_dir(DatasetManifest, provenance) as (work, published):
        assert published == first
    assert not work.exists()  # nothing is left behind


def test_a_moved_store_hands_back_its_artifact_at_its_new_path(tmp_path, chatml, conversations):
    provenance = Provenance(config={"run": "same"})
    first = prepare_dataset(DatasetConfig(), conversations, chatml, ArtifactStore(tmp_path / "here"), provenance)
    (tmp_path / "here").rename(tmp_path / "there")  # another mount point, or a copy on another host

    again = prepare_dataset(DatasetConfig(), conversations, chatml, ArtifactStore(tmp_path / "there"), provenance)

    assert again.path == tmp_path / "there" / "artifacts" / first.digest and (again.path / "token_freq.parquet").is_file()
    assert again.model_copy(update={"path": first.path}) == first


def test_an_artifact_whose_files_changed_is_computed_again_and_so_repaired(tmp_path, chatml, conversations, caplog):
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "same"})
    first = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)
    (first.path / "token_freq.parquet").write_bytes(b"not what was published")

    again = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)

    assert again.digest == first.digest and artifact_damage(first.path) is None
    assert "its files hash to" in caplog.text and "computing it again" in caplog.text


def test_an_artifact_whose_manifest_names_another_kind_is_computed_again_and_its_manifest_repaired(tmp_path, chatml, conversations):
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "same"})
    first = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)
    record = json.loads((first.path / "manifest.json").read_text())
    (first.path / "manifest.json").write_text(json.dumps(record | {"kind": "regenerated"}))

    again = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)
    conversations.unlink()  # a third run that did the step again would fail reading it

    assert again.digest == first.digest and json.loads((first.path / "manifest.json").read_text())["kind"] == "dataset"
    assert prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance).digest == first.digest


def test_what_a_run_killed_after_publishing_left_in_the_work_dir_goes_when_the_artifact_is_handed_back(tmp_path, chatml, conversations):
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "same"})
    first = prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance)
    left = store.work_path("dataset", provenance.key)
    left.mkdir()
    (left / "token_freq.parquet").write_bytes(b"half written")

    assert prepare_dataset(DatasetConfig(), conversations, chatml, store, provenance) == first
    assert not left.exists()
