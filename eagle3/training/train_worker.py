"""One training attempt: speculators' `Eagle3DraftModel`, data loaders and `Trainer` on a prepared
data directory. Runs in the flow's process on CPU, and as `torchrun -m eagle3.training.train_worker
spec.json` on GPUs (one process per GPU, DDP or FSDP), so each attempt gets fresh CUDA contexts.

A rank that runs out of memory writes `oom-rank<r>.json` beside the checkpoints and exits with
`OOM_EXIT`; the launcher relaunches with a smaller batch from the last epoch checkpoint.
Samples' states come from the shard files, bf16 or FP8, or (`train.hidden_states=online`) from
the verifier, run in this process as the trainer asks for each batch. The
launcher prepares each attempt's resume (`eagle3.training.resume`); an attempt validates first the
epoch checkpoint whose validation a kill cut short (`TrainSpec.validate_epoch`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from eagle3.config import TrainConfig
from eagle3.runtime.devices import compute_dtype
from eagle3.runtime.faults import FAULT_OOM_ENV, simulate_oom_above
from eagle3.store.files import atomic_write_text
from eagle3.training import trainer_compat
from eagle3.training.epochs import best_epoch, epoch_summaries
from eagle3.training.metrics_log import read_log
from eagle3.training.resume import drop_checkpoints_before
from eagle3.training.vocab_mapping import VocabManifest, load_vocab_mapping
from eagle3.training.warm_start import warm_start

__all__ = ["OOM_EXIT", "TrainSpec", "report_record", "speculators_train_config", "train_attempt"]

OOM_EXIT = 75
log = logging.getLogger(__name__)


class TrainSpec(BaseModel):
    """Everything one attempt needs; written as JSON for a child process."""

    cfg: TrainConfig
    work: Path
    verifier_path: Path
    aux_layer_ids: list[int]
    hidden_size: int
    vocab: VocabManifest
    total_seq_len: int
    device: str
    init_checkpoint: Path | None = None
    validate_epoch: int | None = None  # an epoch checkpoint to validate before training on (its validation was cut short)
    online_storage: str | None = None  # states computed here by the verifier, rounded to this precision; None: read from files

    @property
    def metrics_log(self) -> Path:
        return self.work / "metrics.jsonl"

    @property
    def timing_log(self) -> Path:
        return self.work / "timing.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.work / "checkpoints"


def report_record(record: dict, total_steps: int, cfg: TrainConfig, on_step, around_epoch_line=nullcontext) -> None:
    """Pass a metrics record that ends an optimizer step to `on_step(step, total, metrics)`, and log
    one that ends an epoch's validation, inside `around_epoch_line()` (a bar steps aside): under
    torchrun the workers' output goes to train.log, so these lines are what the run's log shows of a
    training's progress, on a cut-off run how far it got."""
    if "train" in record and on_step is not None:
        on_step(record["global_step"] + 1, total_steps, record["train"])
    elif "val" in record:
        (epoch,) = epoch_summaries([record], cfg.ttt_steps)
        acceptance = " / ".join(f"{epoch[f'cond_acc_{k}']:.3f}" for k in range(cfg.ttt_steps))
        with around_epoch_line():
            log.info(
                "train draft: epoch %d of %d validated: tau_sim %.3f, loss %.3f, acceptance by TTT step %s",
                epoch["epoch"] + 1,
                cfg.epochs,
                epoch["tau_sim"],
                epoch["val_loss"],
                acceptance,
            )


def planned_steps(loader, trainer, epochs: int) -> int:
    """The optimizer step a training of `epochs` epochs ends at: the steps `trainer` resumed after,
    plus each epoch's batches from its resume point on. speculators' packing sampler packs each epoch
    from its own shuffle, so epochs differ in length (3 epochs of the tests' sample take 80 steps
    where 3 times the first epoch's makes 81, and a bar of steps to that total never filled), and a
    run resumed after an out-of-memory back-off packs its epochs anew at the smaller `total_seq_len`
    while the steps before it stay as they were."""
    set_epoch = getattr(loader.batch_sampler, "set_epoch", lambda epoch: None)
    steps = trainer.global_step - getattr(trainer, "_resume_local_step", 0)  # a mid-epoch resume skips those
    for epoch in range(trainer.current_epoch, epochs):
        set_epoch(epoch)
        steps += len(loader)
    set_epoch(trainer.current_epoch)
    return steps


