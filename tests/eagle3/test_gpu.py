"""GPU code paths (run on a GPU host, in one process: pytest -m gpu -n 0)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import SAMPLE, write_jsonl
from pydantic import BaseModel
from safetensors.torch import load_file
from tiny_models import tiny_llama

from eagle3.config import DatasetConfig, ExportConfig, ExtractConfig, RegenerateConfig, TrainConfig, VerifierConfig, VocabConfig
from eagle3.data.prepare_dataset import load_dataset_table, prepare_dataset, read_user_turns
from eagle3.data.regenerate import ALLOCATOR_SETTINGS, RegenerateAttempt, _transformers_attempt, expandable_segments_env, regenerate
from eagle3.evaluation.baseline import DecodingModel
from eagle3.evaluation.draft_proposer import Eagle3Proposer, StaticEagle3Proposer, proposer_for
from eagle3.evaluation.evaluate import load_draft
from eagle3.evaluation.forward_choice import forward_for
from eagle3.evaluation.speculative import NgramProposer, greedy_decode, speculative_decode
from eagle3.extraction.extract_hidden_states import ExtractAttempt, ShardWork, _extract_attempt, extract_hidden_states
from eagle3.extraction.shards import hidden_state_files
from eagle3.extraction.storage import decode
from eagle3.runtime.attempts import fixed_devices, run_attempt
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.done_log import read_done
from eagle3.store.manifests import Provenance
from eagle3.training.export import export_checkpoint
from eagle3.training.train import train_draft
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.forward import DynamicForward, StaticForward
from eagle3.verifier.loading import load_text_model, load_tokenizer
from eagle3.verifier.placement import load_placed, meta_model, model_bytes
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.gpu
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def steps(tiny_verifier, tmp_path_factory):
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return store, verifier, dataset


@pytest.mark.parametrize("storage", ["bf16", "fp8"])  # fp8: quantized on the GPU before the copy
def test_gpu_extraction_in_a_child_process_matches_cpu(steps, tmp_path, storage):
    _, verifier, dataset = steps

    # Separate stores: the device is not part of a shard's key, so one store would reuse the shards.
    gpu = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, device="cuda", storage=storage),
        dataset,
        verifier,
        ArtifactStore(tmp_path / "gpu"),
        Provenance(),
        claim=fixed_devices(["0"]),
    )
    cpu = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, device="cpu", storage=storage), dataset, verifier, ArtifactStore(tmp_path / "cpu"), Provenance()
    )

    a, b = hidden_state_files(gpu), hidden_state_files(cpu)
    assert gpu.storage == storage and len(a) == len(b) == dataset.num_records
    tolerance = {"bf16": {"atol": 0.1, "rtol": 0.05}, "fp8": {"atol": 0.2, "rtol": 0.15}}[storage]  # e4m3 keeps 3 mantissa bits
    for i in a:
        torch.testing.assert_close(decode(load_file(a[i]), torch.float32), decode(load_file(b[i]), torch.float32), **tolerance)


def test_gpu_regeneration_runs_in_a_child_process_and_reports_memory(steps, tmp_path):
    store, verifier, _ = steps
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"id": str(i), "prompt": f"Count to {i}."} for i in range(6)])

    manifest = regenerate(
        RegenerateConfig(enabled=True, max_new_tokens=16, batch_size=4, device="cuda"),
        source,
        verifier,
        store,
        Provenance(config={"r": "gpu"}),
        claim=fixed_devices(["0"]),
    )

    assert manifest.num_records + len(manifest.failed) == 6 and manifest.backoffs == []
    assert set(manifest.gpu_memory_after_mib) == {"0"}


class _NoSpec(BaseModel):
    pass


def _segments_expand(spec: _NoSpec, on_progress) -> bool:
    torch.ones(1 << 20, device="cuda")
    return all(segment["is_expandable"] for segment in torch.cuda.memory_snapshot())


@pytest.mark.skipif(any(name in os.environ for name in ALLOCATOR_SETTINGS), reason="the user's allocator setting wins")
def test_a_regeneration_attempt_allocates_in_segments_that_grow_in_place():
    assert run_attempt(_segments_expand, _NoSpec(), ["0"], child_env=expandable_segments_env())
    assert not run_attempt(_segments_expand, _NoSpec(), ["0"])


def test_gpu_training_under_torchrun_with_flex_attention_and_fused_loss_exports_and_decodes(steps, caplog, capfd):
    caplog.set_level(logging.INFO, logger="eagle3.training.train_worker")
    store, verifier, dataset = steps
    hidden = extract_hidden_states(
        ExtractConfig(aux_layer_ids=AUX, device="cuda"),
        dataset,
        verifier,
        store,
        Provenance(config={"d": "cuda"}),
        claim=fixed_devices(["0"]),
    )
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    gpus = [str(i) for i in range(torch.cuda.device_count())]

    # Three layers and two validations: under dynamo's default limit, such a draft stopped compiling in validation on an
    # H200 (eagle3.training.trainer_compat); whether this tiny one reaches the limit too has not been checked.
    cfg = TrainConfig(epochs=2, num_layers=3, total_seq_len=512, device="cuda", num_gpus=len(gpus))
    draft = train_draft(cfg, dataset, hidden, vocab, verifier, store, Provenance(), claim=fixed_devices(gpus))
    checkpoint = export_checkpoint(ExportConfig(), draft, verifier, vocab, hidden, store, Provenance())

    assert draft.num_steps > 0 and draft.tau_sim >= 1.0 and draft.backoffs == []
    # The workers' output goes to train.log: the run's own log shows each validated epoch, stderr a bar of steps.
    validated = [r.getMessage() for r in caplog.records if r.name == "eagle3.training.train_worker"]
    assert [line.split(":")[1] for line in validated] == [" epoch 1 of 2 validated", " epoch 2 of 2 validated"]
    bar = [line for line in capfd.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("train draft")]
    assert any(line.startswith("train draft: 100%") and f" {draft.num_steps}/{draft.num_steps} " in line for line in bar), bar[-5:]
    assert "recompile_limit" not in (draft.path / "train.log").read_text()  # dynamo's warning when a frame stops compiling
    assert set(draft.gpu_memory_after_mib) == set(gpus)
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        assert any((store.root / "compile-cache").rglob("*.py")), "torch.compile's cache is kept with the store"
    model = load_text_model(verifier.path, torch.float32, "cuda")
    capture = HiddenStateCapture(model.get_decoder(), AUX)
    draft_model = load_draft(checkpoint.path, verifier.path, torch.device("cuda")).float()
    prompt = load_dataset_table(dataset).column("input_ids")[0].as_py()[:40]
    forward = forward_for(model, capture, len(prompt) + 32, prompt)
    reference = greedy_decode(forward, prompt, 32, set())
    assert isinstance(forward, StaticForward) and forward.graphs
    graphed = proposer_for(draft_model, forward, len(prompt) + 32 + 5)
    assert isinstance(graphed, StaticEagle3Proposer) and graphed.graphs and graphed.compiled
    forward.record_graphs(6)
    graphed.record_graphs(5)
    recorded = _captured(forward, graphed)
    assert recorded == {
        "passes": set(range(1, 7)),
        "clears": set(range(1, 5)),
        "rounds": {(confirmed, drafted) for confirmed in range(1, 7) for drafted in range(1, 6)},
    }
    for proposer in (Eagle3Proposer(draft_model), graphed):
        for k in (1, 3, 5):
            assert speculative_decode(forward, proposer, prompt, 32, k, set()).tokens == reference.tokens
            assert speculative_decode(forward, NgramProposer(), prompt, 32, k, set()).tokens == reference.tokens
    assert _captured(forward, graphed) == recorded  # the decodes replayed only graphs recorded before them

    # A replayed round drafts what the same round run without a graph drafts, round after round,
    # with its steps compiled or not (compiled against eager steps may round an argmax apart).
    for compiled in (False, True):
        replayed = StaticEagle3Proposer(draft_model, len(prompt) + 40, compiled=compiled)
        direct = StaticEagle3Proposer(draft_model, len(prompt) + 40, graphs=False, compiled=compiled)
        drafted = {}
        for proposer in (replayed, direct):
            with torch.inference_mode():  # as decoding runs: the buffers are inference tensors
                drafted[proposer] = _rounds(forward, proposer, prompt)
        assert drafted[replayed] == drafted[direct], compiled
        assert replayed._rounds.captured, "rounds after the first replay graphs"


def _captured(forward: StaticForward, proposer: StaticEagle3Proposer) -> dict[str, set]:
    """The shapes whose graphs each has captured: the verifier's passes and zeroings, the draft's rounds."""
    return {"passes": set(forward._passes.captured), "clears": set(forward._clears.captured), "rounds": set(proposer._rounds.captured)}


def _rounds(forward, proposer, prompt: list[int]) -> list[list[int]]:
    """The drafts of six rounds of speculative decoding of `prompt` (the verifier's acceptance decides each next round)."""
    forward.reset()
    proposer.reset()
    argmax, aux = forward(prompt)
    proposer.observe(aux)
    context, rounds = [*prompt, int(argmax[-1])], []
    for k in (3, 3, 1, 5, 3, 3):
        rounds.append(proposer.propose(context, k).tolist())
        argmax, aux = forward([context[-1], *rounds[-1]])
        argmax = argmax.tolist()
        accepted = next((i for i, (a, b) in enumerate(zip(rounds[-1], argmax)) if a != b), len(rounds[-1]))
        forward.rollback(len(rounds[-1]) - accepted)
        proposer.observe(aux[: accepted + 1])
        context += [*rounds[-1][:accepted], argmax[accepted]]
    return rounds


def test_cuda_graph_replays_compute_what_eager_passes_compute(tiny_verifier):
    model = load_text_model(tiny_verifier, torch.float32, "cuda")
    capture = HiddenStateCapture(model.get_decoder(), AUX)
    graphed, eager = StaticForward(model, capture, 64), StaticForward(model, capture, 64, graphs=False)
    prompt = [1, 200, 300, 400, 500, 600, 700, 200, 300]

    def passes(forward):
        def read(ids):  # a graphed pass's argmax is its graph's output buffer: read before the next replay
            argmax, aux = forward(ids)
            return argmax.tolist(), aux

        forward.reset()
        out = [read(prompt), read([41, 42, 43, 44])]  # captures the 4-token graph
        forward.rollback(2)
        out.append(read([45, 46, 47, 48]))  # replays it at new positions, over the two forgotten entries
        forward.rollback(3)
        for buffer in (*forward.cache.keys.values(), *forward.cache.values.values()):
            buffer[:, :, forward.length : forward.stale] = float("nan")  # what an overflow in the forgotten tokens would leave
        out += [read([49]), read([50])]  # captures and replays 1, after zeroing the two forgotten entries it leaves
        assert not any(buffer[:, :, forward.length :].any() for buffer in (*forward.cache.keys.values(), *forward.cache.values.values()))
        return out

    with torch.inference_mode():  # as decoding captures
        graphed_passes, eager_passes = passes(graphed), passes(eager)
    for (argmax, aux), (expected_argmax, expected_aux) in zip(graphed_passes, eager_passes, strict=True):
        assert argmax == expected_argmax
        assert torch.equal(aux, expected_aux)
    assert sorted(graphed._passes.captured) == [1, 4] and sorted(graphed._clears.captured) == [2]
    expected = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40, do_sample=False, eos_token_id=None)[
        0, len(prompt) :
    ]
    assert greedy_decode(graphed, prompt, 40, set()).tokens == expected.tolist()
    for k in (1, 3, 5):
        assert speculative_decode(graphed, NgramProposer(), prompt, 40, k, set()).tokens == expected.tolist()
    capture.close()


