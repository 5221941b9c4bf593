from __future__ import annotations

import json
import logging
import math
import shutil
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from conftest import LogSeen
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.config import ConfigError, DatasetConfig, ExtractConfig, VerifierConfig
from eagle3.data.prepare_dataset import load_dataset_table, prepare_dataset
from eagle3.extraction.extract_hidden_states import ExtractAttempt, ShardWork, _extract_attempt, extract_hidden_states
from eagle3.extraction.shards import hidden_state_files, shard_lock, verify_shard
from eagle3.extraction.storage import MIN_FREE_BYTES, ROOM_MARGIN, bytes_per_token
from eagle3.extraction.writer import OverlappedWriter
from eagle3.runtime.faults import FAULT_OOM_ENV
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.loading import load_text_model, load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def prepared(tiny_verifier, tmp_path_factory):
    from conftest import SAMPLE

    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256, max_records=24), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return store, verifier, dataset


def _all_states(manifest) -> dict[int, torch.Tensor]:
    return {i: load_file(p)["hidden_states"] for i, p in hidden_state_files(manifest).items()}


def test_packed_batches_match_batch_size_one(prepared, tmp_path):
    _, verifier, dataset = prepared

    one = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, prefill_batch_tokens=1), dataset, verifier, ArtifactStore(tmp_path / "a"), Provenance()
    )
    packed = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, prefill_batch_tokens=4096), dataset, verifier, ArtifactStore(tmp_path / "b"), Provenance()
    )

    a, b = _all_states(one), _all_states(packed)
    assert sorted(a) == list(range(dataset.num_records))
    for i in a:
        assert a[i].shape == b[i].shape == (a[i].shape[0], 4, verifier.hidden_size)
        torch.testing.assert_close(a[i].float(), b[i].float(), atol=2e-2, rtol=1.6e-2)


def test_last_slot_is_the_pre_norm_final_state(prepared):
    store, verifier, dataset = prepared
    manifest = extract_hidden_states(ExtractConfig(aux_layer_ids=AUX), dataset, verifier, store, Provenance())
    model = load_text_model(verifier.path, torch.float32, "cpu")
    ids = load_dataset_table(dataset).column("input_ids")[0].as_py()

    stored = load_file(hidden_state_files(manifest)[0])["hidden_states"]
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)

    torch.testing.assert_close(model.model.norm(stored[:, 3].float()), out.last_hidden_state[0], atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(stored[:, 0].float(), out.hidden_states[1][0], atol=2e-2, rtol=1.6e-2)


def test_aux_layer_ids_out_of_range_name_the_verifier_and_layers(prepared):
    store, verifier, dataset = prepared

    with pytest.raises(ConfigError, match=r"extract.aux_layer_ids = \[1, 2, 9\]: verifier '.*' has 4 layers.*out of range: \[9\]"):
        extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 9]), dataset, verifier, store, Provenance(config={"aux": [1, 2, 9]}))


def test_default_aux_ids_need_enough_layers(prepared):
    store, verifier, dataset = prepared

    with pytest.raises(
        ConfigError, match=r"the default extract\.aux_layer_ids \[2, n//2, n-3\] = .* Set extract\.aux_layer_ids to 3 distinct"
    ):
        extract_hidden_states(ExtractConfig(), dataset, verifier, store, Provenance(config={"aux": None}))


def test_killed_extraction_resumes_at_the_first_unfinished_shard(prepared, tmp_path):
    _, verifier, dataset = prepared
    store = ArtifactStore(tmp_path)
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=8)
    provenance = Provenance(config={"resume": True})

    class Killed(Exception):
        pass

    def die_after_first_shard(done, total):
        raise Killed

    with pytest.raises(Killed):
        extract_hidden_states(cfg, dataset, verifier, store, provenance, on_progress=die_after_first_shard)
    [finished] = [p for p in (store.root / "shards").iterdir() if not p.name.endswith(".partial")]
    first_shard = {p.name: p.stat().st_mtime_ns for p in finished.iterdir()}
    calls = []

    resumed = extract_hidden_states(cfg, dataset, verifier, store, provenance, on_progress=lambda d, t: calls.append((d, t)))

    assert len(calls) == 2  # shards 1 and 2 of 3
    assert (resumed.extracted_shards, resumed.reused_shards) == (2, 1)
    assert {p.name: p.stat().st_mtime_ns for p in finished.iterdir()} == first_shard
    fresh = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "fresh"), Provenance())
    assert fresh.digest == resumed.digest