@contextmanager
def _collect_metrics(log: Path, timing_log: Path, on_record) -> Iterator[None]:
    """Append each dict speculators' Trainer logs to `speculators.metrics` (one per step and per
    validation epoch) to `log`, which outlives a crash, and pass it to `on_record`. Timings (the
    step timer's, and the wall clock when each record arrived) go to `timing_log` instead:
    wall-clock numbers would make two identical trainings' metrics differ."""
    logger = logging.getLogger("speculators.metrics")

    class _Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict):
                entry = {k: v for k, v in record.msg.items() if k != "profile"}
                with open(log, "a") as f:
                    f.write(json.dumps(entry, default=float) + "\n")
                timing = {
                    "global_step": entry.get("global_step"),
                    "ended_at": time.time(),
                    "validation": "val" in entry,
                    **(record.msg.get("profile") or {}),
                }
                with open(timing_log, "a") as f:
                    f.write(json.dumps(timing, default=float) + "\n")
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


def _fault_oom_above(model) -> None:
    """The test hook `FAULT_OOM_ENV`: the real torch.OutOfMemoryError for any batch above its limit."""
    forward = model.forward

    def guarded(*args, **kwargs):
        tokens = kwargs["input_ids"].numel() if "input_ids" in kwargs else args[0].numel()
        simulate_oom_above(tokens, f"{tokens} training tokens")
        return forward(*args, **kwargs)

    model.forward = guarded


def speculators_train_config(spec: TrainSpec):
    """speculators' own `TrainConfig` for this attempt: the settings its CLI would be given."""
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig

    cfg, device = spec.cfg, torch.device(spec.device)
    readers = 0 if device.type == "cpu" or spec.online_storage else cfg.loader_workers  # online: one verifier, here
    return SpeculatorsTrainConfig.from_flat(
        {
            "verifier_name_or_path": str(spec.verifier_path),
            "data_path": str(spec.work / "data"),
            "save_path": str(spec.checkpoints),
            "target_layer_ids": spec.aux_layer_ids,
            "draft_vocab_size": spec.vocab.draft_vocab_size,
            "num_layers": cfg.num_layers,
            "norm_before_fc": not cfg.fc_norm,  # speculators' default for EAGLE-3, or EAGLE 3.1's per-layer norms
            "fc_norm": cfg.fc_norm,
            "full_attention_indices": list(range(cfg.num_layers)),
            "draft_attn_impl": trainer_compat.draft_attn_impl(device),
            "loss_fn": cfg.loss_fn,
            "loss_implementation": trainer_compat.loss_implementation(device),
            "ttt_steps": cfg.ttt_steps,
            "ttt_step_loss_decay": cfg.ttt_step_loss_decay,
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "epochs": cfg.epochs,
            "total_seq_len": spec.total_seq_len,
            "train_data_ratio": cfg.train_data_ratio,
            "seed": cfg.seed,
            "on_missing": "raise",
            "num_workers": readers,
        }
    )


