"""Bad input ends `eagle3 run` with one line per problem, `eagle3: <file>: <what> ... <fix>`, and exit 2:
before Prefect starts where it can be seen from the configuration and the files' headers and counts
(`eagle3.preflight`), and with no traceback on the terminal where only a step can see it."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SAMPLE
from tiny_runs import tiny_run_args

from eagle3.cli import main


@pytest.fixture
def run_args(tiny_verifier, conversations, tmp_path):
    """`eagle3 run` of a tiny verifier; a test adds what it breaks (later overrides win)."""
    return tiny_run_args(tmp_path / "store", tiny_verifier, conversations)


def _refused(args: list[str], capsys) -> list[str]:
    """The `eagle3:` lines of a run that must stop before Prefect starts."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "temporary Prefect server" not in err and "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("eagle3: ")]


def _broken_copy(verifier: Path, out: Path) -> Path:
    shutil.copytree(verifier, out)
    weights = out / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a copy cut short
    return out


@pytest.mark.parametrize(
    "what",
    [
        "a .parquet file that is not parquet",
        "a one-record dataset",
        "a training share too small for any record",
        "truncated verifier weights",
        "a .gguf file that is not GGUF",
        "store_dir naming a file",
        "more eval prompts than the file holds",
        "default aux layers colliding on a 4-layer verifier",
        "a draft_path that does not exist",
        "a draft_path that is no checkpoint",
    ],
)
def test_bad_input_is_named_in_one_line_before_prefect_starts(what, run_args, tiny_verifier, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    override, expected = {
        "a .parquet file that is not parquet": (
            f"dataset.path={bad / 'chats.parquet'}",
            r"chats\.parquet: dataset\.path is not a parquet file \(.*\); write it again",
        ),
        "a one-record dataset": (
            f"dataset.path={bad / 'one.jsonl'}",
            r"one\.jsonl: 1 record\(s\) to use: train\.train_data_ratio=0\.9 splits them 0 for "
            r"training and 1 for validation, and each needs at least one\. Give at least 2 records",
        ),
        "a training share too small for any record": (
            "train.train_data_ratio=0.00001",
            r"train\.train_data_ratio=1e-05 splits them 0 for training and \d+ for validation, and each needs at least "
            r"one\. Give at least 100000 records",
        ),
        "truncated verifier weights": (
            f"verifier.path={bad / 'verifier'}",
            r"verifier/model\.safetensors: truncated: its header lists \d+ bytes of tensors, "
            r"the file holds \d+; copy the verifier again",
        ),
        "a .gguf file that is not GGUF": (
            f"verifier.path={bad / 'model.gguf'}",
            r"model\.gguf: not a GGUF file: it starts with b'<htm', not b'GGUF'",
        ),
        "store_dir naming a file": (
            f"store_dir={bad / 'store'}",
            r"bad/store: store_dir is a file, not a directory: set store_dir to a directory",
        ),
        "more eval prompts than the file holds": (
            "evaluate.num_prompts=17",
            r"sample_eval_prompts\.jsonl: holds 16 prompts, but evaluate\.num_prompts is 17: set "
            r"evaluate\.num_prompts to at most 16",
        ),
        "default aux layers colliding on a 4-layer verifier": (
            "extract.aux_layer_ids=null",
            r"has 4 layers: the default extract\.aux_layer_ids \[2, n//2, n-3\] = \[2, 2, 1\] repeat a "
            r"layer\. Set extract\.aux_layer_ids to 3 distinct ascending ids in 0\.\.3, e\.g\. \[1, 2, 3\]",
        ),
        "a draft_path that does not exist": (f"draft_path={bad / 'no-draft'}", r"bad/no-draft: draft_path does not exist"),
        "a draft_path that is no checkpoint": (
            f"draft_path={bad}",
            r"bad: draft_path has no config\.json: not an exported speculators checkpoint directory",
        ),
    }[what]
    (bad / "chats.parquet").write_text('{"messages": []}\n')
    (bad / "one.jsonl").write_text(SAMPLE.read_text().splitlines(keepends=True)[0])
    _broken_copy(tiny_verifier, bad / "verifier")
    (bad / "model.gguf").write_text("<html>Not found</html>")  # what a failed download saves
    (bad / "store").write_text("")

    [line] = _refused([*run_args, override], capsys)

    assert re.search(expected, line), line


def test_every_problem_found_before_the_run_gets_its_own_line(run_args, tiny_verifier, tmp_path, capsys):
    lines = _refused([*run_args, f"verifier.path={_broken_copy(tiny_verifier, tmp_path / 'v')}", "evaluate.num_prompts=99"], capsys)

    assert len(lines) == 2
    assert "model.safetensors: truncated" in lines[0] and "holds 16 prompts" in lines[1]


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no one may write into, root included (an immutable one where tests run as root)."""
    store = tmp_path / "read-only-store"
    store.mkdir()
    if os.geteuid() != 0:
        store.chmod(0o555)
        yield store
        store.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(store)], capture_output=True).returncode != 0:
        pytest.skip("running as root where `chattr +i` cannot make a directory read-only")
    try:
        yield store
    finally:
        subprocess.run(["chattr", "-i", str(store)], check=True)


def test_a_read_only_store_is_named_before_prefect_starts(run_args, read_only_dir, capsys):
    [line] = _refused([*run_args, f"store_dir={read_only_dir}"], capsys)

    assert re.search(
        r"read-only-store: store_dir is not writable \((Permission denied|Operation not permitted)\): every step "
        r"writes its artifacts there; set store_dir to a directory you may write",
        line,
    ), line


def test_a_store_with_less_free_space_than_any_run_needs_is_named_before_prefect_starts(run_args, tmp_path, monkeypatch, capsys):
    from eagle3.extraction.storage import MIN_FREE_BYTES

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=MIN_FREE_BYTES - 2**20))

    [line] = _refused(run_args, capsys)

    assert line == (
        f"eagle3: {tmp_path / 'store'}: only {(MIN_FREE_BYTES >> 20) - 1} MiB free on store_dir's filesystem, below the "
        f"{MIN_FREE_BYTES >> 20} MiB any run needs: free space or set store_dir elsewhere"
    )


def _run_cli(args: list[str], prefect_server: str, cwd: Path, limit_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    """`eagle3 run` in its own process against the session's server; `limit_file_bytes`: no file it
    writes may grow beyond this (`ulimit -f`), which is how a disk filling up meets a write."""

    def limit():
        if limit_file_bytes is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit fails with EFBIG, as one on a full disk with ENOSPC
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    return subprocess.run(
        [sys.executable, "-m", "eagle3.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900, preexec_fn=limit
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_error_inside_the_flow_ends_in_one_line_with_the_traceback_in_the_log_only(prefect_server, run_args, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(['{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}\n'] * 4))

    done = _run_cli([*run_args, f"dataset.path={chats}"], prefect_server, ROOT)

    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"eagle3: {chats}: record 0 (id '0'): field 'messages[1].role': unknown role 'bot'"), output
    [log] = (tmp_path / "store" / "logs").glob("run-*.log")
    assert "Traceback" in log.read_text() and f"(traceback: {log})" in output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_disk_that_fills_during_a_step_ends_in_one_line_naming_the_store(prefect_server, run_args, tmp_path):
    done = _run_cli(run_args, prefect_server, ROOT, limit_file_bytes=100_000)  # a long sample's hidden states are the first file above it

    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    assert re.match(
        rf"eagle3: {tmp_path / 'store'}\S*: cannot write: File too large\. Free space on store_dir's filesystem "
        r"\(or set store_dir elsewhere\) and run again: finished steps stay cached",
        done.stderr.splitlines()[-1],
    ), output
