from __future__ import annotations

from functools import partial

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from eagle3.config import ExtractConfig, TrainConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.extraction.shards import HiddenStatesManifest
from eagle3.runtime.library_logs import forward_speculators_logs
from eagle3.store.artifacts import ArtifactStore
from eagle3.training import online
from eagle3.training import train as step
from eagle3.training.vocab_mapping import VocabManifest
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.gpu import claim_gpus
from tasks.report import Progress, publish_image, publish_step_report
from tasks.store import run_store


@step_task("online-hidden-states", online.online_states_provenance)
def online_states_task(
    store_dir: str, cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest
) -> online.OnlineStatesManifest:
    """`train.hidden_states=online`: what training computes the states from, in place of extracting them."""
    store = run_store(store_dir)
    provenance = task_provenance(online_states_task, store, cfg=cfg, dataset=dataset, verifier=verifier)
    manifest = online.online_states(cfg, dataset, verifier, store, provenance)
    publish_step_report(manifest, manifest.model_dump(include={"aux_layer_ids", "num_records", "num_tokens", "storage"}))
    return manifest


@step_task("train-draft", step.training_provenance)
def train_draft_task(
    store_dir: str,
    cfg: TrainConfig,
    dataset: DatasetManifest,
    hidden_states: HiddenStatesManifest,
    vocab: VocabManifest,
    verifier: VerifierManifest,
    init: step.DraftManifest | None = None,
) -> step.DraftManifest:
    forward_speculators_logs()  # the draft's speculators code logs into the run's log
    store = run_store(store_dir)
    provenance = task_provenance(
        train_draft_task, store, cfg=cfg, dataset=dataset, hidden_states=hidden_states, vocab=vocab, verifier=verifier, init=init
    )
    manifest = step.train_draft(
        cfg,
        dataset,
        hidden_states,
        vocab,
        verifier,
        store,
        provenance,
        on_step=Progress("train draft (steps)"),
        claim=partial(claim_gpus, cfg.device, cfg.num_gpus),
        init=init,
    )
    publish_step_report(
        manifest,
        manifest.model_dump(include={"num_steps", "tau_sim", "tokens_per_s", "time_breakdown_s", "backoffs", "gpu_memory_after_mib"}),
    )
    publish_image("training-curves", manifest.path / manifest.curves, "training curves: loss and acceptance per TTT step")
    return manifest


@task(name="find-previous-draft", cache_policy=NO_CACHE, persist_result=False)  # nothing pickled: docs/security.md
def previous_draft_task(
    store_dir: str, cfg: TrainConfig, verifier: VerifierManifest, hidden_states: HiddenStatesManifest, dataset: DatasetManifest
) -> step.DraftManifest | None:
    """The draft `train.init_from=previous` continues from, looked up afresh on every run; its
    digest is part of the training step's cache key."""
    draft = step.previous_draft(ArtifactStore(store_dir), cfg, verifier, hidden_states, dataset)
    if draft is None:
        get_run_logger().warning(
            "train.init_from=previous: the store holds no draft for this verifier, aux layers, num_layers "
            "and fc_norm trained on another dataset; training from scratch"
        )
    else:
        get_run_logger().info(
            "continuing from draft %s (dataset %s, finished %s, tau_sim %.3f)",
            draft.digest[:12],
            draft.parents["dataset"][:12],
            draft.finished_at,
            draft.tau_sim,
        )
    return draft
