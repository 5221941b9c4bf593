"""Every step task's cache key, and the hidden-state shard keys, pinned for fixed inputs.

Keys follow what a step computes (`eagle3.store.versions`), never how its source is spelled or where it
lives: these pins were written before the library was split into stage packages and still hold
after it. A key that moves here moves for every user's store (at scale: terabytes re-extracted),
so a change to these pins must be a deliberate version bump, or a dependency upgrade. Re-pin with
`EAGLE3_REPIN=1 pytest tests/tasks/test_cache_keys.py` and say in the commit which keys moved and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from eagle3.config import (
    DatasetConfig,
    EndpointConfig,
    EngineConfig,
    EvalConfig,
    ExportConfig,
    ExtractConfig,
    RegenerateConfig,
    TrainConfig,
    VerifierConfig,
    VocabConfig,
)
from eagle3.extraction.shards import shard_key
from eagle3.extraction.vllm_engine import ENGINE_ROUTE
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import ArtifactManifest
from eagle3.store.versions import STEPS, engine_versions

PINS = Path(__file__).resolve().parents[1] / "pinned" / "cache_keys.json"
ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = sorted({package for code in STEPS.values() for package in code.libraries})
# vLLM's engine in this checkout's .venv-vllm (./setup-vllm.sh), named: the relocated copy below has none beside it
ENGINE = ExtractConfig(backend="vllm-engine", engine=EngineConfig(python=str(ROOT / ".venv-vllm" / "bin" / "python")))


def installed_libraries() -> dict[str, str]:
    """The releases the pinned keys were computed with: this environment's, and the vLLM environment's
    (marked), where the engine route's states are computed."""
    engine = engine_versions(ENGINE_ROUTE, ENGINE.engine.python)
    return {package: version(package) for package in LIBRARIES} | {f"{dist} (vLLM environment)": v for dist, v in engine.items()}


def current_keys(root: Path) -> dict[str, str]:
    """The key each task's cache policy computes, and two shard keys, for fixed inputs under `root`."""
    from tasks.baseline import measure_baselines_task
    from tasks.evaluate import evaluate_task
    from tasks.export import export_checkpoint_task, given_draft_task
    from tasks.extract import extract_hidden_states_task
    from tasks.prepare import prepare_dataset_task
    from tasks.regenerate import regenerate_task
    from tasks.train import online_states_task, train_draft_task
    from tasks.verifier import resolve_verifier_task
    from tasks.vocab import build_vocab_mapping_task

    store = ArtifactStore(root / "store")
    source = root / "input.jsonl"
    source.write_text('{"prompt": "a fixed input"}\n')
    served = EndpointConfig(model="served-verifier")
    given = root / "given-draft"  # a draft exported elsewhere: a directory keyed by what it holds
    given.mkdir()
    (given / "config.json").write_text('{"speculators_model_type": "eagle3"}\n')

    def artifact(kind: str, n: int) -> ArtifactManifest:
        return ArtifactManifest(kind=kind, digest=f"{n:064x}", path=root)

    verifier, dataset, hidden, vocab, draft, checkpoint, baselines, online = (
        artifact(kind, n)
        for n, kind in enumerate(
            ["verifier", "dataset", "hidden_states", "vocab_mapping", "draft", "checkpoint", "baseline", "online_states"]
        )
    )
    cpu_eval = EvalConfig(device="cpu")
    cases = {
        "verifier": (resolve_verifier_task, {"cfg": VerifierConfig(), "source": source}),
        "regenerated": (regenerate_task, {"cfg": RegenerateConfig(), "source": source, "verifier": verifier}),
        "regenerated/openai": (
            regenerate_task,
            {"cfg": RegenerateConfig(backend="openai", endpoint=served), "source": source, "verifier": verifier},
        ),
        "dataset": (prepare_dataset_task, {"cfg": DatasetConfig(), "source": source, "verifier": verifier}),
        "hidden_states": (extract_hidden_states_task, {"cfg": ExtractConfig(), "dataset": dataset, "verifier": verifier}),
        "hidden_states/vllm": (
            extract_hidden_states_task,
            {"cfg": ExtractConfig(backend="vllm", endpoint=served), "dataset": dataset, "verifier": verifier},
        ),
        "hidden_states/vllm-engine": (extract_hidden_states_task, {"cfg": ENGINE, "dataset": dataset, "verifier": verifier}),
        "hidden_states/online": (online_states_task, {"cfg": ExtractConfig(), "dataset": dataset, "verifier": verifier}),
        "vocab_mapping": (build_vocab_mapping_task, {"cfg": VocabConfig(), "dataset": dataset, "verifier": verifier}),
        "draft": (
            train_draft_task,
            {
                "cfg": TrainConfig(device="cpu"),
                "dataset": dataset,
                "hidden_states": hidden,
                "vocab": vocab,
                "verifier": verifier,
                "init": None,
            },
        ),
        "draft/online": (
            train_draft_task,
            {
                "cfg": TrainConfig(device="cpu"),
                "dataset": dataset,
                "hidden_states": online,
                "vocab": vocab,
                "verifier": verifier,
                "init": None,
            },
        ),
        "checkpoint": (
            export_checkpoint_task,
            {"cfg": ExportConfig(), "draft": draft, "verifier": verifier, "vocab": vocab, "hidden_states": hidden},
        ),
        "checkpoint/given": (given_draft_task, {"draft": given, "cfg": ExportConfig(), "verifier": verifier}),
        "baseline": (measure_baselines_task, {"cfg": cpu_eval, "verifier": verifier, "prompts": source}),
        "evaluation": (
            evaluate_task,
            {
                "cfg": cpu_eval,
                "checkpoint": checkpoint,
                "verifier": verifier,
                "prompts": source,
                "baselines": baselines,
            },
        ),
        "evaluation/vllm": (
            evaluate_task,
            {
                "cfg": EvalConfig(backend="vllm", endpoint=served),
                "checkpoint": checkpoint,
                "verifier": verifier,
                "prompts": source,
                "baselines": None,
            },
        ),
    }
    keys = {name: task.cache_policy.provenance(store, **inputs).key for name, (task, inputs) in cases.items()}
    shard_routes = {
        "shard": ExtractConfig(),
        "shard/vllm": ExtractConfig(backend="vllm", endpoint=served),
        "shard/vllm-engine": ENGINE,
        "shard/fp8": ExtractConfig(storage="fp8"),
    }
    for name, cfg in shard_routes.items():
        keys[name] = shard_key(cfg, verifier, [1, 2, 3], [[1, 2, 3], [4, 5]])
    return keys


