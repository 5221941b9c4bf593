"""The pipeline as one Prefect flow: verifier -> dataset -> hidden states + vocab -> draft -> checkpoint."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.export import ExportManifest
from eagle3.prepare_dataset import dataset_source
from eagle3.verifier import verifier_source
from tasks.export import export_checkpoint_task
from tasks.extract import extract_hidden_states_task
from tasks.prepare import prepare_dataset_task
from tasks.train import train_draft_task
from tasks.verifier import resolve_verifier_task
from tasks.vocab import build_vocab_mapping_task


@flow(name="train-eagle3-draft")
def train_eagle3_draft(config: PipelineConfig = PipelineConfig()) -> ExportManifest:
    """Train an EAGLE-3 draft for a verifier on a conversation dataset; every step is cached by content."""
    store = config.store_dir
    verifier = resolve_verifier_task(store, config.verifier, verifier_source(config.verifier))
    dataset = prepare_dataset_task(store, config.dataset, dataset_source(config.dataset), verifier)
    hidden_states = extract_hidden_states_task(store, config.extract, dataset, verifier)
    vocab = build_vocab_mapping_task(store, config.vocab, dataset, verifier)
    draft = train_draft_task(store, config.train, dataset, hidden_states, vocab, verifier)
    return export_checkpoint_task(store, config.export, draft, verifier, vocab, hidden_states)