def _room_for(tokens: int, hidden_size: int) -> int:
    """The fewest free bytes with which `tokens` tokens' states are extracted (bf16)."""
    return math.ceil(tokens * bytes_per_token(hidden_size, "bf16") * (1 + ROOM_MARGIN)) + MIN_FREE_BYTES


def test_states_that_would_not_fit_the_disk_are_refused_before_a_shard_is_written_and_a_resumed_run_counts_only_what_is_left(
    prepared, monkeypatch, tmp_path
):
    _, verifier, dataset = prepared
    store = ArtifactStore(tmp_path)
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=8)
    lengths = [len(ids) for ids in load_dataset_table(dataset).column("input_ids").to_pylist()]
    usage = shutil.disk_usage(tmp_path)

    def free(n: int) -> None:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=n))

    free(_room_for(sum(lengths), verifier.hidden_size) - 1)
    with pytest.raises(ArtifactError, match=r"not extracting: .* tokens of hidden states take .* Ways out: extract.storage=fp8") as refused:
        extract_hidden_states(cfg, dataset, verifier, store, Provenance())
    assert str(store.root / "shards") in str(refused.value)
    assert list((store.root / "shards").iterdir()) == []

    class Killed(Exception):
        pass

    def die_after_first_shard(done, total):
        raise Killed

    free(_room_for(sum(lengths), verifier.hidden_size))
    with pytest.raises(Killed):
        extract_hidden_states(cfg, dataset, verifier, store, Provenance(), on_progress=die_after_first_shard)
    free(_room_for(sum(lengths[8:]), verifier.hidden_size))  # the first shard's 8 records are on disk already
    resumed = extract_hidden_states(cfg, dataset, verifier, store, Provenance())
    assert (resumed.extracted_shards, resumed.reused_shards) == (2, 1)


def _while_other_runs_extract(tmp_path, dataset, verifier, held: int, then) -> tuple[object, list[str], bool]:
    """Extract into a store where other runs hold the locks of the first `held` shards; once this
    run waits for one, `then(store, keys)` and let go. Returns the manifest, the claim's enter/exit
    events, and whether the claim was held while this run waited."""
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=8)
    reference = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "reference"), Provenance())
    keys = [shard["key"] for shard in reference.shards[:held]]
    store = ArtifactStore(tmp_path / "shared")
    waiting, result, claim_events = LogSeen("waiting for another run extracting shard"), {}, []

    @contextmanager
    def claim():
        claim_events.append("enter")
        yield None
        claim_events.append("exit")

    def later_run():
        try:
            result["manifest"] = extract_hidden_states(cfg, dataset, verifier, store, Provenance(), claim=claim)
        except BaseException as exc:
            result["error"] = exc

    logging.getLogger("eagle3").addHandler(waiting)
    later = threading.Thread(target=later_run)
    try:
        with ExitStack() as others:  # the other runs, part way through their shards
            for key in keys:
                others.enter_context(shard_lock(store.root / "shards", key))
            later.start()
            assert waiting.seen.wait(60), "the later run did not wait for the shards"
            # The later run is blocked on a held lock, past any claim it took: its claim state is fixed until `then`.
            claimed_while_waiting = claim_events[-1:] == ["enter"]
            then(store, keys)
        later.join(120)
    finally:
        logging.getLogger("eagle3").removeHandler(waiting)
    assert not later.is_alive()
    if "error" in result:
        raise result["error"]
    assert result["manifest"].digest == reference.digest
    return result["manifest"], claim_events, claimed_while_waiting


def _finish(tmp_path):
    def copy_from_reference(store, keys):
        for key in keys:
            shutil.copytree(tmp_path / "reference" / "shards" / key, store.root / "shards" / key)

    return copy_from_reference


def test_a_shard_another_run_is_extracting_is_skipped_then_waited_for_without_a_gpu_and_reused(prepared, tmp_path):
    """Two runs that need one shard extract it once: the later run extracts the others first, lets
    its GPU claim go, waits on the shard's lock, then finds the shard finished."""
    _, verifier, dataset = prepared

    manifest, claims, claimed_while_waiting = _while_other_runs_extract(tmp_path, dataset, verifier, 1, _finish(tmp_path))

    assert (manifest.extracted_shards, manifest.reused_shards) == (2, 1)
    assert claims == ["enter", "exit"] and not claimed_while_waiting


