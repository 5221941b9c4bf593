"""What a server, a shared result store or a deployment's form can make a run do: read or delete
files only in the states directory, keep credentials out of every record and message, refuse
verifier code where a deployment pins it off, and store task results as JSON, never pickles."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3.cli import main
from eagle3.config import ConfigError, EndpointConfig, load_config
from eagle3.extraction.served import ServedStates
from eagle3.preflight import REMOTE_CODE_ENV, check_preflight
from eagle3.serving.endpoint import EndpointError, open_client
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.runs import record_run, replay_file

SECRET = "s3cret-pw"
MODEL = "verifier"


@contextmanager
def fake_openai_server(states_path: str = "", prompt_ids: list[int] | None = None, password: str | None = None) -> Iterator[str]:
    """A real HTTP server speaking the two calls served extraction makes: it lists `MODEL`, and
    answers every completion with `states_path` as the file it wrote (what a hostile or misconfigured
    server, or whoever answers at its address, may say). With `password`, it wants HTTP basic auth."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict) -> None:
            expected = "Basic " + base64.b64encode(f"user:{password}".encode()).decode()
            if password is not None and self.headers.get("Authorization") != expected:
                self.send_response(401)
                body = {"error": {"message": "bad credentials"}}
            else:
                self.send_response(200)
            data = json.dumps(body).encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}]})

        def do_POST(self):
            asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._answer(
                {
                    "id": "c",
                    "object": "text_completion",
                    "created": 0,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "text": "a",
                            "finish_reason": "length",
                            "logprobs": None,
                            "prompt_token_ids": asked["prompt"] if prompt_ids is None else prompt_ids,
                        }
                    ],
                    "kv_transfer_params": {"hidden_states_path": states_path},
                }
            )

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _victim(path) -> str:
    """A states file of the right shape for the request below, and its lock, outside the states directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": torch.zeros(3, 4, 8), "token_ids": torch.tensor([5, 6, 7])}, str(path))
    (path.parent / f"{path.name}.lock").write_text("")
    return str(path)


@pytest.mark.parametrize("named", ["an absolute path elsewhere", "a path climbing out with ..", "a path through a link in the directory"])
def test_a_file_the_server_names_outside_the_states_directory_is_neither_read_nor_removed(named, tmp_path):
    storage, victim = tmp_path / "served-states", tmp_path / "home" / "notes.safetensors"
    storage.mkdir()
    _victim(victim)
    (storage / "link").symlink_to(victim.parent, target_is_directory=True)
    path = {
        "an absolute path elsewhere": str(victim),
        "a path climbing out with ..": f"{storage}/../home/notes.safetensors",
        "a path through a link in the directory": f"{storage}/link/notes.safetensors",
    }[named]

    with fake_openai_server(path) as url:
        served = ServedStates([EndpointConfig(base_url=url, model=MODEL)], 4, 8, storage)
        with pytest.raises(EndpointError, match=r"outside the states directory .*served-states .*neither read nor removed"):
            served.states(served.servers[0], [5, 6, 7], "record 'r0'")

    assert victim.exists() and victim.with_name("notes.safetensors.lock").exists()


def test_a_refused_answer_naming_a_file_outside_the_states_directory_removes_nothing(tmp_path):
    storage, victim = tmp_path / "served-states", tmp_path / "home" / "notes.safetensors"
    storage.mkdir()
    _victim(victim)

    with fake_openai_server(str(victim), prompt_ids=[1, 2]) as url, pytest.raises(EndpointError, match=r"Prompt token IDs mismatch"):
        served = ServedStates([EndpointConfig(base_url=url, model=MODEL)], 4, 8, storage)
        served.states(served.servers[0], [5, 6, 7], "record 'r0'")  # answered with other tokens

    assert victim.exists() and victim.with_name("notes.safetensors.lock").exists()


def test_a_states_file_inside_the_states_directory_is_read_and_removed(tmp_path):
    storage = tmp_path / "served-states"
    inside = _victim(storage / "hs_0.safetensors")

    with fake_openai_server(inside) as url:
        served = ServedStates([EndpointConfig(base_url=url, model=MODEL)], 4, 8, storage)
        states = served.states(served.servers[0], [5, 6, 7], "record 'r0'")

    assert tuple(states.shape) == (3, 4, 8)
    assert list(storage.iterdir()) == []


@pytest.mark.slow
def test_credentials_in_a_base_url_reach_the_server_and_nothing_else(tmp_path, capsys):
    from flows.train_draft import train_eagle3_draft

    with fake_openai_server(password=SECRET) as url:
        with_credentials = url.replace("http://", f"http://user:{SECRET}@")
        endpoint = EndpointConfig(base_url=with_credentials, model=MODEL)
        open_client(endpoint)  # the server accepted them
        config = load_config(
            None,
            [
                f"store_dir={tmp_path}",
                "regenerate.backend=openai",
                f"regenerate.endpoint.model={MODEL}",
                f"regenerate.endpoint.base_url={with_credentials}",
            ],
        )
        with pytest.raises(EndpointError) as refused:  # and a message about the server never shows them
            open_client(endpoint.model_copy(update={"model": "other"}))

    parameters = train_eagle3_draft.serialize_parameters({"config": config})  # what the Prefect database stores of a run
    replay = replay_file(record_run(ArtifactStore(tmp_path), "run-1", [], config.model_dump(mode="json")))  # the run's record
    assert main(["config", f"regenerate.endpoint.base_url={with_credentials}"]) == 0
    shown = [json.dumps(parameters), replay.read_text(), capsys.readouterr().out, str(refused.value), repr(config)]
    assert all(SECRET not in text for text in shown)
    assert "http://***@127.0.0.1:" in str(refused.value)
    assert config.regenerate.endpoint.base_url == with_credentials  # what the client is given


def test_a_deployment_that_pins_remote_code_off_refuses_a_run_that_asks_for_it(tiny_verifier, tmp_path, monkeypatch):
    from flows.train_draft import train_eagle3_draft

    config = load_config(
        None,
        [f"store_dir={tmp_path}", f"verifier.path={tiny_verifier}", "extract.aux_layer_ids=[1,2,3]", "verifier.trust_remote_code=true"],
    )
    check_preflight(config)  # allowed where nothing pins it
    monkeypatch.setenv(REMOTE_CODE_ENV, "false")

    with pytest.raises(ConfigError, match=rf"verifier.trust_remote_code=true, but {REMOTE_CODE_ENV}=false here"):
        train_eagle3_draft.fn(config)  # the flow, as a deployment's worker runs it, before any step
    check_preflight(config.model_copy(update={"verifier": config.verifier.model_copy(update={"trust_remote_code": False})}))


def test_the_shipped_deployments_pin_remote_code_off():
    import yaml
    from conftest import ROOT

    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]

    assert {d["name"]: d["work_pool"]["job_variables"]["env"][REMOTE_CODE_ENV] for d in deployments} == {
        "train-on-demand": "false",
        "scheduled-retrain": "false",
    }


class _OpensAFile:
    """What a planted pickle could do: here, create `marker` when unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.slow
