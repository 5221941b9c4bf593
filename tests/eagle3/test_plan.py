"""`eagle3 plan` from real verifiers' config.json files (tests/fixtures/configs): sizes, GPUs per step,
routes, hidden-state bytes against the store's disk, time estimates from measured throughput, and the
flow's refusal of a verifier that cannot fit its claimed GPUs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import SAMPLE, write_jsonl

from eagle3.cli import main
from eagle3.config import ConfigError, DatasetConfig, ExtractConfig, RegenerateConfig, VerifierConfig, load_config
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.data.regenerate import regenerate, regenerate_provenance
from eagle3.extraction.extract_hidden_states import extract_hidden_states, extraction_provenance
from eagle3.plan import _duration, _size, check_verifier_fits, make_plan
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # meta-device models of real verifiers' configs, and a flow

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
KIMI = CONFIGS / "kimi-k2.5"
LLAMA_8B = CONFIGS / "llama-3.1-8b-instruct"
ON_8_H200 = ["verifier.num_gpus=8", "verifier.gpu_memory_gib=139.8"]
SERVED = ["extract.backend=vllm", "extract.endpoint.model=kimi", "evaluate.backend=vllm", "evaluate.endpoint.model=kimi"]


@pytest.fixture
def needs_kimi():
    pytest.importorskip("transformers.models.kimi_k25", reason="this transformers has no Kimi-K2.5 model")


def plan_of(tmp_path, verifier: Path, *overrides: str, costs: bool = True):
    return make_plan(load_config(None, [f"verifier.path={verifier}", f"store_dir={tmp_path / 'store'}", *overrides]), costs)


def test_kimi_k25_counts_its_int4_experts_as_stored_for_vllm_and_as_bfloat16_for_transformers(tmp_path, needs_kimi):
    plan = plan_of(tmp_path, KIMI, *ON_8_H200, costs=False)

    assert plan.num_parameters == 1_026_879_353_328
    assert round(plan.bytes_bf16 / 1e9, 1) == 2053.8
    assert (plan.bytes_stored, plan.stored_from) == (595_148_192_736, "model.safetensors.index.json")
    assert plan.quantization == "compressed-tensors, pack-quantized, int4"
    assert (plan.gpus_needed_bf16, plan.gpus_needed_as_stored) == (21, 5)
    assert plan.hidden_state_bytes_per_token == 4 * 7168 * 2


def test_kimi_k25_extracting_in_the_step_on_8_h200s_does_not_fit(tmp_path, needs_kimi):
    plan = plan_of(tmp_path, KIMI, *ON_8_H200, costs=False)

    extract = next(step for step in plan.steps if step.step == "extract")
    assert not plan.fits and not extract.fits
    assert extract.how == "needs 21 GPU(s), 8 claimed (verifier.num_gpus)"


def test_kimi_k25_fits_8_h200s_when_its_steps_run_on_vllm_servers(tmp_path, needs_kimi):
    plan = plan_of(tmp_path, KIMI, *ON_8_H200, *SERVED, costs=False)

    assert plan.fits
    routes = {step.step: step.route for step in plan.steps}
    assert routes["extract"].startswith("vLLM server") and routes["evaluate"].startswith("vLLM server")


def test_kimi_k25_in_a_vllm_engine_is_checked_against_each_rank_s_share_of_the_weights(tmp_path, needs_kimi):
    engine = ["extract.backend=vllm-engine", "extract.device=cuda", "verifier.gpu_memory_gib=139.8"]
    one = plan_of(tmp_path, KIMI, *engine, costs=False)
    eight = plan_of(tmp_path, KIMI, *engine, "verifier.num_gpus=8", "extract.engine.tensor_parallel_size=8", costs=False)
    unclaimed = plan_of(tmp_path, KIMI, *engine, "extract.engine.tensor_parallel_size=8", costs=False)

    extract = [next(step for step in plan.steps if step.step == "extract") for plan in (one, eight, unclaimed)]
    assert not extract[0].fits and extract[0].how.startswith("the weights take 441% of the engine's")
    assert extract[1].fits and extract[1].how.startswith("the weights take 55%")  # 74.4 GB a rank of 0.9 x 139.8 GiB
    assert not extract[2].fits and extract[2].how == "needs 8 GPU(s), 1 claimed (verifier.num_gpus)"
    with pytest.raises(ConfigError, match=r"extract \(the weights take 441%"):
        check_verifier_fits(load_config(None, [f"verifier.path={KIMI}", f"store_dir={tmp_path / 'store'}", *engine]))


def test_the_fullest_pipeline_stage_must_fit_with_room_for_the_kv_cache(tmp_path, needs_kimi):
    h100 = ["extract.backend=vllm-engine", "extract.device=cuda", "verifier.gpu_memory_gib=79.6", "verifier.num_gpus=8"]
    tensor = plan_of(tmp_path, KIMI, *h100, "extract.engine.tensor_parallel_size=8", costs=False)
    stages = plan_of(tmp_path, KIMI, *h100, "extract.engine.pipeline_parallel_size=8", costs=False)

    [tensor_step, stages_step] = [next(step for step in plan.steps if step.step == "extract") for plan in (tensor, stages)]
    assert not tensor_step.fits and "the weights take 97%" in tensor_step.how  # 69.3 GiB of vLLM's 71.6: no room for a KV cache
    assert not stages_step.fits and "the weights take 101%" in stages_step.how  # 8 of 61 layers: 72.7 GiB, not the average 7.6


def test_without_a_gpu_the_plan_gives_the_gpus_needed_on_h100s_and_h200s(tmp_path, needs_kimi):
    plan = plan_of(tmp_path, KIMI, costs=False)

    assert plan.gpu_memory_bytes is None
    assert plan.reference == {"H100 80GB": (31, 8), "H200 141GB": (21, 5)}


def test_llama_8b_on_two_gpus_regenerates_and_extracts_data_parallel_and_evaluates_on_one(tmp_path):
    plan = plan_of(tmp_path, LLAMA_8B, "verifier.num_gpus=2", "verifier.gpu_memory_gib=79.2", "regenerate.enabled=true", costs=False)

    how = {step.step: step.how for step in plan.steps}
    assert how["regenerate"] == how["extract"] == "data parallel: a replica on each of 2 GPUs"
    assert how["evaluate"] == "on one GPU"  # it claims one
    assert plan.num_parameters == 8_030_261_248 and plan.gpus_needed_bf16 == 1


def test_the_dataset_s_hidden_states_are_sized_against_the_store_s_free_disk(tmp_path):
    plan = plan_of(tmp_path, LLAMA_8B, "dataset.max_records=10")

    assert plan.dataset_records == 10 and plan.dataset_tokens > 0
    assert plan.tokens_from == "estimated at 4 characters a token: no tokenizer here"
    assert 0 < plan.store_free_bytes <= shutil.disk_usage(tmp_path).total
    text = plan.render()
    assert f"{plan.dataset_tokens * 32_768 / 1e6:,.1f} MB" in text and "free: fits" in text
    assert plan.fits
    full = plan.model_copy(update={"store_free_bytes": plan.states_bytes - 1})
    assert not full.fits and "free: DOES NOT FIT" in full.render()  # `eagle3 plan` exits 1


def test_a_given_draft_s_plan_has_only_the_evaluation_and_no_dataset_or_states(tmp_path):
    plan = plan_of(tmp_path, LLAMA_8B, f"draft_path={tmp_path / 'exported-elsewhere'}", f"dataset.path={tmp_path / 'none.jsonl'}")

    assert [step.step for step in plan.steps] == ["evaluate"]
    assert plan.dataset_tokens is None and plan.states_bytes is None and plan.fits
    assert "evaluate" in plan.render()


def test_a_measured_extraction_in_the_store_gives_the_extraction_time(tiny_verifier, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)  # memoises the verifier's digest
    dataset = prepare_dataset(
        DatasetConfig(max_seq_len=128, max_records=8),
        SAMPLE,
        load_tokenizer(verifier.path),
        store,
        Provenance(),
    )
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3])
    hidden = extract_hidden_states(cfg, dataset, verifier, store, extraction_provenance(store, cfg, dataset, verifier))

    plan = plan_of(tmp_path, tiny_verifier, "dataset.max_seq_len=128", "dataset.max_records=8")

    rate = hidden.num_tokens / hidden.seconds
    assert plan.tokens_from == "tokenized"
    assert plan.estimates == [f"extract     {_duration(plan.dataset_tokens / rate)} at {rate:,.0f} tok/s (artifact {hidden.digest[:12]})"]


def test_the_regeneration_rate_counts_the_records_generated_not_those_reused(tiny_verifier, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    cfg = RegenerateConfig(enabled=True, max_new_tokens=8)
    first = write_jsonl(tmp_path / "first.jsonl", [{"id": f"p{i}", "prompt": f"Say {i}."} for i in range(3)])
    grown = write_jsonl(tmp_path / "grown.jsonl", [*map(json.loads, first.read_text().splitlines()), {"id": "p3", "prompt": "Say 3."}])
    regenerate(cfg, first, verifier, store, regenerate_provenance(store, cfg, first, verifier))
    latest = regenerate(cfg, grown, verifier, store, regenerate_provenance(store, cfg, grown, verifier))

    plan = plan_of(tmp_path, tiny_verifier, f"dataset.path={grown}", "regenerate.enabled=true", "regenerate.max_new_tokens=8")

    rate = 1 / latest.seconds  # one record generated, three reused
    assert latest.reused_records == 3
    assert f"regenerate  {_duration(4 / rate)} at {rate:,.2f} records/s (artifact {latest.digest[:12]})" in plan.estimates


def test_the_regeneration_rate_counts_the_records_this_run_generated_not_those_a_killed_run_left(tiny_verifier, tmp_path):
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    cfg = RegenerateConfig(enabled=True, max_new_tokens=8, batch_size=2)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"Say {i}."} for i in range(4)])
    provenance = regenerate_provenance(store, cfg, prompts, verifier)

    class Killed(Exception):
        """Stands for a SIGKILL once the first batch is finished."""

    def kill(done, total):
        raise Killed

    with pytest.raises(Killed):
        regenerate(cfg, prompts, verifier, store, provenance, on_progress=kill)
    resumed = regenerate(cfg, prompts, verifier, store, provenance)

    plan = plan_of(tmp_path, tiny_verifier, f"dataset.path={prompts}", "regenerate.enabled=true", "regenerate.max_new_tokens=8")

    rate = 2 / resumed.seconds  # the killed run's 2 records took none of this run's seconds
    assert (resumed.num_records, resumed.resumed_records, resumed.reused_records) == (4, 2, 0)
    assert f"regenerate  {_duration(4 / rate)} at {rate:,.2f} records/s (artifact {resumed.digest[:12]})" in plan.estimates


def test_a_gguf_verifier_s_estimates_come_from_the_steps_run_on_its_converted_directory(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    verifier = resolve_verifier(VerifierConfig(), store)  # the bundled SmolLM2 GGUF, converted once
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"Say {i}."} for i in range(2)])
    regenerated = regenerate(cfg, prompts, verifier, store, regenerate_provenance(store, cfg, prompts, verifier))

    plan = make_plan(
        load_config(
            None, [f"store_dir={tmp_path / 'store'}", f"dataset.path={prompts}", "regenerate.enabled=true", "regenerate.max_new_tokens=4"]
        )
    )

    assert verifier.digest != verifier.parents["source"]  # the steps' parent is the conversion, not the file
    rate = 2 / regenerated.seconds
    assert plan.estimates == [f"regenerate  {_duration(2 / rate)} at {rate:,.2f} records/s (artifact {regenerated.digest[:12]})"]
    converted = make_plan(
        load_config(
            None, [f"verifier.path={verifier.path}", f"dataset.path={prompts}", "regenerate.enabled=true", "regenerate.max_new_tokens=4"]
        ),
        costs=True,
    )
    assert plan.tokens_from.startswith("tokenized") and plan.dataset_tokens == converted.dataset_tokens  # the GGUF header's tokenizer


def test_a_run_whose_verifier_cannot_fit_its_gpus_fails_before_loading_with_the_plan(tmp_path, needs_kimi):
    config = load_config(
        None,
        [
            f"verifier.path={KIMI}",
            f"store_dir={tmp_path / 'store'}",
            *ON_8_H200,
            "extract.device=cuda",
            "evaluate.backend=vllm",
            "evaluate.endpoint.model=kimi",
        ],
    )

    with pytest.raises(
        ConfigError, match=r"(?s)does not fit the GPUs its steps claim: extract \(needs 21 GPU\(s\), 8 claimed.*hidden states"
    ):
        check_verifier_fits(config)


def test_a_staged_run_is_checked_only_for_the_steps_it_reaches(tmp_path, needs_kimi):
    """Extraction and evaluation in the step do not fit 8 H200s; a run that stops after the dataset
    does neither, one that stops after the hidden states extracts."""
    staged = [f"verifier.path={KIMI}", f"store_dir={tmp_path / 'store'}", *ON_8_H200, "extract.device=cuda", "evaluate.device=cuda"]

    check_verifier_fits(load_config(None, [*staged, "stop_after=dataset"]))
    with pytest.raises(ConfigError, match=r"its steps claim: extract \(needs 21 GPU") as refused:
        check_verifier_fits(load_config(None, [*staged, "stop_after=hidden_states"]))
    assert "evaluate (needs" not in str(refused.value)  # not reached
    with pytest.raises(ConfigError, match=r"its steps claim: extract \(needs 21 GPU.*evaluate \(needs"):
        check_verifier_fits(load_config(None, staged))


def test_the_flow_checks_the_fit_before_its_first_step(tmp_path, needs_kimi):
    """The verifier directory holds only config.json: any step would fail on it, so the error is the check's."""
    from flows.train_draft import train_eagle3_draft

    config = load_config(None, [f"verifier.path={KIMI}", f"store_dir={tmp_path / 'store'}", *ON_8_H200, "extract.device=cuda"])

    with pytest.raises(ConfigError, match=r"does not fit the GPUs its steps claim"):
        train_eagle3_draft.fn(config)