def train_attempt(spec: TrainSpec, on_step=None, around_epoch_line=nullcontext) -> None:
    """Train (or resume) into `spec.checkpoints`; rank 0 appends metrics to `spec.metrics_log`.

    `on_step(step, total, metrics)` is called after every optimizer step on rank 0, and each
    validated epoch's log line is written inside `around_epoch_line()` (a bar steps aside).
    """
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.distributed import get_rank, maybe_destroy_distributed, maybe_setup_distributed
    from speculators.train.trainer import TrainerConfig

    cfg, device = spec.cfg, torch.device(spec.device)
    dtype = compute_dtype(device)
    data_dir = spec.work / "data"
    verifier_path = str(spec.verifier_path)
    flat = speculators_train_config(spec).flatten()

    if device.type == "cuda":
        maybe_setup_distributed()  # a no-op outside torchrun
    transfer = _transfer(spec, device, dtype)  # before seeding: loading a verifier must not shift the draft's initialisation
    _seed(cfg.seed)
    install_partial_neox_rotary()
    d2t, t2d = load_vocab_mapping(spec.vocab)
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier_path,
        num_layers=cfg.num_layers,
        draft_arch=flat["draft_arch"],
        hidden_act=flat["draft_hidden_act"],
        sliding_window=flat["sliding_window"],
        full_attention_indices=flat["full_attention_indices"],
        mrope_full_head_hack=False,
    )
    model = Eagle3DraftModel.from_training_args(verifier_config=layer_config, t2d=t2d, d2t=d2t, **flat)
    if spec.init_checkpoint is not None:  # a resumed attempt's own checkpoint replaces these weights
        warm_start(model, spec.init_checkpoint)
    if os.environ.get(FAULT_OOM_ENV):
        _fault_oom_above(model)

    train_loader, val_loader = create_train_val_loaders(
        data_path=str(data_dir),
        total_seq_len=spec.total_seq_len,
        hidden_states_dtype=dtype,
        transfer=transfer,
        vllm_endpoint=flat["vllm_endpoint"],
        on_missing="raise",
        verifier_name_or_path=verifier_path,
        request_timeout=flat["request_timeout"],
        max_retries=flat["max_retries"],
        generation_validation_retries=flat["generation_validation_retries"],
        max_consecutive_generation_failures=flat["max_consecutive_generation_failures"],
        hidden_size=spec.hidden_size,
        num_target_layers=len(spec.aux_layer_ids),
        num_workers=flat["num_workers"],
        prefetch_factor=flat["prefetch_factor"],
        preprocess=shift_batch,
        train_data_ratio=cfg.train_data_ratio,
        seed=cfg.seed,
    )
    if device.type != "cuda":
        for loader in (train_loader, val_loader):
            loader.pin_memory = False  # speculators pins for a GPU; without one torch warns on every epoch
    if spec.online_storage is not None:
        from eagle3.training.online_transfer import feed

        feed([train_loader, val_loader], transfer)
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
        hidden_states_dtype=dtype,
        log_freq=1,
        checkpoint_freq=1,
        fsdp_shard=cfg.fsdp,
    )
    rank0 = get_rank() == 0
    plan = {"total_steps": 0}  # known once the trainer has read its checkpoint

    def on_record(record: dict) -> None:
        if "val" in record:  # its epoch is done: the run resumes from no earlier checkpoint, and may ship the best
            best = best_epoch(epoch_summaries(read_log(spec.metrics_log), spec.cfg.ttt_steps))
            drop_checkpoints_before(spec.checkpoints, record["epoch"], keep=best)
        report_record(record, plan["total_steps"], spec.cfg, on_step, around_epoch_line)

    metrics = _collect_metrics(spec.metrics_log, spec.timing_log, on_record) if rank0 else _no_metrics()
    try:
        with trainer_compat.trainer_class(device) as trainer_cls, metrics:
            trainer = trainer_cls(model, trainer_config, train_loader, val_loader)
            plan["total_steps"] = planned_steps(train_loader, trainer, cfg.epochs)
            if rank0:
                atomic_write_text(spec.work / "plan.json", json.dumps(plan))
            if spec.validate_epoch is not None:  # the trainer loaded that checkpoint
                trainer.maybe_update_best(spec.validate_epoch, trainer.val_epoch(spec.validate_epoch))
            trainer.run_training()
    finally:
        if spec.online_storage is not None:
            transfer.close()
        maybe_destroy_distributed()


def _transfer(spec: TrainSpec, device: torch.device, dtype: torch.dtype):
    """Where speculators' loaders take each sample's states from: the shard files (bf16 or FP8: hs-connectors'
    `FP8Transfer` dequantizes FP8 files to `dtype` and passes bf16 ones through; its `FileTransfer` would hand
    FP8 codes on unscaled, silently), or the verifier, run here (`eagle3.training.online_transfer`)."""
    from hs_connectors import FP8Transfer

    if spec.online_storage is None:
        return FP8Transfer(spec.work / "data" / "hidden_states", dequantize_dtype=dtype)
    from eagle3.training.online_transfer import OnlineStates

    verifier_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device.type == "cuda" else device
    return OnlineStates(
        spec.verifier_path,
        spec.aux_layer_ids,
        spec.online_storage,
        verifier_device,
        dtype,
        budget=spec.total_seq_len,
        keep_bytes=int(spec.cfg.online_buffer_gb * 1e9),
    )


@contextmanager
def _no_metrics() -> Iterator[None]:
    yield


def main(argv: list[str]) -> int:
    spec = TrainSpec.model_validate_json(Path(argv[0]).read_text())
    rank = os.environ.get("RANK", "0")
    oom = None
    try:
        train_attempt(spec)
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    if oom is not None:
        atomic_write_text(spec.work / f"oom-rank{rank}.json", json.dumps({"rank": rank, "error": oom}))
        return OOM_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
