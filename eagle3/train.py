"""Train the draft with speculators' own model, data loader and Trainer.

Inputs: prepared dataset, hidden states, vocab mapping and verifier directory. speculators reads a
`datasets.save_to_disk` directory beside `hidden_states/hs_{i}.safetensors`; this step builds
that layout in its work dir (the hidden-state files are linked, not copied), then runs
`Eagle3DraftModel` under speculators' `Trainer` with test-time training (`ttt_steps`), a checkpoint
per epoch (resumed after a crash, optimizer included) and per-step `loss_k`/`full_acc_k`/`cond_acc_k`.

Output: `checkpoint/` (the last epoch's `config.json` + `model.safetensors`, as speculators saves
them), `metrics.jsonl` (one line per step and per validation epoch) and `training_curves.png`
(loss and per-TTT-step acceptance by epoch, drawn from `metrics.jsonl`). The simulated acceptance
length is `1 + sum_j prod_{i<=j} cond_acc_i` over the TTT steps, from validation accuracies.
Cost on CPU: ~1.3 s per 512-token step for a SmolLM2-135M verifier.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from eagle3 import trainer_compat
from eagle3.config import TrainConfig
from eagle3.extract_hidden_states import HiddenStatesManifest, hidden_state_files, resolve_device
from eagle3.prepare_dataset import DatasetManifest, load_dataset_table
from eagle3.store import ArtifactError, ArtifactManifest, ArtifactStore, Provenance, Stopwatch
from eagle3.training_curves import render_training_curves
from eagle3.verifier import VerifierManifest
from eagle3.vocab_mapping import VocabManifest, load_vocab_mapping

__all__ = ["DraftManifest", "simulated_acceptance_length", "train_draft"]


class DraftManifest(ArtifactManifest):
    kind: str = "draft"
    epochs: list[dict[str, float]]
    num_steps: int
    tau_sim: float
    checkpoint: str = "checkpoint"
    curves: str = "training_curves.png"


def simulated_acceptance_length(cond_acc: list[float]) -> float:
    """Expected tokens per verifier pass for a chain draft: 1 + sum_j prod_{i<=j} cond_acc_i."""
    return 1.0 + sum(math.prod(cond_acc[: j + 1]) for j in range(len(cond_acc)))


def _speculators_data_dir(root: Path, dataset: DatasetManifest, hidden_states: HiddenStatesManifest) -> Path:
    """speculators' training layout: `save_to_disk` records + `hidden_states/hs_{i}` links."""
    from datasets import Dataset

    data_dir = root / "data"
    if data_dir.exists():
        shutil.rmtree(data_dir)
    table = load_dataset_table(dataset).select(["input_ids", "loss_mask", "seq_len"])
    Dataset(table).with_format("torch").save_to_disk(str(data_dir))
    links = data_dir / "hidden_states"
    links.mkdir()
    files = hidden_state_files(hidden_states)
    if len(files) != table.num_rows:
        raise ArtifactError(hidden_states.path, f"{len(files)} hidden-state files for {table.num_rows} records")
    for index, path in files.items():
        os.symlink(path, links / f"hs_{index}.safetensors")
    return data_dir


@contextmanager
def _collect_metrics(log: Path, on_record) -> Iterator[None]:
    """Append each dict speculators' Trainer logs to `speculators.metrics` (one per step and per
    validation epoch) to `log`, which outlives a crash, and pass it to `on_record`."""
    logger = logging.getLogger("speculators.metrics")

    class _Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict):
                # Wall-clock profiles would make two identical trainings' artifacts differ.
                entry = {k: v for k, v in record.msg.items() if k != "profile"}
                with open(log, "a") as f:
                    f.write(json.dumps(entry, default=float) + "\n")
                on_record(entry)

    handler = _Sink()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _epoch_summaries(records: list[dict], ttt_steps: int) -> list[dict[str, float]]:
    """Validation numbers per epoch (the last report wins where a resume repeated an epoch)."""
    summaries: dict[int, dict[str, float]] = {}
    for record in records:
        if "val" not in record:
            continue
        val = record["val"]
        cond = [val[f"cond_acc_{k}_epoch"] for k in range(ttt_steps)]
        summary = {"epoch": record["epoch"], "val_loss": val["loss_epoch"], "tau_sim": simulated_acceptance_length(cond)}
        summary.update({f"full_acc_{k}": val[f"full_acc_{k}_epoch"] for k in range(ttt_steps)})
        summary.update({f"cond_acc_{k}": c for k, c in enumerate(cond)})
        summaries[record["epoch"]] = summary
    return [summaries[e] for e in sorted(summaries)]