def test_a_run_on_servers_only_is_not_checked_against_gpus(tmp_path, needs_kimi):
    config = load_config(None, [f"verifier.path={KIMI}", f"store_dir={tmp_path / 'store'}", *ON_8_H200, *SERVED])

    check_verifier_fits(config)


def test_eagle3_plan_prints_the_plan_and_exits_1_when_a_step_does_not_fit(tmp_path, capsys, needs_kimi):
    code = main(["plan", f"verifier.path={KIMI}", f"store_dir={tmp_path / 'store'}", *ON_8_H200])

    out = capsys.readouterr().out
    assert code == 1
    assert "595.1 GB (554.3 GiB) (model.safetensors.index.json)" in out and "DOES NOT FIT: needs 21 GPU(s), 8 claimed" in out


def test_eagle3_plan_names_a_missing_or_damaged_gguf_and_exits_2_not_1(tmp_path, capsys):
    damaged = tmp_path / "verifier.gguf"
    damaged.write_bytes(b"GGML" + bytes(60))

    codes = [main(["plan", f"verifier.path={path}", f"store_dir={tmp_path / 'store'}"]) for path in (tmp_path / "typo.gguf", damaged)]

    err = capsys.readouterr().err
    assert codes == [2, 2]  # 1 says "does not fit"
    assert f"{tmp_path / 'typo.gguf'}: verifier.path does not exist" in err
    assert f"{damaged}: not a GGUF file: it starts with b'GGML', not b'GGUF'" in err


