"""Extraction by a real vLLM server (`extract.backend=vllm`): the CPU build in .venv-vllm, started
by the command `eagle3 extraction-server --cpu` prints, so through `eagle3/extraction/vllm_cpu_connector.py`."""

from __future__ import annotations

import fcntl
import json
import os
import shlex

import pytest
import torch
from conftest import SAMPLE, free_port
from safetensors.torch import load_file, save_file
from tiny_models import with_repository_tokenizer
from vllm_server import EXTRACTED_AUX as AUX
from vllm_server import EXTRACTION_CONTEXT, SERVED_NAME, ServerFront

from eagle3.cli import main
from eagle3.config import ConfigError, DatasetConfig, EndpointConfig, ExtractConfig, VerifierConfig
from eagle3.data.prepare_dataset import load_dataset_table, prepare_dataset
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.extraction.served import ServedStates, read_states
from eagle3.extraction.shards import hidden_state_files
from eagle3.serving.endpoint import EndpointError
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # vLLM servers


def _setup(server, store_dir):
    """An extracting server, its verifier, and a sample dataset whose samples fit its context."""
    store = ArtifactStore(store_dir)
    verifier = resolve_verifier(VerifierConfig(path=str(server.verifier_dir)), store)
    tokenizer = load_tokenizer(verifier.path)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=EXTRACTION_CONTEXT - 1, max_records=12), SAMPLE, tokenizer, store, Provenance())
    return store, verifier, dataset, server.base_url, server.storage


@pytest.fixture(scope="module")
def served_setup(extraction_server, tmp_path_factory):
    """The session's extracting server (a Llama verifier), set up as `_setup` says."""
    return _setup(extraction_server, tmp_path_factory.mktemp("store"))


def _served(base_url: str, storage, **kw) -> ExtractConfig:
    return ExtractConfig(
        aux_layer_ids=AUX,
        records_per_shard=5,
        backend="vllm",
        served_states_dir=str(storage),
        endpoint=EndpointConfig(base_url=base_url, model=SERVED_NAME, **kw),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("server", ["extraction_server", "moe_extraction_server"])  # Llama; Qwen3-MoE, experts in every layer
def test_served_states_equal_the_in_process_ones_and_are_cached_apart(server, request, tmp_path):
    store, verifier, dataset, base_url, served_files = _setup(request.getfixturevalue(server), tmp_path / "store")

    local = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, records_per_shard=5), dataset, verifier, store, Provenance(config={"run": "local"})
    )
    served = extract_hidden_states(
        _served(base_url, served_files, concurrency=3), dataset, verifier, store, Provenance(config={"run": "served"})
    )

    assert (served.num_records, served.extracted_shards, len(served.shards)) == (10, 2, 2)  # 2 of 12 records had no answer left
    assert {s["key"] for s in served.shards}.isdisjoint(s["key"] for s in local.shards)  # a server's rounding is not the step's
    ids = load_dataset_table(dataset).column("input_ids").to_pylist()
    local_files, served_files_by_sample = hidden_state_files(local), hidden_state_files(served)
    for i, token_ids in enumerate(ids):
        mine, theirs = load_file(local_files[i]), load_file(served_files_by_sample[i])
        assert theirs["token_ids"].tolist() == token_ids
        assert theirs["hidden_states"].dtype == torch.bfloat16
        assert theirs["hidden_states"].shape == (len(token_ids), 4, 256)
        torch.testing.assert_close(theirs["hidden_states"].float(), mine["hidden_states"].float(), atol=2e-2, rtol=1.6e-2)
    assert list(served_files.iterdir()) == []  # each file the server wrote was read and removed, lock and all


@pytest.mark.vllm
def test_a_rerun_asks_the_server_only_for_shards_not_yet_extracted(served_setup, tmp_path):
    _, verifier, dataset, base_url, storage = served_setup
    store = ArtifactStore(tmp_path / "store")
    first = extract_hidden_states(_served(base_url, storage), dataset, verifier, store, Provenance(config={"run": 1}))
    second = store.root / "shards" / first.shards[1]["key"]
    (second / "done.json").unlink()
    second.rename(second.with_name(second.name + ".partial"))  # as a run killed before its last shard was checked

    again = extract_hidden_states(_served(base_url, storage), dataset, verifier, store, Provenance(config={"run": 2}))

    assert (first.extracted_shards, again.extracted_shards, again.reused_shards) == (2, 1, 1)
    assert [s["key"] for s in again.shards] == [s["key"] for s in first.shards]


