from __future__ import annotations

import pytest

from eagle3.config import (
    ConfigError,
    DatasetConfig,
    EndpointConfig,
    EvalConfig,
    ExtractConfig,
    PipelineConfig,
    RegenerateConfig,
    TrainConfig,
    VerifierConfig,
    field_docs,
    load_config,
    output_affecting,
)


def test_overrides_layer_over_yaml_over_defaults(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  lr: 0.01\n  epochs: 5\n")

    config = load_config(path, ["train.lr=0.002", "extract.aux_layer_ids=[1, 2, 3]"])

    assert config.train.lr == 0.002
    assert config.train.epochs == 5
    assert config.extract.aux_layer_ids == [1, 2, 3]
    assert config.vocab == PipelineConfig().vocab


def test_all_problems_are_reported_at_once_with_their_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.lr=-1", "train.epochs=0", "trian.lr=1"])

    assert "train.lr" in str(err.value) and "train.epochs" in str(err.value) and "trian" in str(err.value)


def test_unreadable_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: [unclosed\n")

    with pytest.raises(ConfigError, match=r"--config '.*bad\.yaml' is not a readable YAML file"):
        load_config(path)


def test_each_invalid_value_is_blamed_on_the_file_or_the_override_that_set_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lrx: 0.001\n  lr: 0.001\n")

    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.epochs=0", "evaluate.typo=1"])

    assert str(err.value) == (
        "overrides: train.epochs: Input should be greater than or equal to 1; evaluate.typo: Extra inputs are not permitted; "
        f"--config '{path}': train.lrx: Extra inputs are not permitted"
    )


def test_num_gpus_is_keyed_only_where_training_runs_on_cuda():
    """It sets the global batch under torchrun; CPU training ignores it, so changing it must not retrain."""
    on_cpu = [output_affecting(TrainConfig(device="cpu", num_gpus=n)) for n in (1, 4)]
    on_cuda = [output_affecting(TrainConfig(device="cuda", num_gpus=n)) for n in (1, 4)]

    assert on_cpu[0] == on_cpu[1] and "num_gpus" not in on_cpu[0]
    assert on_cuda[0]["num_gpus"] == 1 and on_cuda[1]["num_gpus"] == 4


def test_batch_and_device_knobs_are_not_output_affecting():
    fields = output_affecting(ExtractConfig(aux_layer_ids=[1, 2, 3]))

    assert fields == {"aux_layer_ids": [1, 2, 3], "records_per_shard": 256, "backend": "transformers"}


def test_aux_layer_ids_must_be_three_distinct_in_layer_order():
    with pytest.raises(ConfigError, match="exactly 3 distinct"):
        load_config(None, ["extract.aux_layer_ids=[1, 1, 2]"])
    with pytest.raises(ConfigError, match=r"ascending order, as vLLM hands them to the draft: \[1, 2, 3\], not \[3, 1, 2\]"):
        load_config(None, ["extract.aux_layer_ids=[3, 1, 2]"])


def test_promotion_k_must_be_an_evaluated_k():
    with pytest.raises(ConfigError, match=r"promotion.k=7 is not among evaluate.ks \[3, 5\]"):
        load_config(None, ["promotion.k=7"])


def test_a_given_draft_and_a_stop_before_evaluation_contradict_each_other():
    with pytest.raises(
        ConfigError, match=r"stop_after=checkpoint ends the run before evaluation, and draft_path skips every step before it"
    ):
        load_config(None, ["draft_path=./exported-elsewhere", "stop_after=checkpoint"])


def test_promotion_k_of_a_vllm_evaluation_is_the_servers_not_one_of_evaluate_ks():
    config = load_config(None, ["evaluate.backend=vllm", "evaluate.endpoint.model=verifier", "promotion.k=4"])

    assert config.promotion.k == 4


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.device=gpu", "train.device"),
        ("extract.device=cuda:1", "extract.device"),
        ("evaluate.ks=[3, 0]", "evaluate.ks.1"),
        ("promotion.k=0", "promotion.k"),
    ],
)
def test_a_device_or_draft_length_no_step_can_use_fails_at_load_not_at_its_step(override, field):
    with pytest.raises(ConfigError, match=rf"overrides: {field}: "):
        load_config(None, [override])