def test_the_shipped_kimi_recipe_fits_8_h200s_with_half_the_bytes_in_fp8(tmp_path, needs_kimi):
    recipe = Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.5-one-host.yaml"
    config = load_config(recipe, [f"verifier.path={KIMI}", "verifier.gpu_memory_gib=139.8", f"store_dir={tmp_path / 'store'}"])

    plan = make_plan(config, costs=False)

    assert plan.fits
    assert plan.hidden_state_bytes_per_token == 4 * 7168 + 4  # e4m3 values and one float32 scale a token
    assert "28,676 B a token (4 slots x 7168 x 1 B + a 4 B scale, fp8)" in plan.render()


def test_online_training_plans_no_hidden_state_bytes(tmp_path):
    plan = plan_of(tmp_path, LLAMA_8B, "train.hidden_states=online", "verifier.gpu_memory_gib=80", costs=False)

    assert "none stored (train.hidden_states=online)" in plan.render()
    assert "  dataset     " not in plan.render()


def test_online_training_plans_the_verifier_in_training_not_in_extraction(tmp_path):
    plan = plan_of(tmp_path, LLAMA_8B, "train.hidden_states=online", "verifier.gpu_memory_gib=80", costs=False)

    steps = {step.step: step for step in plan.steps}
    assert steps["extract"].route == "none: training computes the states (train.hidden_states=online)"
    assert not steps["extract"].on_gpus
    assert steps["train"].on_gpus and steps["train"].gpus_needed == 1
    assert steps["train"].how.startswith("the verifier takes 16.1 GB (15.0 GiB) of one GPU's")
    assert steps["train"].how.endswith("the draft trains in the rest (its memory not estimated here; it is not checked)")
    assert "the verifier is not loaded" not in plan.render()


