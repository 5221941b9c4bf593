"""Every in-process step's output on a tiny verifier, against the output pinned for its version.

Cache keys hold each step's version (`eagle3.store.versions`), not its source: these tests are what keeps
that honest. A change that alters a step's output fails here until the step's version is bumped
(and its new output pinned with `EAGLE3_REPIN=1`), so a cached artifact is never reused for code
that would now compute something else. The server routes' outputs are the server's; the GGUF
conversion is pinned by the SmolLM2 end-to-end test (tests/flows/test_default_smollm2.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SAMPLE, write_jsonl
from fingerprints import check_pinned, fingerprint_tree

from eagle3.config import DatasetConfig, EvalConfig, ExportConfig, ExtractConfig, RegenerateConfig, TrainConfig, VerifierConfig, VocabConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.data.regenerate import regenerate, regenerated_conversations
from eagle3.evaluation.baseline import measure_baselines
from eagle3.evaluation.evaluate import evaluate
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.training.export import export_checkpoint
from eagle3.training.train import train_draft
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outputs(tiny_verifier, tmp_path_factory) -> tuple[Path, dict]:
    """Each in-process step run once, in pipeline order, on 12 conversations the verifier answers."""
    root = tmp_path_factory.mktemp("pinned-steps")
    store = ArtifactStore(root / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    source = root / "conversations.jsonl"
    source.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:12]))
    regenerated = regenerate(RegenerateConfig(enabled=True, max_new_tokens=8, batch_size=4), source, verifier, store, Provenance())
    dataset = prepare_dataset(
        DatasetConfig(max_seq_len=256), regenerated_conversations(regenerated), load_tokenizer(verifier.path), store, Provenance()
    )
    hidden = extract_hidden_states(ExtractConfig(aux_layer_ids=[1, 2, 3], records_per_shard=8), dataset, verifier, store, Provenance())
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=256), dataset, verifier.vocab_size, store, Provenance())
    draft = train_draft(
        TrainConfig(epochs=1, total_seq_len=256, train_data_ratio=0.75), dataset, hidden, vocab, verifier, store, Provenance()
    )
    checkpoint = export_checkpoint(ExportConfig(), draft, verifier, vocab, hidden, store, Provenance())
    cfg = EvalConfig(num_prompts=2, max_new_tokens=8, ks=[2], device="cpu")
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": "What is 2 + 3?"}, {"prompt": "Count to five."}])
    baselines = measure_baselines(cfg, verifier, prompts, store, Provenance())
    evaluation = evaluate(cfg, checkpoint, verifier, prompts, store, Provenance(), baselines)
    manifests = {m.kind: m for m in (regenerated, dataset, hidden, vocab, draft, checkpoint, baselines, evaluation)}
    return tmp_path_factory.getbasetemp(), manifests


@pytest.mark.parametrize("step", ["regenerated", "dataset", "vocab_mapping", "draft", "checkpoint", "baseline", "evaluation"])
def test_a_steps_output_is_the_one_pinned_for_its_version(outputs, step):
    root, manifests = outputs

    check_pinned(step, fingerprint_tree(manifests[step].path, root))


def test_hidden_states_are_the_ones_pinned_for_the_extraction_version(outputs):
    root, manifests = outputs
    hidden = manifests["hidden_states"]
    shard_root = Path(hidden.path).parents[1] / "shards"
    output = {
        "listing": fingerprint_tree(hidden.path, root),
        "shards": [fingerprint_tree(shard_root / shard["key"], root) for shard in hidden.shards],
    }

    check_pinned("hidden_states", output)
