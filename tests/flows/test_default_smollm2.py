"""The README's first command, in-process: the embedded default with the real SmolLM2-135M verifier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import free_port
from fingerprints import check_pinned, fingerprint_tree

from eagle3.cli import DEMO_DRAFT_NOTE, main
from eagle3.config import VerifierConfig
from eagle3.data.prepare_dataset import SAMPLE_CONVERSATIONS
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.promotions import read_promotions
from eagle3.verifier import resolve_verifier as verifier_module

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _manifests(store: Path) -> dict[str, dict]:
    out = {}
    for path in (store / "artifacts").glob("*/manifest.json"):
        manifest = json.loads(path.read_text())
        out[manifest["kind"]] = manifest
    return out


@pytest.mark.timeout(1800)  # the README's first command at full size: about 5 minutes on 2 cores
def test_default_run_trains_a_loadable_smollm2_draft(prefect_server, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"

    assert main(["run", f"store_dir={store}"]) == 0

    printed = capsys.readouterr().out
    manifests = _manifests(store)
    checkpoint = Path(manifests["checkpoint"]["path"])
    assert f"checkpoint: {checkpoint}" in printed
    kept = manifests["checkpoint"]["selected_epoch"]
    assert kept == manifests["draft"]["selected_epoch"] and manifests["checkpoint"]["epochs"] == 3
    assert f"(tau_sim) on the validation split: {manifests['checkpoint']['tau_sim']:.3f}, epoch {kept + 1} of 3 (the best)" in printed
    curves = Path(manifests["draft"]["path"]) / "training_curves.png"
    assert f"training curves (loss and acceptance by epoch): {curves}" in printed and curves.is_file()
    verifier = manifests["verifier"]
    assert (verifier["num_hidden_layers"], verifier["hidden_size"], verifier["vocab_size"]) == (30, 576, 49152)
    check_pinned("verifier", fingerprint_tree(Path(verifier["path"]), tmp_path))  # the GGUF file's dequantized directory
    dataset = manifests["dataset"]
    assert dataset["num_records"] == 32 and dataset["dropped"] == {}
    assert 0 < dataset["num_supervised_tokens"] < dataset["num_tokens"]
    assert manifests["hidden_states"]["aux_layer_ids"] == [2, 15, 27]
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["transformer_layer_config"]["vocab_size"] == 49152
    assert manifests["checkpoint"]["tau_sim"] > 1.0
    evaluation = manifests["evaluation"]
    assert evaluation["mismatches"] == 0
    assert {(r["method"], r["k"]) for r in evaluation["results"]} == {("eagle3", 3), ("eagle3", 5), ("ngram", 3), ("ngram", 5)}
    assert all(r["tau"] >= 1.0 for r in evaluation["results"])
    assert "eagle3 k=3: tau" in printed
    greedy, draft = evaluation["greedy_tokens_per_s"], next(r for r in evaluation["results"] if (r["method"], r["k"]) == ("eagle3", 3))
    assert f"{draft['tokens_per_s']:.1f} tok/s, {draft['tokens_per_s'] / greedy:.2f}x plain greedy" in printed
    assert f"plain greedy: {greedy:.1f} tok/s (batch 1, {evaluation['measured_on']}, decoded beside the draft)" in printed
    ngram = next(r for r in evaluation["results"] if (r["method"], r["k"]) == ("ngram", 3))
    assert f"{ngram['tokens_per_s']:.1f} tok/s, {ngram['speed_up']:.2f}x plain greedy" in printed
    assert f"over its baselines' plain greedy, {ngram['greedy_tokens_per_s']:.1f} tok/s ({evaluation['baselines_measured_on']})" in printed
    assert f"per token as in validation: {evaluation['draft_token_accuracy']:.3f}" in printed
    assert f"(accuracy's ceiling): {evaluation['draft_vocab_coverage']:.3f}" in printed
    [replay] = (store / "runs").glob("*.yaml")
    assert f"replay: eagle3 run --config {replay}" in printed
    [decision] = read_promotions(ArtifactStore(store))
    assert decision.summary() in printed
    assert decision.promoted == decision.beats_ngram  # the first on its eval set: only n-gram lookup can hold it back
    assert (DEMO_DRAFT_NOTE in printed) == (decision.beats_ngram is False)  # a demo draft that loses says it was expected to
    assert (f"serve it: vllm serve {checkpoint}" in printed) == decision.promoted  # and offers no serve line

    own = tmp_path / "own.jsonl"  # the sample's records as a user's own file: every step is cached, by content
    shutil.copy(SAMPLE_CONVERSATIONS, own)
    assert main(["run", f"store_dir={store}", f"dataset.path={own}"]) == 0
    printed = capsys.readouterr().out
    assert f"checkpoint: {checkpoint}" in printed and "eagle3 k=3: tau" in printed
    assert DEMO_DRAFT_NOTE not in printed  # a user's own data gets no demo's excuse

    def convert_again(gguf: Path, out: Path) -> None:
        raise AssertionError(f"{gguf} was dequantized again")

    monkeypatch.setattr(verifier_module, "_convert_gguf", convert_again)
    again = verifier_module.resolve_verifier(VerifierConfig(), ArtifactStore(store))  # the library, outside the flow's cache
    assert (again.digest, str(again.path)) == (verifier["digest"], verifier["path"])


def test_bad_input_exits_2_naming_file_record_and_field(prefect_server, tiny_verifier, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}\n'
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )

    code = main(
        [
            "run",
            f"store_dir={tmp_path / 'store'}",
            f"verifier.path={tiny_verifier}",
            f"dataset.path={data}",
            "extract.aux_layer_ids=[1,2,3]",
        ]
    )

    assert code == 2
    assert "chats.jsonl: record 0 (id '0'): field 'messages[1].role': unknown role 'bot'" in capsys.readouterr().err


def test_an_unreachable_server_exits_2_with_one_line_naming_it(prefect_server, tiny_verifier, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"

    code = main(
        [
            "run",
            f"store_dir={tmp_path / 'store'}",
            f"verifier.path={tiny_verifier}",
            "extract.aux_layer_ids=[1,2,3]",
            "regenerate.enabled=true",
            "regenerate.backend=openai",
            "regenerate.endpoint.model=verifier",
            f"regenerate.endpoint.base_url={url}",
            "regenerate.endpoint.max_retries=0",
            "evaluate.num_prompts=1",
            "evaluate.max_new_tokens=4",
        ]
    )

    assert code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eagle3: ")]
    assert url in line


def test_unknown_config_key_exits_2_before_running(capsys):
    assert main(["run", "train.learning_rate=1"]) == 2
    assert "train.learning_rate" in capsys.readouterr().err
