"""Shared fixtures: tiny real verifiers, a prepared dataset, a real Prefect server and a real vLLM server."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# Before torch starts OpenMP, for this process and every one its tests start: OpenMP threads that
# wait for the others at a barrier sleep rather than spin. The tests' processes share the CPUs (xdist
# workers, vLLM servers, training children): a spinning thread holds a core that the thread it
# waits for needs. Three tiny trainings side by side on two cores took 216 s spinning, 59 s so;
# one alone takes as long either way (13.6 s, 13.8 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import (
    KIMI_INT4_IGNORE,
    KIMI_INT4_WEIGHTS,
    SAMPLE,
    compressed_checkpoint,
    tiny_kimi_k25,
    tiny_llama,
    tiny_llava,
    tiny_qwen3_moe,
    tiny_qwen3_vl_moe,
)

from tasks.settings import set_prefect_defaults

# As `eagle3 run` sets them, before Prefect configures its logging on import (nothing above imports it):
# the library's records go to the run's log on the server.
set_prefect_defaults()

# Under pytest-xdist (pyproject's addopts: `-n`, `--dist loadgroup`) each group of tests runs on
# one worker: a test module, so that its module-scoped fixtures (a trained draft, a vLLM engine)
# are built once; the tests of a vLLM server that several modules share, so that one worker starts
# it, once; and the tests of the registered deployments (a minute to register).
SHARED_SERVERS = {
    "served_draft": "vllm-served-draft",
    "served_two_layer_draft": "vllm-served-draft",
    "served_moe_draft": "vllm-served-draft",
    "extraction_server": "vllm-extraction",
    "moe_extraction_server": "vllm-extraction",
    "deployments": "deployments",
}
# The longest groups, handed out first, longest first (measured on 2 cores): a worker that took one
# of them last would run on alone long after the others had finished.
LONGEST_GROUPS = [
    "tests/flows/test_default_smollm2.py",  # the README's default run, SmolLM2 at full size: 7 min alone
    "vllm-served-draft",  # three vLLM servers, each serving a draft the pipeline trains first
    "tests/eagle3/test_vllm_engine.py",  # five vLLM engines
    "tests/eagle3/test_evaluate.py",
    "tests/eagle3/test_training_resume.py",
    "tests/eagle3/test_train_export.py",
    "vllm-extraction",  # two extracting vLLM servers
    "deployments",
    "tests/flows/test_termination.py",
]
GROUPS_DIR = "EAGLE3_TEST_GROUPS_DIR"  # where each xdist worker writes the group of every test it collected


def group_of(item) -> str:
    """The xdist group of a collected test."""
    used = set(item.fixturenames)
    if callspec := getattr(item, "callspec", None):  # `request.getfixturevalue(param)`: a fixture named by a parameter
        used |= {value for value in callspec.params.values() if isinstance(value, str)}
    return next((group for fixture, group in SHARED_SERVERS.items() if fixture in used), item.nodeid.split("::", 1)[0])


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and config.getoption("dist", "no") == "loadgroup":
        os.environ[GROUPS_DIR] = tempfile.mkdtemp(prefix="eagle3-test-groups-")  # before the workers start


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and GROUPS_DIR in os.environ:
        shutil.rmtree(os.environ.pop(GROUPS_DIR), ignore_errors=True)


def pytest_collection_modifyitems(items):
    """A test that starts a server (`vllm`, `e2e`) is `slow`: out of the fast lane.

    In one process, tests of the `vllm` marker run last: the session's vLLM servers (1.7 GB each,
    their own engine processes) then start once the rest is done and share the CPUs with nothing
    heavier. On xdist's workers the longest groups come first instead (`--no-loadscope-reorder`
    keeps this order)."""
    for item in items:
        if item.get_closest_marker("vllm") or item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.slow)
    if "PYTEST_XDIST_WORKER" in os.environ:
        rank = {group: i for i, group in enumerate(LONGEST_GROUPS)}
        items.sort(key=lambda item: rank.get(group_of(item), len(rank)))
    else:
        items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook tells the controller this worker has collected
def pytest_collection_finish(session):
    if (worker := os.environ.get("PYTEST_XDIST_WORKER")) and GROUPS_DIR in os.environ:
        groups = {item.nodeid: group_of(item) for item in session.items}
        written = Path(os.environ[GROUPS_DIR], f"{worker}.json")
        written.with_suffix(".tmp").write_text(json.dumps(groups))
        written.with_suffix(".tmp").replace(written)  # the controller never reads half a file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` by `group_of`: pytest-xdist 3.8's own loadgroup renames each test
    (`item._nodeid`), which pytest 9.2 no longer reads, so its groups are ignored. The controller
    reads the groups the workers wrote once they have all collected."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups: dict[str, str] = {}

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not groups:
                for written in Path(os.environ[GROUPS_DIR]).glob("*.json"):
                    groups.update(json.loads(written.read_text()))
            return groups.get(nodeid, nodeid.split("::", 1)[0])  # none written: by module, as --dist loadscope

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory) -> Path:
    """A 4-layer, hidden-64 random Llama with a ChatML byte-level tokenizer (vocab 1024)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_nested_verifier(tmp_path_factory) -> Path:
    return tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_kimi_verifier(tmp_path_factory) -> Path:
    """A nested MoE verifier shaped like Kimi-K2.5: DeepSeek-V3 decoder (MLA, experts) beside a vision tower."""
    pytest.importorskip("transformers.models.kimi_k25", reason="this transformers has no Kimi-K2.5 model")
    return tiny_kimi_k25(tmp_path_factory.mktemp("tiny-kimi-k25"))