def test_online_training_refuses_a_verifier_that_one_gpu_cannot_hold(tmp_path):
    overrides = ["train.hidden_states=online", "verifier.num_gpus=4", "verifier.gpu_memory_gib=10"]
    config = load_config(None, [f"verifier.path={LLAMA_8B}", f"store_dir={tmp_path / 'store'}", *overrides])

    train = next(step for step in make_plan(config, costs=False).steps if step.step == "train")
    assert not train.fits and train.gpus_needed == 2
    with pytest.raises(ConfigError, match=r"train \(the verifier needs 2 GPU\(s\) and online training holds it on one"):
        check_verifier_fits(config)
    check_verifier_fits(config.model_copy(update={"stop_after": "hidden_states"}))  # a run that stops before training


def test_the_plan_names_the_store_the_run_would_use(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))

    plan = make_plan(load_config(None, [f"verifier.path={LLAMA_8B}", "dataset.max_records=10"]))

    assert plan.store_dir == str(tmp_path / "data" / "eagle3-pipeline" / "store")  # the default, where this host keeps it
    assert f"store       {plan.store_dir}: " in plan.render()


def test_small_sizes_and_short_times_read_in_units_that_show_them():
    assert _size(34_000_000) == "34.0 MB (32.4 MiB)"  # the demo's hidden states: "0.0 GB" said nothing
    assert _size(16.1e9) == "16.1 GB (15.0 GiB)"
    assert [_duration(s) for s in (12.4, 59.6, 90, 3599, 5400)] == ["12 s", "1.0 min", "1.5 min", "1.0 h", "1.5 h"]
    assert _size(999_960_000) == "1.0 GB (0.9 GiB)"
