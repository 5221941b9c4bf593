"""The pipeline as one Prefect flow: verifier -> (regenerated answers) -> dataset ->
hidden states (extracted; or, online, computed by training itself) + vocab mapping -> draft -> checkpoint -> evaluation -> promotion. The verifier's
baselines on the eval prompts (plain greedy and n-gram decoding) do not depend on the draft: they
are measured first, once per verifier and prompts. A draft trained elsewhere (`draft_path`) takes
the place of every step from the answers to the checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from prefect import flow
from pydantic import BaseModel

from eagle3.config import PipelineConfig
from eagle3.data.prepare_dataset import dataset_source
from eagle3.data.regenerate import regenerated_conversations
from eagle3.evaluation.evaluate import EvalManifest, eval_prompts_source
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.plan import check_verifier_fits
from eagle3.preflight import check_preflight
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.gc import store_in_use
from eagle3.store.lineage import RunLineage
from eagle3.store.manifests import ArtifactManifest
from eagle3.store.promotions import PromotionRecord
from eagle3.training.export import ExportManifest
from eagle3.training.train import DraftManifest
from eagle3.verifier.resolve_verifier import VerifierManifest, verifier_source
from tasks.baseline import measure_baselines_task
from tasks.evaluate import evaluate_task
from tasks.export import export_checkpoint_task, given_draft_task
from tasks.extract import extract_hidden_states_task
from tasks.lineage import publish_lineage_task
from tasks.prepare import prepare_dataset_task
from tasks.promote import promote_task
from tasks.regenerate import regenerate_task
from tasks.train import online_states_task, previous_draft_task, train_draft_task
from tasks.verifier import resolve_verifier_task
from tasks.vocab import build_vocab_mapping_task


class PipelineResult(BaseModel):
    """What a run published; `checkpoint`, `evaluation` and `promotion` are None where it stopped
    before them (`config.stop_after`)."""

    lineage: RunLineage
    stopped_after: str | None = None
    draft: DraftManifest | None = None
    checkpoint: ExportManifest | None = None
    evaluation: EvalManifest | None = None
    promotion: PromotionRecord | None = None


@flow(name="train-eagle3-draft", persist_result=False)  # its result is the steps' manifests, stored by them as JSON
def train_eagle3_draft(config: PipelineConfig = PipelineConfig()) -> PipelineResult:  # noqa: B008 (the UI form shows the default)
    """Train an EAGLE-3 draft for a verifier on a conversation dataset (or take one trained elsewhere,
    `draft_path`), measure its acceptance length and promote it if it beats the best earlier one;
    every step but promotion is cached by content."""
    store = config.store_dir
    check_preflight(config)  # bad paths and files, a full or read-only store, a pinned-off trust_remote_code
    check_verifier_fits(config)  # a verifier too large for its claimed GPUs fails here, before any load
    with store_in_use(ArtifactStore(store)):  # `eagle3 artifacts gc` refuses to run meanwhile
        verifier = resolve_verifier_task(store, config.verifier, verifier_source(config.verifier))
        prompts, baselines = eval_prompts_source(config.evaluate), None
        if config.evaluate.backend == "transformers" and config.stop_after is None:  # first: they need no draft
            baselines = measure_baselines_task(store, config.evaluate, verifier, prompts, config.verifier)
        if config.draft_path is None:
            trained = _train(config, verifier)
            if isinstance(trained, PipelineResult):  # stop_after ended the run
                return trained
            produced, draft, checkpoint = trained
        else:
            checkpoint = given_draft_task(store, Path(config.draft_path).expanduser(), config.export, verifier)
            produced, draft = [verifier, checkpoint], None
        evaluation = evaluate_task(store, config.evaluate, checkpoint, verifier, prompts, baselines, config.verifier)
        promotion = promote_task(store, config.promotion, evaluation)
        lineage = publish_lineage_task(store, [m for m in [*produced, baselines, evaluation] if m is not None], config)
    return PipelineResult(lineage=lineage, draft=draft, checkpoint=checkpoint, evaluation=evaluation, promotion=promotion)


class _Trained(NamedTuple):
    produced: Sequence[ArtifactManifest]  # every artifact of the training steps, for the lineage
    draft: DraftManifest
    checkpoint: ExportManifest


def _train(config: PipelineConfig, verifier: VerifierManifest) -> _Trained | PipelineResult:
    """The steps from the training data to the exported checkpoint; the run's result where
    `stop_after` ends it among them."""
    store = config.store_dir

    def stopped(step: str, *produced: ArtifactManifest | None, **result) -> PipelineResult:
        lineage = publish_lineage_task(store, [m for m in produced if m is not None], config)
        return PipelineResult(lineage=lineage, stopped_after=step, **result)

    source, regenerated = dataset_source(config.dataset), None
    if config.regenerate.enabled:
        regenerated = regenerate_task(store, config.regenerate, source, verifier, config.verifier)
        source = regenerated_conversations(regenerated)
    dataset = prepare_dataset_task(store, config.dataset, source, verifier)
    if config.stop_after == "dataset":
        return stopped("dataset", verifier, regenerated, dataset)
    hidden_states: HiddenStatesManifest
    if config.train.hidden_states == "online":  # computed while the draft trains: none stored
        hidden_states = online_states_task(store, config.extract, dataset, verifier)
    else:
        hidden_states = extract_hidden_states_task(store, config.extract, dataset, verifier, config.verifier)
    if config.stop_after == "hidden_states":
        return stopped("hidden_states", verifier, regenerated, dataset, hidden_states)
    vocab = build_vocab_mapping_task(store, config.vocab, dataset, verifier)
    init = None
    if config.train.init_from == "previous":
        init = previous_draft_task(store, config.train, verifier, hidden_states, dataset)
    draft = train_draft_task(store, config.train, dataset, hidden_states, vocab, verifier, init)
    checkpoint = export_checkpoint_task(store, config.export, draft, verifier, vocab, hidden_states)
    produced = [m for m in (verifier, regenerated, dataset, hidden_states, vocab, draft, checkpoint) if m is not None]
    if config.stop_after == "checkpoint":
        return stopped("checkpoint", *produced, draft=draft, checkpoint=checkpoint)
    return _Trained(produced, draft, checkpoint)