def test_a_pickle_planted_in_the_result_store_under_a_steps_key_is_never_unpickled(prefect_server, tiny_verifier, tmp_path):
    from prefect.results import get_default_result_storage
    from prefect.serializers import PickleSerializer

    from eagle3.config import VerifierConfig
    from eagle3.verifier.resolve_verifier import verifier_source
    from tasks.verifier import resolve_verifier_task

    cfg = VerifierConfig(path=str(tiny_verifier))
    args = (str(tmp_path / "store"), cfg, verifier_source(cfg))
    results = Path(get_default_result_storage(_sync=True).basepath)
    before = set(results.iterdir()) if results.exists() else set()
    first = resolve_verifier_task(*args, return_state=True)
    [record] = set(results.iterdir()) - before
    stored = json.loads(record.read_text())
    marker = tmp_path / "unpickled"
    stored["metadata"]["serializer"] = {"type": "pickle", "picklelib": "cloudpickle"}
    stored["result"] = PickleSerializer().dumps(_OpensAFile(str(marker))).decode()
    record.write_text(json.dumps(stored))  # as whoever may write the shared result store would

    again = resolve_verifier_task(*args, return_state=True)

    assert first.is_completed() and again.name == "Completed"  # not a cache hit: the step ran again
    assert again.result().digest == first.result().digest
    assert not marker.exists()


def test_no_step_of_the_flow_pickles_its_result_even_where_prefect_persists_by_default():
    from prefect import Task

    import flows.train_draft as flow_module
    from tasks.cache import ManifestSerializer

    tasks = {name: t for name, t in vars(flow_module).items() if isinstance(t, Task)}

    assert set(tasks) == {  # every step: a new one must be listed here, and is then checked
        "build_vocab_mapping_task",
        "evaluate_task",
        "export_checkpoint_task",
        "extract_hidden_states_task",
        "given_draft_task",
        "measure_baselines_task",
        "online_states_task",
        "prepare_dataset_task",
        "previous_draft_task",
        "promote_task",
        "publish_lineage_task",
        "regenerate_task",
        "resolve_verifier_task",
        "train_draft_task",
    }
    for name, task in tasks.items():  # None would follow PREFECT_RESULTS_PERSIST_BY_DEFAULT, and its pickle serializer
        assert task.persist_result is False or isinstance(task.result_serializer, ManifestSerializer), name
    assert flow_module.train_eagle3_draft.persist_result is False
