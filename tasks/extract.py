from __future__ import annotations

from eagle3.config import ExtractConfig, VerifierConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.extraction import extract_hidden_states as step
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.cache import step_task, task_provenance
from tasks.gpu import verifier_claim, without_placement
from tasks.report import Progress, publish_step_report
from tasks.store import run_store


@step_task("extract-hidden-states", without_placement(step.extraction_provenance))
def extract_hidden_states_task(
    store_dir: str, cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest, placement: VerifierConfig | None = None
) -> step.HiddenStatesManifest:
    store = run_store(store_dir)
    provenance = task_provenance(extract_hidden_states_task, store, cfg=cfg, dataset=dataset, verifier=verifier)
    manifest = step.extract_hidden_states(
        cfg,
        dataset,
        verifier,
        store,
        provenance,
        on_progress=Progress("extract hidden states (tokens)"),
        claim=verifier_claim(cfg.device, placement),
        placement=placement,
    )
    publish_step_report(
        manifest,
        manifest.model_dump(
            include={"aux_layer_ids", "num_records", "num_tokens", "extracted_shards", "reused_shards", "backoffs", "gpu_memory_after_mib"}
        ),
    )
    return manifest