def test_a_shard_whose_other_run_died_is_extracted_on_a_new_claim(prepared, tmp_path):
    _, verifier, dataset = prepared

    manifest, claims, claimed_while_waiting = _while_other_runs_extract(tmp_path, dataset, verifier, 1, lambda store, keys: None)

    assert (manifest.extracted_shards, manifest.reused_shards) == (3, 0)
    assert claims == ["enter", "exit", "enter", "exit"] and not claimed_while_waiting


def test_a_run_whose_shards_are_all_being_extracted_by_others_never_claims(prepared, tmp_path):
    _, verifier, dataset = prepared

    manifest, claims, _ = _while_other_runs_extract(tmp_path, dataset, verifier, 3, _finish(tmp_path))

    assert (manifest.extracted_shards, manifest.reused_shards) == (0, 3)
    assert claims == []


def test_an_attempt_that_finds_every_shard_taken_never_loads_the_verifier(prepared, tmp_path):
    """The race a run's probe can lose: the shards it saw free are taken when its attempt starts.
    The verifier's path holds no model, so loading it would raise."""
    _, verifier, dataset = prepared
    shard_root = tmp_path / "shards"
    shard_root.mkdir()
    todo = [ShardWork(index=k, key=f"shard-{k}", records=[k]) for k in range(2)]
    no_model = verifier.model_copy(update={"path": tmp_path / "no-model"})
    spec = ExtractAttempt(dataset=dataset, verifier=no_model, aux=AUX, device="cpu", shard_root=shard_root, todo=todo, budget=1024)

    with shard_lock(shard_root, "shard-0"), shard_lock(shard_root, "shard-1"):
        result = _extract_attempt(spec, lambda k, extracted: None)

    assert (result.busy, result.oom) == ([0, 1], None)


def test_a_run_whose_shards_are_all_extracted_claims_no_gpu(prepared):
    store, verifier, dataset = prepared
    cfg = ExtractConfig(aux_layer_ids=AUX)
    claims = []

    @contextmanager
    def claim():
        claims.append(len(claims))
        yield None

    first = extract_hidden_states(cfg, dataset, verifier, store, Provenance(config={"run": "claims 1"}), claim=claim)
    claimed_by_first = list(claims)  # another test of this module may have extracted these shards already
    second = extract_hidden_states(cfg, dataset, verifier, store, Provenance(config={"run": "claims 2"}), claim=claim)

    assert claimed_by_first == ([0] if first.extracted_shards else [])
    assert second.extracted_shards == 0 and claims == claimed_by_first


def test_a_published_shard_list_with_a_shard_gone_is_not_handed_back_the_shard_is_extracted_again(prepared, tmp_path):
    _, verifier, dataset = prepared
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "a shard goes"})
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=16)
    first = extract_hidden_states(cfg, dataset, verifier, store, provenance)
    shutil.rmtree(store.root / "shards" / first.shards[1]["key"])  # removed by hand, or a disk lost

    again = extract_hidden_states(cfg, dataset, verifier, store, provenance)

    assert again.digest == first.digest and again.extracted_shards == 1
    assert extract_hidden_states(cfg, dataset, verifier, store, provenance) == first  # whole again: the stored manifest handed back


def test_a_published_shard_list_whose_shard_was_extracted_again_is_listed_again(prepared, tmp_path):
    _, verifier, dataset = prepared
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "a shard changes"})
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=16)
    first = extract_hidden_states(cfg, dataset, verifier, store, provenance)
    done = store.root / "shards" / first.shards[1]["key"] / "done.json"
    done.write_text(json.dumps({"sha256": {name: "0" * 64 for name in json.loads(done.read_text())["sha256"]}}))  # other bytes

    again = extract_hidden_states(cfg, dataset, verifier, store, provenance)

    assert again.extracted_shards == 0 and again.digest != first.digest  # the list now names the shard's files as they are


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda done: done.write_bytes(done.read_bytes()[:40]), id="a done.json cut short"),
        pytest.param(
            lambda done: [done.unlink(), *(p.unlink() for p in sorted(done.parent.glob("hs_*"))[:2])], id="a killed gc's leftover"
        ),
    ],
)
def test_a_shard_whose_done_json_does_not_read_is_extracted_again_in_place(prepared, tmp_path, damage):
    _, verifier, dataset = prepared
    store, provenance = ArtifactStore(tmp_path / "store"), Provenance(config={"run": "a damaged shard"})
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=16)
    first = extract_hidden_states(cfg, dataset, verifier, store, provenance)
    damage(store.root / "shards" / first.shards[1]["key"] / "done.json")

    again = extract_hidden_states(cfg, dataset, verifier, store, provenance)
    other_key = extract_hidden_states(cfg, dataset, verifier, store, Provenance(config={"run": "another key"}))

    assert again.extracted_shards == 1 and again.digest == first.digest  # the same bytes, extracted once more
    assert other_key.extracted_shards == 0