# MLA and experts (also INT4 ones, dequantized at load); rotary sections
@pytest.mark.parametrize("nested", ["tiny_kimi_verifier", "tiny_kimi_int4_verifier", "tiny_qwen_vl_moe_verifier"])
def test_a_nested_moe_verifier_decodes_on_the_gpu_what_transformers_cache_decodes(nested, request):
    """Whichever forward `forward_for` picks (graph replays, or the dynamic cache where routing
    cannot be captured), greedy and drafted decodes are the verifier's plain greedy output."""
    model = load_text_model(request.getfixturevalue(nested), torch.float32, "cuda")
    prompt = [1, 200, 300, 400, 500, 600, 700, 200, 300]
    expected = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40, do_sample=False, eos_token_id=None)[
        0, len(prompt) :
    ]

    with torch.inference_mode():
        forward = forward_for(model, None, len(prompt) + 48, prompt)
        assert greedy_decode(forward, prompt, 40, set()).tokens == expected.tolist()
        for k in (1, 3):
            assert speculative_decode(forward, NgramProposer(), prompt, 40, k, set()).tokens == expected.tolist()


def _gib_held_by_other_processes() -> float:
    """GPU memory in use beyond this process's allocator cache (its own CUDA context included)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def test_real_cuda_out_of_memory_backs_off_to_a_batch_that_fits(tmp_path):
    """A verifier whose 16k-token prefill needs ~1.6 GB, on a GPU left with ~2.5 GB free by another
    process: the allocator's own out-of-memory error, then smaller batches in fresh processes.
    The GPU must be otherwise idle: memory another process frees after the filler has measured
    what is free would let the prefill fit."""
    if (held := _gib_held_by_other_processes()) > 2:
        pytest.skip(f"needs the GPU to itself: {held:.1f} GiB is held by other processes")
    verifier_dir = tiny_llama(tmp_path / "wide", num_layers=4, hidden=4096)
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(verifier_dir)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    fill = (
        "import sys, time, torch\n"
        "free, _ = torch.cuda.mem_get_info()\n"
        "block = torch.empty(free - int(2.5 * 2**30), dtype=torch.uint8, device='cuda')\n"
        "print('filled', flush=True); time.sleep(900)\n"
    )
    filler = subprocess.Popen([sys.executable, "-c", fill], stdout=subprocess.PIPE, text=True)
    try:
        assert filler.stdout.readline().strip() == "filled"
        cfg = ExtractConfig(aux_layer_ids=AUX, device="cuda", prefill_batch_tokens=16384, min_prefill_batch_tokens=256)
        manifest = extract_hidden_states(cfg, dataset, verifier, store, Provenance(), claim=fixed_devices(["0"]))
    finally:
        filler.kill()
        filler.wait()

    assert manifest.backoffs and all("CUDA out of memory" in b.error for b in manifest.backoffs)
    assert manifest.backoffs[0].value == 16384
    assert len(hidden_state_files(manifest)) == manifest.num_records


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    """A random Llama of 8 layers (hidden 256) and a prepared dataset: small, yet with layers to spread."""
    store = ArtifactStore(tmp_path_factory.mktemp("split-store"))
    verifier = resolve_verifier(
        VerifierConfig(path=str(tiny_llama(tmp_path_factory.mktemp("split") / "v", num_layers=8, hidden=256))), store
    )
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256, max_records=16), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    return verifier, dataset


def _half_on_the_gpu(verifier) -> dict:
    """Budgets that leave about half the verifier's layers to the CPU (accelerate offloads them: their
    weights stream to the GPU, which runs every layer)."""
    size = model_bytes(meta_model(verifier.path, torch.bfloat16))
    return {0: size // 2, "cpu": 4 * size}


def _attempt_states(verifier, dataset, root, max_memory) -> dict[str, torch.Tensor]:
    """The shard files one extraction attempt writes in this process, on the GPU."""
    root.mkdir()
    shard = ShardWork(index=0, key="shard", records=list(range(dataset.num_records)))
    spec = ExtractAttempt(
        dataset=dataset, verifier=verifier, aux=AUX, device="cuda", shard_root=root, todo=[shard], budget=2048, max_memory=max_memory
    )
    assert _extract_attempt(spec, lambda *_: None).oom is None
    return {p.name: load_file(p)["hidden_states"] for p in sorted((root / "shard").glob("hs_*.safetensors"))}


def test_a_verifier_split_between_the_gpu_and_the_cpu_extracts_the_states_of_a_one_gpu_load(eight_layers, tmp_path):
    verifier, dataset = eight_layers
    budgets = _half_on_the_gpu(verifier)
    model = load_placed(verifier.path, torch.bfloat16, "cuda", budgets)
    assert set(model.hf_device_map.values()) == {0, "cpu"}  # really split
    del model

    split = _attempt_states(verifier, dataset, tmp_path / "split", budgets)
    whole = _attempt_states(verifier, dataset, tmp_path / "whole", None)

    assert sorted(split) == sorted(whole) and len(whole) == dataset.num_records
    for name in whole:
        torch.testing.assert_close(split[name], whole[name])


def test_a_verifier_split_between_the_gpu_and_the_cpu_generates_what_a_one_gpu_load_generates(eight_layers, tmp_path):
    verifier, _ = eight_layers
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"id": str(i), "prompt": f"Count to {i}."} for i in range(4)])
    cfg = RegenerateConfig(enabled=True, max_new_tokens=16, batch_size=2)

    def answers(max_memory, log):
        spec = RegenerateAttempt(
            todo=read_user_turns(source, None),
            cfg=cfg,
            verifier=verifier,
            device="cuda",
            batch_size=2,
            done_log=tmp_path / log,
            max_memory=max_memory,
        )
        assert _transformers_attempt(spec, lambda *_: None) is None
        return read_done(tmp_path / log, "record")

    assert answers(_half_on_the_gpu(verifier), "split.jsonl") == answers(None, "whole.jsonl")


def test_two_data_parallel_workers_on_one_gpu_extract_what_one_worker_extracts(eight_layers, tmp_path):
    verifier, dataset = eight_layers
    cfg = ExtractConfig(aux_layer_ids=AUX, device="cuda", records_per_shard=4)
    one = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "one"), Provenance(), claim=fixed_devices(["0"]))

    # Two worker processes on GPU 0: the claim names it twice.
    two = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(tmp_path / "two"), Provenance(), claim=fixed_devices(["0", "0"]))

    assert two.digest == one.digest and two.extracted_shards == 4
    assert set(two.gpu_memory_after_mib) == {"0"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_verifier_split_over_two_gpus_extracts_the_states_of_a_one_gpu_load(eight_layers, tmp_path):
    verifier, dataset = eight_layers
    size = model_bytes(meta_model(verifier.path, torch.bfloat16))

    split = _attempt_states(verifier, dataset, tmp_path / "split", {0: size // 2, 1: size})
    whole = _attempt_states(verifier, dataset, tmp_path / "whole", None)

    for name in whole:
        torch.testing.assert_close(split[name], whole[name])


def test_a_verifier_split_between_the_gpu_and_the_cpu_decodes_greedy_as_a_one_gpu_load(eight_layers):
    """Baselines and evaluation decode in their own process: a spread verifier decodes on transformers'
    dynamic cache (accelerate's hooks cannot be captured in a CUDA graph), to the same tokens."""
    verifier, _ = eight_layers
    prompts = [[1, 200, 300, 400, 500, 600, 700, 200, 300]]
    split = DecodingModel.load(verifier, prompts, "cuda", "float32", _half_on_the_gpu(verifier))
    whole = DecodingModel.load(verifier, prompts, "cuda", "float32")

    with torch.inference_mode():
        split_forward, whole_forward = split.forward(None, 24), whole.forward(None, 24)
        assert isinstance(split_forward, DynamicForward)
        assert greedy_decode(split_forward, prompts[0], 24, set()).tokens == greedy_decode(whole_forward, prompts[0], 24, set()).tokens