def train_draft(
    cfg: TrainConfig,
    dataset: DatasetManifest,
    hidden_states: HiddenStatesManifest,
    vocab: VocabManifest,
    verifier: VerifierManifest,
    store: ArtifactStore,
    provenance: Provenance,
    on_step=None,
) -> DraftManifest:
    """Train an EAGLE-3 draft; resumes from the last epoch checkpoint of an interrupted run.

    `on_step(step, total, metrics)` is called after every optimizer step (for progress reports).
    """
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.trainer import TrainerConfig
    from speculators.train.utils import resolve_mask_token_id
    from hs_connectors import FileTransfer

    clock = Stopwatch()
    device = resolve_device(cfg.device)
    work = store.work_dir("draft", provenance.key)
    data_dir = _speculators_data_dir(work, dataset, hidden_states)
    verifier_path = str(verifier.path)
    flat = SpeculatorsTrainConfig.from_flat(
        {
            "verifier_name_or_path": verifier_path,
            "data_path": str(data_dir),
            "save_path": str(work / "checkpoints"),
            "target_layer_ids": hidden_states.aux_layer_ids,
            "draft_vocab_size": vocab.draft_vocab_size,
            "num_layers": cfg.num_layers,
            "full_attention_indices": list(range(cfg.num_layers)),
            "draft_attn_impl": trainer_compat.draft_attn_impl(device),
            "loss_fn": cfg.loss_fn,
            "loss_implementation": trainer_compat.loss_implementation(device),
            "ttt_steps": cfg.ttt_steps,
            "ttt_step_loss_decay": cfg.ttt_step_loss_decay,
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "epochs": cfg.epochs,
            "total_seq_len": cfg.total_seq_len,
            "train_data_ratio": cfg.train_data_ratio,
            "seed": cfg.seed,
            "on_missing": "raise",
            "num_workers": 0 if device.type == "cpu" else 4,
        }
    ).flatten()

    _seed(cfg.seed)
    install_partial_neox_rotary()
    d2t, t2d = load_vocab_mapping(vocab)
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier_path,
        num_layers=cfg.num_layers,
        draft_arch=flat["draft_arch"],
        hidden_act=flat["draft_hidden_act"],
        sliding_window=flat["sliding_window"],
        full_attention_indices=flat["full_attention_indices"],
        mrope_full_head_hack=False,
    )
    flat["mask_token_id"] = resolve_mask_token_id(verifier_path, layer_config.vocab_size, None)
    model = Eagle3DraftModel.from_training_args(verifier_config=layer_config, t2d=t2d, d2t=d2t, **flat)

    train_loader, val_loader = create_train_val_loaders(
        data_path=str(data_dir),
        total_seq_len=cfg.total_seq_len,
        hidden_states_dtype=torch.bfloat16,
        transfer=FileTransfer(data_dir / "hidden_states"),
        vllm_endpoint=flat["vllm_endpoint"],
        on_missing="raise",
        verifier_name_or_path=verifier_path,
        request_timeout=flat["request_timeout"],
        max_retries=flat["max_retries"],
        generation_validation_retries=flat["generation_validation_retries"],
        max_consecutive_generation_failures=flat["max_consecutive_generation_failures"],
        hidden_size=hidden_states.hidden_size,
        num_target_layers=len(hidden_states.aux_layer_ids),
        num_workers=flat["num_workers"],
        prefetch_factor=flat["prefetch_factor"],
        preprocess=shift_batch,
        train_data_ratio=cfg.train_data_ratio,
        seed=cfg.seed,
    )
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(**flat)
    trainer_config = TrainerConfig(
        num_epochs=cfg.epochs,
        save_path=flat["save_path"],
        lr=cfg.lr,
        resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        optimizer=cfg.optimizer,
        weight_decay=flat["weight_decay"],
        muon_lr=flat["muon_lr"],
        scheduler_type=flat["scheduler_type"],
        hidden_states_dtype=torch.bfloat16,
        log_freq=1,
        checkpoint_freq=1,
    )
    total_steps = cfg.epochs * len(train_loader)
    metrics_log = work / "metrics.jsonl"

    def on_record(record: dict) -> None:
        if on_step is not None and "train" in record:
            on_step(record["global_step"] + 1, total_steps, record["train"])

    with trainer_compat.trainer_class(device) as trainer_cls, _collect_metrics(metrics_log, on_record):
        trainer_cls(model, trainer_config, train_loader, val_loader).run_training()

    last_epoch = max(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    history = [json.loads(line) for line in metrics_log.read_text().splitlines()]
    epochs = _epoch_summaries(history, cfg.ttt_steps)
    out = work / "artifact"
    if out.exists():
        shutil.rmtree(out)
    (out / "checkpoint").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(work / "checkpoints" / str(last_epoch) / name, out / "checkpoint" / name)
    shutil.copy2(metrics_log, out / "metrics.jsonl")
    render_training_curves(metrics_log, out / "training_curves.png", cfg.ttt_steps)
    manifest = store.publish(
        out,
        DraftManifest(
            **provenance.model_dump(),
            path=out,
            epochs=epochs,
            num_steps=sum(1 for r in history if "train" in r),
            tau_sim=epochs[-1]["tau_sim"],
            seconds=clock(),
        ),
    )
    shutil.rmtree(work)
    return manifest