def test_verify_shard_names_file_and_field_on_mismatch(prepared, tmp_path):
    store, verifier, dataset = prepared
    manifest = extract_hidden_states(ExtractConfig(aux_layer_ids=AUX), dataset, verifier, store, Provenance())
    data = load_file(hidden_state_files(manifest)[0])
    save_file({"hidden_states": data["hidden_states"], "token_ids": data["token_ids"] + 1}, tmp_path / "hs_0.safetensors")

    with pytest.raises(ArtifactError, match=r"hs_0\.safetensors: field 'token_ids' does not match"):
        verify_shard(tmp_path, [data["token_ids"].tolist()], 4, verifier.hidden_size)


def test_nested_verifier_loads_its_text_decoder(tiny_nested_verifier, tmp_path):
    from conftest import SAMPLE

    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_nested_verifier)), store)
    model = load_text_model(verifier.path, torch.float32, "cpu")
    with safe_open(tiny_nested_verifier / "model.safetensors", "pt") as f:
        [key] = [k for k in f.keys() if k.endswith("layers.1.mlp.up_proj.weight")]  # noqa: SIM118 - safe_open is not iterable
        expected = f.get_tensor(key)
    dataset = prepare_dataset(DatasetConfig(max_records=4), SAMPLE, load_tokenizer(verifier.path), store, Provenance())

    manifest = extract_hidden_states(ExtractConfig(aux_layer_ids=AUX), dataset, verifier, store, Provenance())

    assert verifier.nested and verifier.num_hidden_layers == 4
    assert "language_model" in key
    torch.testing.assert_close(model.get_decoder().layers[1].mlp.up_proj.weight, expected)
    assert load_file(hidden_state_files(manifest)[3])["hidden_states"].shape[1:] == (4, 64)


@pytest.mark.slow
def test_out_of_memory_halves_the_prefill_batch_and_retries_the_shard(prepared, monkeypatch, tmp_path):
    _, verifier, dataset = prepared
    longest = max(load_dataset_table(dataset).column("seq_len").to_pylist())
    direct = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, prefill_batch_tokens=512), dataset, verifier, ArtifactStore(tmp_path / "a"), Provenance()
    )
    monkeypatch.setenv(FAULT_OOM_ENV, "600")

    manifest = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, prefill_batch_tokens=4096), dataset, verifier, ArtifactStore(tmp_path / "b"), Provenance()
    )

    assert [(b.value, b.retry_with) for b in manifest.backoffs] == [(4096, 2048), (2048, 1024), (1024, 512)]
    assert manifest.backoffs[0].setting == "extract.prefill_batch_tokens" and manifest.backoffs[0].at == {"shard": 0}
    assert "simulated out of memory" in manifest.backoffs[0].error
    assert longest <= 512
    assert manifest.digest == direct.digest


@pytest.mark.slow
def test_a_run_killed_after_backing_off_resumes_at_the_prefill_batch_it_reached(prepared, monkeypatch, tmp_path, caplog):
    _, verifier, dataset = prepared
    store = ArtifactStore(tmp_path)
    cfg = ExtractConfig(aux_layer_ids=AUX, prefill_batch_tokens=4096, records_per_shard=8)
    monkeypatch.setenv(FAULT_OOM_ENV, "600")  # above 512 runs out of memory, every time

    class Killed(Exception):
        """Stands for a SIGKILL once the first shard is finished."""

    def kill(done, total):
        raise Killed

    with pytest.raises(Killed):
        extract_hidden_states(cfg, dataset, verifier, store, Provenance(), on_progress=kill)
    caplog.set_level(logging.INFO, logger="eagle3")

    manifest = extract_hidden_states(cfg, dataset, verifier, store, Provenance())

    # The killed run's back-offs, and no new one: the re-run did not try 4096, 2048 and 1024 again
    assert [(b.value, b.retry_with) for b in manifest.backoffs] == [(4096, 2048), (2048, 1024), (1024, 512)]
    assert "resuming at extract.prefill_batch_tokens=512, where this work backed off to before" in caplog.text
    assert (manifest.extracted_shards, manifest.reused_shards) == (2, 1)
    assert sorted(p.name for p in manifest.path.iterdir()) == ["manifest.json", "shards.json"]
    assert not store.work_path("hidden_states-backoffs", Provenance().key).exists()  # published: nothing to resume


