from __future__ import annotations

import pytest

from eagle3.config import ConfigError, ExtractConfig, PipelineConfig, load_config, output_affecting


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


def test_batch_and_device_knobs_are_not_output_affecting():
    fields = output_affecting(ExtractConfig(aux_layer_ids=[1, 2, 3]))

    assert fields == {"aux_layer_ids": [1, 2, 3], "records_per_shard": 256}


def test_aux_layer_ids_must_be_three_distinct():
    with pytest.raises(ConfigError, match="exactly 3 distinct"):
        load_config(None, ["extract.aux_layer_ids=[1, 1, 2]"])


def test_promotion_k_must_be_an_evaluated_k():
    with pytest.raises(ConfigError, match=r"promotion.k=7 is not among evaluate.ks \[3, 5\]"):
        load_config(None, ["promotion.k=7"])
