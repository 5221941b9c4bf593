"""The commented example configs in configs/ load, and `eagle3 config` documents every setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.cli import main
from eagle3.config import PipelineConfig, field_docs, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_the_example_configs_ship():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "llama-8b-one-gpu.yaml", "kimi-k2.5-one-host.yaml", "kimi-k2.5-several-hosts.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_shipped_config_loads_and_opens_with_what_it_runs_and_how_to_launch_it(path):
    text = path.read_text()

    config = load_config(path)  # raises on any key PipelineConfig does not have

    header = [line for line in text.splitlines() if line.startswith("#")]
    assert text.startswith("# ") and any(f"eagle3 run --config configs/{path.name}" in line for line in header)
    if path.name == "default.yaml":  # it restates the defaults, so it must stay equal to them
        assert config == PipelineConfig()
    else:
        assert config.model_dump(exclude_defaults=True)


def test_every_setting_is_listed_with_its_description_and_what_the_cache_key_makes_of_it(capsys):
    assert main(["config", "train.lr=1e-4"]) == 0
    printed = capsys.readouterr().out

    docs = field_docs(PipelineConfig())
    assert all(f"\n{doc.name} = " in f"\n{printed}" for doc in docs)
    assert all(doc.description for doc in docs)
    assert "train.lr = 0.0001   (default: 0.001)" in printed
    assert printed.count("[not in the cache key]") == sum(doc.cache_key == "no" for doc in docs)


def test_a_bad_override_of_eagle3_config_exits_2_naming_it(capsys):
    assert main(["config", "train.learning_rate=1"]) == 2
    assert "train.learning_rate" in capsys.readouterr().err