@pytest.fixture(scope="module")
def one_server(served_setup, tmp_path_factory):
    """The setup's samples extracted by its server alone, in a store of their own: what spreading must equal."""
    _, verifier, dataset, base_url, storage = served_setup
    store = ArtifactStore(tmp_path_factory.mktemp("one-server"))
    return extract_hidden_states(_served(base_url, storage, concurrency=2), dataset, verifier, store, Provenance())


def _shard_files(manifest) -> list[dict]:
    """Each shard's key, records and file digests, as `shards.json` lists them."""
    return json.loads((manifest.path / "shards.json").read_text())


@pytest.mark.vllm
def test_samples_spread_over_two_servers_give_the_states_one_server_gives(served_setup, one_server, tmp_path):
    _, verifier, dataset, base_url, storage = served_setup
    other_host = ServerFront(base_url)  # the same model served at another address
    cfg = _served(base_url, storage, concurrency=2).model_copy(update={"more_base_urls": [other_host.base_url]})

    spread = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "store"), Provenance())

    assert _shard_files(spread) == _shard_files(one_server)
    assert 0 < other_host.posts < spread.num_records  # each server answered some of the samples
    assert list(storage.iterdir()) == []


@pytest.mark.vllm
def test_a_server_that_dies_mid_shard_loses_only_its_requests_in_flight(served_setup, one_server, tmp_path, caplog):
    _, verifier, dataset, base_url, storage = served_setup
    dying = ServerFront(base_url, answers=1)  # one sample of the first shard, then it dies asking for another
    cfg = _served(base_url, storage, concurrency=1, max_retries=1).model_copy(update={"more_base_urls": [dying.base_url]})

    with caplog.at_level("WARNING", logger="eagle3"):
        spread = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "store"), Provenance())

    assert dying.posts == 2  # it answered one request and died on the next
    assert _shard_files(spread) == _shard_files(one_server)
    [dropped] = [r.getMessage() for r in caplog.records if "in flight go to the other" in r.getMessage()]  # not asked again
    assert dropped.startswith(f"{dying.base_url}: the server did not answer after 1 retries")