@pytest.fixture(scope="session")
def tiny_kimi_int4_verifier(tiny_kimi_verifier, tmp_path_factory) -> Path:
    """tiny_kimi_verifier as Kimi-K2.5 ships: INT4 routed experts (compressed-tensors), the config in text_config."""
    out = tmp_path_factory.mktemp("tiny-kimi-int4") / "int4"
    return compressed_checkpoint(tiny_kimi_verifier, out, KIMI_INT4_WEIGHTS, KIMI_INT4_IGNORE, nested=True)[0]


@pytest.fixture(scope="session")
def tiny_qwen_vl_moe_verifier(tmp_path_factory) -> Path:
    """A nested MoE verifier shaped like Qwen3-VL-MoE, whose text config has no `*ForCausalLM`."""
    return tiny_qwen3_vl_moe(tmp_path_factory.mktemp("tiny-qwen3-vl-moe"))


@pytest.fixture
def conversations(tmp_path) -> Path:
    """40 GSM8K conversations in `messages` form, a copy the test may edit."""
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def first_epoch_steps(draft) -> int:
    """The steps of the first epoch of `draft`'s training (a DraftManifest): a training of the same
    settings and data packs its epochs alike. speculators' sampler packs each epoch from its own
    shuffle, so epochs differ in length and `total // epochs` need not fall in the first."""
    records = [json.loads(line) for line in (draft.path / "metrics.jsonl").read_text().splitlines()]
    return sum(1 for r in records if "train" in r and r["epoch"] == 0)


def work_dir_path(store, step: str, key: str):
    """A step's work directory, created and released at once: where a test plants what a killed run left."""
    with store.work_dir(step, key) as work:
        pass
    work.mkdir(parents=True, exist_ok=True)  # an empty work dir is removed on release
    return work