def test_out_of_memory_at_the_minimum_fails_saying_what_was_tried(prepared, monkeypatch, tmp_path):
    _, verifier, dataset = prepared
    store = ArtifactStore(tmp_path)
    monkeypatch.setenv(FAULT_OOM_ENV, "8")
    cfg = ExtractConfig(aux_layer_ids=AUX, prefill_batch_tokens=2048, min_prefill_batch_tokens=512)

    with pytest.raises(
        RuntimeError, match=r"shard 0 .*prefill_batch_tokens = \[2048, 1024, 512\]\) down to extract.min_prefill_batch_tokens = 512"
    ):
        extract_hidden_states(cfg, dataset, verifier, store, Provenance(config={"oom": 2}))


def test_non_finite_states_are_refused_naming_file_and_layer_slot(tmp_path):
    states = torch.zeros(2, 5, 4, 8)  # [batch, seq, slots, H]
    states[1, 2, 1, 3] = float("nan")
    writer = OverlappedWriter(torch.device("cpu"))
    rows = [(tmp_path / "hs_6.safetensors", torch.arange(5)), (tmp_path / "hs_7.safetensors", torch.arange(5))]

    writer.submit(states, rows)

    with pytest.raises(ArtifactError, match=r"hs_7\.safetensors: field 'hidden_states': non-finite values per layer slot \[0, 1, 0, 0\]"):
        writer.drain()
    writer.close()
    assert (tmp_path / "hs_6.safetensors").exists() and not (tmp_path / "hs_7.safetensors").exists()


def test_appending_records_extracts_only_the_new_shards(tiny_verifier, tmp_path):
    from conftest import SAMPLE

    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    tokenizer = load_tokenizer(verifier.path)
    lines = SAMPLE.read_text().splitlines(keepends=True)
    data = tmp_path / "growing.jsonl"
    cfg = ExtractConfig(aux_layer_ids=AUX, records_per_shard=8)
    data.write_text("".join(lines[:20]))
    first = extract_hidden_states(
        cfg,
        prepare_dataset(DatasetConfig(), data, tokenizer, store, Provenance(config={"v": 1})),
        verifier,
        store,
        Provenance(config={"v": 1}),
    )
    data.write_text("".join(lines[:36]))

    grown = extract_hidden_states(
        cfg,
        prepare_dataset(DatasetConfig(), data, tokenizer, store, Provenance(config={"v": 2})),
        verifier,
        store,
        Provenance(config={"v": 2}),
    )

    assert (first.extracted_shards, first.reused_shards) == (3, 0)
    # records 0-15 fill shards 0-1 unchanged; shard 2 grew from 4 to 8 records; shards 3-4 are new
    assert (grown.extracted_shards, grown.reused_shards) == (3, 2)
    assert [s["key"] for s in grown.shards[:2]] == [s["key"] for s in first.shards[:2]]
    assert sorted(hidden_state_files(grown)) == list(range(36))


@pytest.mark.parametrize(("bumped", "changes"), [("hidden_states/vllm", {"vllm"}), ("hidden_states", {"transformers"}), ("dataset", set())])
def test_bumping_one_routes_version_keeps_the_other_routes_shards(bumped, changes, monkeypatch):
    """Shards are keyed by the version of the route that computed them: a new version of the
    server route does not re-extract the step's own shards, nor the reverse, and other steps'
    versions touch neither."""
    from eagle3.config import EndpointConfig
    from eagle3.extraction.shards import shard_key
    from eagle3.store import versions
    from eagle3.store.manifests import ArtifactManifest

    verifier = ArtifactManifest(kind="verifier", digest="0" * 64, path=Path("."))
    backends = {"transformers": ExtractConfig(), "vllm": ExtractConfig(backend="vllm", endpoint=EndpointConfig(model="m"))}
    before = {name: shard_key(cfg, verifier, [1, 2, 3], [[5, 6, 7]]) for name, cfg in backends.items()}
    monkeypatch.setitem(versions.STEPS, bumped, versions.StepCode(versions.STEPS[bumped].version + 1, versions.STEPS[bumped].libraries))

    after = {name: shard_key(cfg, verifier, [1, 2, 3], [[5, 6, 7]]) for name, cfg in backends.items()}

    assert {name for name in backends if after[name] != before[name]} == changes