def test_file_locations_are_not_keyed_the_files_content_is():
    """Steps key the verifier, dataset and prompts by content (`step_provenance` digests the file),
    so moving a file or naming it by another path re-runs nothing."""
    assert output_affecting(VerifierConfig(path="/models/a")) == output_affecting(VerifierConfig(path="/mnt/b"))
    assert output_affecting(DatasetConfig(path="a.jsonl")) == output_affecting(DatasetConfig(path="/data/b.jsonl"))
    assert output_affecting(EvalConfig(prompts_path="a.jsonl")) == output_affecting(EvalConfig())


def test_settings_only_the_other_backend_reads_are_not_keyed():
    served = EndpointConfig(model="verifier")
    local_eval = [output_affecting(EvalConfig(endpoint=EndpointConfig(model=m))) for m in (None, "verifier")]
    vllm_eval = [
        output_affecting(EvalConfig(backend="vllm", endpoint=served, ks=ks, dtype=d)) for ks, d in (([3], "float32"), ([5], "bfloat16"))
    ]
    local_regen = [output_affecting(RegenerateConfig(endpoint=EndpointConfig(model=m))) for m in (None, "verifier")]
    local_extract = [output_affecting(ExtractConfig(endpoint=EndpointConfig(model=m))) for m in (None, "verifier")]
    vllm_extract = [
        output_affecting(ExtractConfig(backend="vllm", endpoint=served, device=d, prefill_batch_tokens=b))
        for d, b in (("cpu", 64), ("cuda", 8192))
    ]

    assert local_eval[0] == local_eval[1] and "endpoint" not in local_eval[0]
    assert vllm_eval[0] == vllm_eval[1] and vllm_eval[0]["endpoint"] == {"model": "verifier"}
    assert local_regen[0] == local_regen[1] and "endpoint" not in local_regen[0]
    assert local_extract[0] == local_extract[1] and "endpoint" not in local_extract[0]
    assert vllm_extract[0] == vllm_extract[1] and vllm_extract[0]["endpoint"] == {"model": "verifier"}
    assert output_affecting(EvalConfig(ks=[3])) != output_affecting(EvalConfig(ks=[5]))


def test_where_the_server_is_stays_out_of_the_key_but_what_it_serves_does_not():
    def key(**endpoint):
        return output_affecting(RegenerateConfig(backend="openai", endpoint=EndpointConfig(**{"model": "verifier", **endpoint})))

    assert key() == key(base_url="http://gpu-host:9000/v1", concurrency=64, timeout_s=5, max_retries=0, api_key_env="KEY")
    assert key() != key(model="verifier-v2")
    assert key()["endpoint"] == {"model": "verifier"}


@pytest.mark.parametrize(("group", "backend"), [("regenerate", "openai"), ("extract", "vllm")])
def test_more_servers_are_used_with_their_credentials_but_shown_and_stored_without_and_not_keyed(group, backend):
    url = "http://user:s3cret-pw@host-b:8000/v1"
    served = [f"{group}.backend={backend}", f"{group}.endpoint.model=verifier"]

    config = load_config(None, [*served, f"{group}.more_base_urls=[{url}]"])

    step = getattr(config, group)
    assert [e.base_url for e in step.endpoints()] == ["http://localhost:8000/v1", url]  # what the clients are given
    shown = [repr(config), str(config.model_dump(mode="json")), str(config.model_dump()), str(field_docs(config))]
    assert all("s3cret-pw" not in text and "http://***@host-b:8000/v1" in text for text in shown)
    assert output_affecting(step) == output_affecting(getattr(load_config(None, served), group))


def test_a_server_backend_without_a_served_model_name_is_a_config_error():
    with pytest.raises(ConfigError, match=r"regenerate.endpoint.model is required when regenerate.backend is 'openai'"):
        load_config(None, ["regenerate.backend=openai"])
    with pytest.raises(ConfigError, match=r"extract.endpoint.model is required when extract.backend is 'vllm'"):
        load_config(None, ["extract.backend=vllm"])


def test_an_override_value_that_is_not_yaml_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'train.lr=\[1': the value is not YAML"):
        load_config(None, ["train.lr=[1"])


def test_the_default_store_is_the_data_directory_of_the_user_the_run_runs_as(tmp_path, monkeypatch):
    from eagle3.config import store_path

    default = PipelineConfig().store_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert store_path(default) == tmp_path / "home" / ".local" / "share" / "eagle3-pipeline" / "store"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert store_path(default) == tmp_path / "data" / "eagle3-pipeline" / "store"
    assert store_path("~/elsewhere") == tmp_path / "home" / "elsewhere"  # a store_dir set by hand is taken as written