class LogSeen(logging.Handler):
    """`seen` is set once a log record containing `message` is emitted; `messages`: each such record's."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record):
        if self.message in (text := record.getMessage()):
            self.messages.append(text)
            self.seen.set()


@dataclass
class ClaimedRun:
    """What `run_while_another_run_holds_the_step` saw of the step it ran."""

    released_at: float = 0.0  # when the other run let go of the step
    claimed_at: list[float] = field(default_factory=list)  # when the step entered its GPU claim
    claimed_before_release: list[float] = field(default_factory=list)
    finished_at: float = 0.0
    result: Any = None


CLAIM_WAIT_S = 1.0  # how long the test's claim takes to grant, as a GPU another run holds would


def run_while_another_run_holds_the_step(store, manifest_type, provenance, step) -> ClaimedRun:
    """Run `step(claim)` while another thread holds the step's work directory, as another run
    would, until the step logs that it waits. The step runs in this thread: training on CPU
    installs signal handlers, which only the main thread may."""
    run = ClaimedRun()
    held, waiting = threading.Event(), LogSeen("waiting for another run of step")

    @contextmanager
    def claim():
        run.claimed_at.append(time.monotonic())
        time.sleep(CLAIM_WAIT_S)
        yield None

    def other_run():
        with store.step_work_dir(manifest_type, provenance):
            held.set()
            waiting.seen.wait(30)
            run.claimed_before_release = list(run.claimed_at)
            run.released_at = time.monotonic()

    logging.getLogger("eagle3").addHandler(waiting)
    thread = threading.Thread(target=other_run)
    thread.start()
    try:
        assert held.wait(30)
        run.result = step(claim)
        run.finished_at = time.monotonic()
    finally:
        thread.join(60)
        logging.getLogger("eagle3").removeHandler(waiting)
    assert waiting.seen.is_set(), "the step did not wait for the run holding it"
    assert run.claimed_before_release == [], "the step claimed its GPU while it waited for the other run"
    return run


def publish_text_artifact(store, kind: str, content: str, parents: dict[str, str], manifest_type=None, files=None, **fields):
    """A one-file artifact (plus `files`: name -> text) with the given parents and manifest fields:
    lineage, gc and promotion tests need the graph and the manifest, not the payload."""
    from eagle3.store.manifests import ArtifactManifest

    with store.work_dir(kind, content) as work:
        (work / "data.txt").write_text(content)
        for name, text in (files or {}).items():
            (work / name).write_text(text)
        return store.publish(work, (manifest_type or ArtifactManifest)(kind=kind, path=work, parents=parents, **fields))


def publish_evaluation(
    store,
    name: str,
    taus: dict[int, float],
    verifier="a" * 64,
    prompts="b" * 64,
    max_new_tokens=64,
    num_prompts=4,
    draft="d" * 64,
    counts=None,
    ngram_tau: float | None = 1.2,
    **measured,
):
    """Checkpoint `name` (of `draft`) and an evaluation of it in `store`, shaped as the evaluate step
    publishes them; `counts` (k -> each prompt's EAGLE-3 tokens and passes) go to its per_prompt.json.
    `ngram_tau`: the baselines' n-gram tau at every k (None: none measured, as with backend 'vllm')."""
    from eagle3.evaluation.evaluate import EvalManifest
    from eagle3.evaluation.tau import PER_PROMPT

    checkpoint = publish_text_artifact(store, "checkpoint", name, {"draft": draft})
    settings = {"prompts_path": None, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "ks": list(taus), **measured}
    results = [{"method": "eagle3", "k": k, "tau": tau} for k, tau in taus.items()]
    gains = None
    if ngram_tau is not None:
        results += [{"method": "ngram", "k": k, "tau": ngram_tau} for k in taus]
        gains = [{"k": k, "gain": tau - ngram_tau, "standard_error": 0.1} for k, tau in taus.items()]
    return publish_text_artifact(
        store,
        "evaluation",
        json.dumps([name, settings, results]),
        {"checkpoint": checkpoint.digest, "hidden_states": "e" * 64, "verifier": verifier, "prompts": prompts},
        manifest_type=EvalManifest,
        files={PER_PROMPT: json.dumps({"eagle3": counts})} if counts else None,
        config={"cfg": settings},
        num_prompts=num_prompts,
        num_tokens=num_prompts * max_new_tokens,
        tau_sim=2.5,
        results=results,
        gains_over_ngram=gains,
        greedy_tokens_per_s=100.0,
        mismatches=0,
    )


def wait_for_http(url: str, server: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Poll `url` until it answers; raise with the log's tail if `server` exits or time runs out."""
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{url} did not come up: {log_path.read_text()[-3000:]}") from None
            time.sleep(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_draft(tmp_path_factory, num_layers: int, build=tiny_llama):
    from vllm_server import SERVED_NAME, ServedDraft, train_draft_for_serving, vllm_server

    root = tmp_path_factory.mktemp(f"served-{num_layers}-layer")
    store, verifier, hidden_states, checkpoint = train_draft_for_serving(root, num_layers, build)
    with vllm_server(verifier.path, checkpoint.path, root / "vllm.log") as base_url:
        yield ServedDraft(base_url, SERVED_NAME, store, verifier, hidden_states, checkpoint)


@pytest.fixture(scope="session")
def served_draft(tmp_path_factory):
    """One real vLLM server for the session: a tiny verifier with a draft the pipeline exported."""
    yield from _serve_draft(tmp_path_factory, num_layers=1)


@pytest.fixture(scope="session")
def extraction_server(tmp_path_factory):
    """One real vLLM server for the session that extracts a tiny verifier's hidden states."""
    from vllm_server import extracting_server

    with extracting_server(tmp_path_factory.mktemp("served-extraction")) as server:
        yield server


@pytest.fixture(scope="module")
def moe_extraction_server(tmp_path_factory):
    """The same for an MoE verifier (Qwen3-MoE): how a verifier too large for one GPU is extracted."""
    from vllm_server import extracting_server

    with extracting_server(tmp_path_factory.mktemp("served-moe-extraction"), build=tiny_qwen3_moe) as server:
        yield server


@pytest.fixture(scope="module")
def served_two_layer_draft(tmp_path_factory):
    """The same with a 2-layer draft (vLLM builds as many layers as the checkpoint names)."""
    yield from _serve_draft(tmp_path_factory, num_layers=2)


@pytest.fixture(scope="module")
def served_moe_draft(tmp_path_factory):
    """The same for an MoE verifier (Qwen3-MoE: experts in every layer)."""
    yield from _serve_draft(tmp_path_factory, num_layers=1, build=tiny_qwen3_moe)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` (SQLite), with this process's Prefect client pointed at it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": url}
    with open(home / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_http(f"{url}/health", server, home / "server.log", timeout_s=180)
        except RuntimeError:
            server.kill()
            raise
        try:
            with temporary_settings(
                updates={PREFECT_API_URL: url, PREFECT_HOME: str(home), PREFECT_LOCAL_STORAGE_PATH: str(home / "storage")}
            ):
                yield url
                from prefect.logging.handlers import APILogWorker

                APILogWorker.drain_all(timeout=10)  # send the last logs before the server stops
        finally:
            server.terminate()
            server.wait(timeout=30)


# Deployments registered against the real server, a tiny run config, and a real process worker.
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def deployments(prefect_server):
    """prefect.yaml registered by deployments/register.sh (once: it costs about a minute)."""
    from prefect.client.orchestration import get_client

    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    done = subprocess.run([str(ROOT / "deployments" / "register.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with get_client(sync_client=True) as client:
        return {name: client.read_deployment_by_name(f"train-eagle3-draft/{name}") for name in ("train-on-demand", "scheduled-retrain")}


@pytest.fixture
def tiny_run_config(tiny_verifier, conversations, tmp_path) -> dict:
    """`config` for a deployment run that finishes in about 90 s on 2 cores."""
    return {
        "store_dir": str(tmp_path / "store"),
        "verifier": {"path": str(tiny_verifier)},
        "dataset": {"path": str(conversations), "max_seq_len": 256},
        "extract": {"aux_layer_ids": [1, 2, 3]},
        "vocab": {"draft_vocab_size": 512},
        "train": {"epochs": 1, "total_seq_len": 512},
        "evaluate": {"num_prompts": 1, "max_new_tokens": 8, "ks": [3]},
    }


@pytest.fixture
def start_worker(prefect_server, tmp_path):
    """Starts a real process worker that takes the pool's due runs once, runs them and exits.

    Returns its log file; start it after the run exists, or it finds nothing and exits.
    """
    log_path = tmp_path / "worker.log"
    workers = []

    def start() -> Path:
        # What a flow run's environment gets beyond the worker's own comes from prefect.yaml's job variables.
        env = {**os.environ, "PREFECT_API_URL": prefect_server}
        env.pop("PREFECT_LOGGING_EXTRA_LOGGERS", None)  # `eagle3.cli.main`, called in-process by other tests, sets it
        with open(log_path, "w") as log:
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", "eagle3", "--run-once"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        return log_path

    yield start
    for worker in workers:
        worker.terminate()
        worker.wait(timeout=60)