@pytest.mark.vllm
def test_a_record_longer_than_the_served_context_is_named_before_any_request(served_setup, tmp_path):
    _, verifier, _, base_url, storage = served_setup
    store = ArtifactStore(tmp_path / "store")
    long = prepare_dataset(DatasetConfig(max_seq_len=1024), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    table = load_dataset_table(long)
    lengths = table.column("seq_len").to_pylist()
    first_long = next(i for i, n in enumerate(lengths) if n >= EXTRACTION_CONTEXT)
    record_id = table.column("record_id")[first_long].as_py()

    with pytest.raises(
        ConfigError,
        match=rf"record '{record_id}' \(sample {first_long}, {lengths[first_long]} tokens\): "
        rf"the server takes {EXTRACTION_CONTEXT} tokens a request.*--max-model-len",
    ):
        extract_hidden_states(_served(base_url, storage), long, verifier, store, Provenance())

    assert list((store.root / "shards").iterdir()) == []


@pytest.mark.vllm
def test_a_sample_the_server_refuses_is_named_with_its_reason(served_setup):
    _, verifier, _, base_url, storage = served_setup
    one_at_a_time = EndpointConfig(base_url=base_url, model=SERVED_NAME, concurrency=1)  # the short sample is answered first
    source = ServedStates([one_at_a_time], 4, verifier.hidden_size, storage)
    written = []

    with pytest.raises(ConfigError, match=rf"record 'long' \(sample 7, {EXTRACTION_CONTEXT} tokens\): the server refused it: HTTP 400"):
        source.extract([(6, "short", [5, 6, 7]), (7, "long", [5] * EXTRACTION_CONTEXT)], lambda i, states: written.append(i))

    assert written == [6]


@pytest.mark.vllm
def test_a_server_that_does_not_extract_is_told_apart(served_draft, tmp_path):
    cfg = EndpointConfig(base_url=served_draft.base_url, model=served_draft.model)

    with pytest.raises(
        EndpointError,
        match=r"record 'r0': Response missing kv_transfer_params\. Is the server started with the flags of `eagle3 extraction-server`",
    ):
        source = ServedStates([cfg], 4, served_draft.verifier.hidden_size, tmp_path)
        source.states(source.servers[0], [5, 6, 7], "record 'r0'")


def _states_file(path, token_ids, shape=(4, 8)) -> str:
    save_file({"hidden_states": torch.randn(len(token_ids), *shape), "token_ids": torch.tensor(token_ids)}, str(path))
    return str(path)


def test_a_file_of_another_layer_count_or_other_tokens_is_refused_and_removed(tmp_path):
    wrong_layers = _states_file(tmp_path / "a.safetensors", [5, 6, 7], shape=(5, 8))
    other_tokens = _states_file(tmp_path / "b.safetensors", [5, 6, 8])

    with pytest.raises(
        EndpointError,
        match=r"a\.safetensors \(record 'r0'\): field 'hidden_states' holds \(5, 8\) \(layers, H\) per token, expected \(4, 8\)",
    ):
        read_states(wrong_layers, [5, 6, 7], (4, 8), "record 'r0'", tmp_path)
    with pytest.raises(EndpointError, match=r"b\.safetensors \(record 'r1'\): Token ids don't match"):
        read_states(other_tokens, [5, 6, 7], (4, 8), "record 'r1'", tmp_path)

    assert list(tmp_path.iterdir()) == []


def test_a_file_this_host_cannot_read_names_the_path_and_the_shared_directory(tmp_path):
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")

    with pytest.raises(EndpointError, match=r"missing\.safetensors \(record 'r0'\): FileNotFoundError.*shared_storage_path"):
        read_states(str(tmp_path / "missing.safetensors"), [5], (4, 8), "record 'r0'", tmp_path)
    with pytest.raises(EndpointError, match=r"torn\.safetensors \(record 'r1'\): SafetensorError"):
        read_states(str(torn), [5], (4, 8), "record 'r1'", tmp_path)

    assert list(tmp_path.iterdir()) == []


def test_a_file_whose_writer_keeps_its_lock_is_waited_for_then_left_to_it(tmp_path):
    path = tmp_path / "s.safetensors"
    writer = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(writer, fcntl.LOCK_EX)  # as the server's writer thread holds it until the file is written
    try:
        with pytest.raises(
            EndpointError, match=r"s\.safetensors \(record 'r0'\): the server still held .*s\.safetensors\.lock after 0\.3 s"
        ):
            read_states(str(path), [5, 6], (4, 8), "record 'r0'", tmp_path, lock_timeout_s=0.3)
        _states_file(path, [5, 6])  # written late, then let go
    finally:
        os.close(writer)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors", "s.safetensors.lock"]  # named in the error, for deletion


def test_an_unreachable_server_stops_the_step_before_any_shard(prepared_tiny, tmp_path):
    store, verifier, dataset = prepared_tiny
    closed = ExtractConfig(
        aux_layer_ids=AUX, backend="vllm", endpoint=EndpointConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", max_retries=0)
    )

    with pytest.raises(EndpointError, match=r"did not answer after 0 retries .*APIConnectionError"):
        extract_hidden_states(closed, dataset, verifier, store, Provenance())

    assert list((store.root / "shards").iterdir()) == []


def test_the_printed_gpu_server_command_captures_the_configured_layers_with_vllms_connector(tiny_verifier, tmp_path, capsys):
    overrides = [
        f"verifier.path={tiny_verifier}",
        f"store_dir={tmp_path}",
        "extract.aux_layer_ids=[1,2,3]",
        "extract.endpoint.base_url=http://gpu-host/v1",
    ]

    assert main(["extraction-server", *overrides]) == 0

    command = shlex.split(capsys.readouterr().out)
    assert command[:3] == ["vllm", "serve", str(tiny_verifier)]
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags["--port"] == "80" and flags["--served-model-name"] == "verifier"
    assert json.loads(flags["--speculative-config"])["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    connector = json.loads(flags["--kv-transfer-config"])
    assert connector["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in connector
    assert connector["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "served-states")
    assert "--trust-remote-code" not in command


def test_the_printed_server_command_trusts_the_verifiers_code_where_the_run_does(tiny_verifier, tmp_path, capsys):
    own = with_repository_tokenizer(tiny_verifier, tmp_path / "own-tokenizer")

    assert (
        main(
            [
                "extraction-server",
                f"verifier.path={own}",
                "verifier.trust_remote_code=true",
                f"store_dir={tmp_path}",
                "extract.aux_layer_ids=[1,2,3]",
            ]
        )
        == 0
    )

    assert "--trust-remote-code" in shlex.split(capsys.readouterr().out)


@pytest.fixture(scope="module")
def prepared_tiny(tiny_verifier, tmp_path_factory):
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=64, max_records=4), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return store, verifier, dataset