def test_every_step_and_route_has_a_pinned_key():
    assert set(json.loads(PINS.read_text())["keys"]) == {*STEPS, "shard", "shard/vllm", "shard/vllm-engine", "shard/fp8"}


def test_cache_keys_are_those_pinned(tmp_path):
    libraries = installed_libraries()
    keys = current_keys(tmp_path)
    if os.environ.get("EAGLE3_REPIN"):
        PINS.write_text(json.dumps({"libraries": libraries, "keys": keys}, indent=2) + "\n")
    pinned = json.loads(PINS.read_text())

    assert libraries == pinned["libraries"], (
        "the installed libraries differ from those the keys were pinned with: the keys of the steps they compute move "
        "(as they should on an upgrade). Re-pin with EAGLE3_REPIN=1 and say so in the commit."
    )
    moved = sorted(name for name in keys if keys[name] != pinned["keys"].get(name))
    assert not moved, (
        f"cache keys moved: {moved}. Only a change in what a step computes may move its key (bump it in eagle3/store/versions.py); "
        "then re-pin with EAGLE3_REPIN=1."
    )


@pytest.mark.slow
def test_editing_and_relocating_the_source_keeps_every_key(tmp_path):
    """Keys read no source file: a copy of the code in another directory, with every module's text
    edited, computes the same keys."""
    import shutil

    copy = tmp_path / "relocated"
    for package in ("eagle3", "tasks", "flows"):
        shutil.copytree(ROOT / package, copy / package)
    for module in copy.rglob("*.py"):
        module.write_text(module.read_text() + "\n# edited: a comment changes no key\n")
    script = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "import eagle3; assert eagle3.__file__.startswith(sys.argv[1]), eagle3.__file__; "
        "from test_cache_keys import current_keys; print(json.dumps(current_keys(Path(sys.argv[2]))))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(Path(__file__).parent)])}
    done = subprocess.run(
        [sys.executable, "-c", script, str(copy), str(tmp_path / "inputs")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    (tmp_path / "here").mkdir()
    assert json.loads(done.stdout.splitlines()[-1]) == current_keys(tmp_path / "here")
