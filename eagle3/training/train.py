"""Train the draft with speculators' own model, data loader and Trainer.

Inputs: prepared dataset, hidden states, vocab mapping and verifier directory. speculators reads a
`datasets.save_to_disk` directory beside `hidden_states/hs_{i}.safetensors`; this step builds
that layout in its work dir (the hidden-state files are linked, not copied), then runs
`Eagle3DraftModel` under speculators' `Trainer` with test-time training (`ttt_steps`), a checkpoint
per epoch and per-step `loss_k`/`full_acc_k`/`cond_acc_k`. After a crash or a kill, training resumes
from the last validated epoch checkpoint, exactly: the draft equals an uninterrupted run's
(`eagle3.training.resume`). Before it trains, every hidden-state file is checked against the sha256
recorded when it was extracted (`eagle3.store.verify`): a damaged shard is removed, not trained on.
Given an `online_states` artifact instead (`train.hidden_states=online`, `eagle3.training.online`),
there are no files: the verifier computes each batch's states inside training.

One attempt (`eagle3.training.train_worker`) runs in this process on CPU and under `torchrun` on GPUs, one
process per claimed device, so every attempt starts with empty GPUs; out of memory relaunches from
the last epoch checkpoint with half the batch (`total_seq_len`), recorded in the manifest, but never
so small that a record loses supervised tokens (`eagle3.training.packing`).

Output: `checkpoint/` (`config.json` + `model.safetensors` in bf16, as speculators saves them, of the
epoch with the best simulated acceptance length on the validation split: `eagle3.training.epochs`), `metrics.jsonl` (one line per step and per validation epoch), on GPUs `train.log` (what the
`torchrun` processes printed, dynamo's warnings included; on the CPU it stays in the work directory) and `training_curves.png` (loss and
per-TTT-step acceptance by epoch, drawn from `metrics.jsonl`). Step timings stay out of the
artifact, so identical CPU trainings publish one artifact: the manifest holds their summary
(`tokens_per_s`, `time_breakdown_s`).
Cost on CPU: ~1.3 s per 512-token step for a SmolLM2-135M verifier.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stdout
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from eagle3.config import TrainConfig
from eagle3.data.prepare_dataset import DatasetManifest, load_dataset_table
from eagle3.extraction.shards import HiddenStatesManifest, hidden_state_files, hs_path
from eagle3.runtime.attempts import BACKOFF_LOG, NO_GPU, Backoff, GpuClaim, OutOfMemory, dying_with_parent
from eagle3.runtime.devices import gpu_memory_used_mib, resolve_device
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore, read_manifest_record, step_provenance
from eagle3.store.files import atomic_write_text
from eagle3.store.manifests import MANIFEST, ArtifactManifest, Provenance
from eagle3.store.promotions import promoted_checkpoints, promoted_drafts
from eagle3.store.verify import remove_damaged, verify_shards
from eagle3.training import train_timing
from eagle3.training.epochs import best_epoch, epoch_summaries
from eagle3.training.metrics_log import read_log
from eagle3.training.packing import LosslessBackoff, check_total_seq_len
from eagle3.training.resume import INTERRUPTED, prepare_resume, resume_point
from eagle3.training.training_curves import render_training_curves
from eagle3.training.vocab_mapping import VocabManifest
from eagle3.verifier.resolve_verifier import VerifierManifest

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    from eagle3.training.train_worker import TrainSpec

__all__ = ["DraftManifest", "previous_draft", "ship_best_epoch", "train_draft", "training_provenance"]

logger = logging.getLogger(__name__)


class DraftManifest(ArtifactManifest):
    kind: str = "draft"
    epochs: list[dict[str, float]]
    num_steps: int
    tau_sim: float = Field(description="the selected epoch's simulated acceptance length on the validation split")
    selected_epoch: int | None = Field(
        None, description="the epoch whose weights the draft ships: the best tau_sim (eagle3.training.epochs)"
    )
    checkpoint: str = "checkpoint"
    backoffs: list[Backoff] = Field(default_factory=list)
    gpu_memory_after_mib: dict[str, int] | None = Field(
        None, description="memory in use on each claimed GPU once the training processes exited"
    )
    curves: str = "training_curves.png"
    aux_layer_ids: list[int] | None = Field(None, description="verifier layers the draft reads (what a warm start must match)")
    finished_at: datetime | None = Field(None, description="when training finished (the latest is the next warm start)")
    tokens_per_s: float | None = Field(
        None, description="median training tokens per second per GPU over the steps (speculators' step timer)"
    )
    time_breakdown_s: dict[str, float] | None = Field(
        None, description="where the step's seconds went: startup, first step, steps, validation, other (train_timing)"
    )


def previous_draft(
    store: ArtifactStore, cfg: TrainConfig, verifier: VerifierManifest, hidden_states: HiddenStatesManifest, dataset: DatasetManifest
) -> DraftManifest | None:
    """The draft to continue from: of the finished drafts trained for this verifier, aux layers,
    `cfg.num_layers` and `cfg.fc_norm` on a dataset other than `dataset`, the latest one behind a promoted checkpoint,
    else the latest one (so a smoke run does not displace the draft being served); None when the
    store holds none."""
    candidates = []
    for path in (store.root / "artifacts").glob(f"*/{MANIFEST}"):
        try:
            record = read_manifest_record(path)
            if record.get("kind") != "draft" or record.get("finished_at") is None:
                continue  # another kind, or a draft from before drafts recorded when they finished
            draft = DraftManifest.model_validate(record).model_copy(update={"path": path.parent})  # where it is in this store
        except (ArtifactError, ValueError) as exc:  # a damaged artifact is no draft to continue from
            logger.warning("%s", str(exc).splitlines()[0])
            continue
        if (
            draft.parents.get("verifier") == verifier.digest
            and draft.aux_layer_ids == hidden_states.aux_layer_ids
            and draft.config.get("cfg", {}).get("num_layers") == cfg.num_layers
            and draft.config.get("cfg", {}).get("fc_norm", False) == cfg.fc_norm  # in the key only when set
            and draft.parents.get("dataset") != dataset.digest
        ):
            candidates.append(draft)
    promoted = promoted_drafts(store, promoted_checkpoints(store))
    return max(candidates, key=lambda d: (d.digest in promoted, d.finished_at), default=None)


def _verify_hidden_states(store: ArtifactStore, hidden_states: HiddenStatesManifest) -> None:
    """Check every hidden-state file against the sha256 its shard recorded when it was extracted.

    Raises:
        ArtifactError: a shard is damaged (a file changed, went missing or does not read): it is removed,
            with the hidden-state artifacts that list it, so the re-run's extraction extracts it again.
    """
    files = hidden_state_files(hidden_states)
    damaged = verify_shards(sorted({path.parent for path in files.values()}))
    if damaged:
        removed = remove_damaged(store, damaged)
        raise ArtifactError(
            damaged[0].path,
            f"{damaged[0].problem}{f' (and {len(damaged) - 1} more damaged shards)' if len(damaged) > 1 else ''}: not trained on. "
            f"Removed it and what lists it ({len(removed)} directories): re-run, and extraction extracts it again.",
        )


def training_provenance(store: ArtifactStore, **inputs) -> Provenance:
    """The step's provenance; its route is `draft/online` where training computes the states itself
    (`hidden_states` an `online_states` artifact), so the code that computes them is in the key."""
    online = inputs["hidden_states"].kind == "online_states"
    return step_provenance("draft/online" if online else "draft", store, **inputs)


def _speculators_data_dir(root: Path, dataset: DatasetManifest, hidden_states: HiddenStatesManifest | None) -> Path:
    """speculators' training layout: `save_to_disk` records + `hidden_states/hs_{i}` links (none online)."""
    from datasets import Dataset

    data_dir = root / "data"
    if data_dir.exists():
        shutil.rmtree(data_dir)
    table = load_dataset_table(dataset).select(["input_ids", "loss_mask", "seq_len"])
    Dataset(table).with_format("torch").save_to_disk(str(data_dir))
    if hidden_states is None:
        return data_dir
    links = data_dir / "hidden_states"
    links.mkdir()
    files = hidden_state_files(hidden_states)
    if len(files) != table.num_rows:
        raise ArtifactError(hidden_states.path, f"{len(files)} hidden-state files for {table.num_rows} records")
    for index, path in files.items():
        os.symlink(path, hs_path(links, index))
    return data_dir


def _read_new_lines(path: Path, offset: int) -> tuple[list[dict], int]:
    """The complete JSON lines appended to `path` since `offset`, and the offset after them."""
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
    return [json.loads(line) for line in complete.splitlines()], offset + len(complete)


class _StepBar:
    """The training's steps as a bar on stderr; `stepped` moves it and calls the caller's `on_step`.
    A resumed attempt's bar starts past the earlier attempts' steps, and counts its rate from there.
    An epoch's log line is written with the bar stepped aside (`bar.external_write_mode()`)."""

    def __init__(self, on_step) -> None:
        from tqdm import tqdm

        self.bar = tqdm(desc="train draft", unit="step")
        self.on_step = on_step

    def stepped(self, step: int, total: int, metrics: dict) -> None:
        if self.bar.total is None:  # this attempt's first step
            self.bar.reset(total)
            self.bar.initial = self.bar.n = self.bar.last_print_n = step - 1  # tqdm's rate counts from last_print_n
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=step == total)  # the last step shows at once: validation follows
        if self.on_step is not None:
            self.on_step(step, total, metrics)

    def __enter__(self) -> _StepBar:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _torchrun(spec: TrainSpec, gpus: list[str], on_step, compile_cache: Path) -> OutOfMemory | None:
    """One attempt as `torchrun` with a process per GPU; returns where memory ran out, if it did.
    Progress is read from the metrics log the rank-0 process appends to, and shown as a bar of
    steps (the workers' own bars go to train.log) and a log line per validated epoch. `torch.compile`'s cache
    goes to `compile_cache` unless TORCHINDUCTOR_CACHE_DIR is set: compiling the draft cold takes
    minutes on an H200, against seconds for epochs of steps, and /tmp may not outlive the machine."""
    from eagle3.training.train_worker import report_record

    spec_file = spec.work / "spec.json"
    atomic_write_text(spec_file, spec.model_dump_json())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={len(gpus)}",
        "-m",
        "eagle3.training.train_worker",
        str(spec_file),
    ]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(compile_cache), **os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    log_path = spec.work / "train.log"
    # Follow only what this attempt appends (a resumed run's log already holds earlier attempts).
    offset = spec.metrics_log.stat().st_size if spec.metrics_log.exists() else 0
    with open(log_path, "ab") as log, _StepBar(on_step) as steps:
        child = subprocess.Popen(dying_with_parent(command), env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            code = child.poll()
            if spec.metrics_log.exists() and (spec.work / "plan.json").exists():
                total = json.loads((spec.work / "plan.json").read_text())["total_steps"]
                records, offset = _read_new_lines(spec.metrics_log, offset)
                for record in records:
                    report_record(record, total, spec.cfg, steps.stepped, steps.bar.external_write_mode)
            if code is not None:
                break
            time.sleep(2.0)
    markers = sorted(spec.work.glob("oom-rank*.json"))
    if markers:
        error = json.loads(markers[0].read_text())["error"]
        for marker in markers:
            marker.unlink()
        return OutOfMemory(error=error, where="in a training step")
    if code != 0:
        raise RuntimeError(f"training exited with code {code}; its log, {log_path}, ends:\n{log_path.read_text()[-3000:]}")
    return None


def _in_process(spec: TrainSpec, on_step) -> OutOfMemory | None:
    """One attempt in this process (on the CPU), with the bar and epoch lines of `_torchrun`.
    speculators' own bars (stdout; one per epoch's training and one per validation, counted from
    epoch 0) go to train.log, as the workers' do under torchrun: they would land among the results.
    transformers' bar for each epoch's checkpoint write is off meanwhile: it broke the bar of steps."""
    import torch
    from transformers.utils import logging as transformers_logging

    from eagle3.training.train_worker import train_attempt

    oom = None
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with _StepBar(on_step) as steps, open(spec.work / "train.log", "a") as log, redirect_stdout(log):
            train_attempt(spec, steps.stepped, steps.bar.external_write_mode)
    except torch.OutOfMemoryError as exc:
        oom = OutOfMemory(error=str(exc).splitlines()[0], where="in a training step")
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()
    return oom  # returned outside the except block, so the error's frames (and tensors) are freed


def ship_best_epoch(checkpoints: Path, epochs: list[dict], out: Path) -> int:
    """Write the weights of the epoch with the best validation estimate (`best_epoch`) from
    `checkpoints/<epoch>` to `out`, in bf16; returns that epoch.

    Raises:
        RuntimeError: no epoch was validated.
    """
    from eagle3.training.trainer_compat import save_bf16_checkpoint  # imports speculators' trainer: only where weights ship

    selected = best_epoch(epochs)
    if selected is None:
        raise RuntimeError(f"no validated epoch in {checkpoints}: no weights to ship")
    save_bf16_checkpoint(checkpoints / str(selected), out)
    return selected


def train_draft(
    cfg: TrainConfig,
    dataset: DatasetManifest,
    hidden_states: HiddenStatesManifest,
    vocab: VocabManifest,
    verifier: VerifierManifest,
    store: ArtifactStore,
    provenance: Provenance,
    on_step=None,
    claim: GpuClaim = NO_GPU,
    init: DraftManifest | None = None,
) -> DraftManifest:
    """Train an EAGLE-3 draft; resumes from the last validated epoch checkpoint of an interrupted run.

    `init`: an earlier draft whose trainable weights training starts from (None: fresh weights).
    `claim`: the CUDA devices to train on, claimed once this run holds the step; training then runs
    under torchrun, one process per device (none claimed: in this process on `cfg.device`). On
    out-of-memory, relaunches from the last checkpoint with half the `total_seq_len`, down to
    `cfg.min_total_seq_len` or the longest record's supervised tokens, whichever is more.
    `on_step(step, total, metrics)` is called after every optimizer step (for progress reports).

    Raises:
        ConfigError: `cfg.total_seq_len` would cut supervised tokens of a record (before any work).
        ArtifactError: a hidden-state shard is damaged (removed, so a re-run extracts it again).
        RuntimeError: out of memory at the smallest batch allowed, or training was interrupted by a signal.
    """
    from eagle3.training.train_worker import TrainSpec

    extent = check_total_seq_len(cfg.total_seq_len, dataset)
    with store.step_work_dir(DraftManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        online = hidden_states.kind == "online_states"  # no files: the verifier computes the states in training
        if not online:
            _verify_hidden_states(store, hidden_states)
        _speculators_data_dir(work, dataset, None if online else hidden_states)
        backoff = LosslessBackoff(
            cfg,
            extent,
            dataset,
            kept=f"Finished epochs are kept in {work / 'checkpoints'}: a re-run resumes from the last.",
            log=work / BACKOFF_LOG,
        )
        with clock.excluding_wait(claim()) as gpus:
            spec = TrainSpec(
                cfg=cfg,
                work=work,
                verifier_path=verifier.path,
                aux_layer_ids=hidden_states.aux_layer_ids,
                hidden_size=hidden_states.hidden_size,
                vocab=vocab,
                total_seq_len=backoff.value,
                device="cuda" if gpus else str(resolve_device(cfg.device)),
                init_checkpoint=init.path / init.checkpoint if init else None,
                online_storage=hidden_states.storage if online else None,
            )
            while True:
                point = prepare_resume(spec.checkpoints, spec.metrics_log, spec.timing_log, cfg.ttt_steps)
                spec = spec.model_copy(update={"validate_epoch": None if point.validated else point.epoch})
                oom = _torchrun(spec, gpus, on_step, store.root / "compile-cache") if gpus else _in_process(spec, on_step)
                if oom is None:
                    break
                spec = spec.model_copy(update={"total_seq_len": backoff.after(oom)})
            gpu_memory_after = gpu_memory_used_mib(gpus) if gpus else None

        history = read_log(spec.metrics_log)
        point = resume_point(spec.checkpoints, history)
        # speculators saves and returns on SIGINT/SIGTERM instead of raising; after the last epoch's validation its
        # interrupted/ checkpoint is the only trace of the signal
        if point.finished_epochs != cfg.epochs or (spec.checkpoints / INTERRUPTED).exists():
            raise RuntimeError(
                f"training was interrupted after {point.finished_epochs} of {cfg.epochs} epochs; finished epochs are kept "
                f"in {spec.checkpoints}: a re-run resumes from the last."
            )
        epochs = epoch_summaries(history, cfg.ttt_steps)
        assert [e["epoch"] for e in epochs] == list(range(cfg.epochs)), epochs  # resume_point counts validated epochs only
        out = work / "artifact"
        if out.exists():
            shutil.rmtree(out)
        selected = ship_best_epoch(spec.checkpoints, epochs, out / "checkpoint")
        shutil.copy2(spec.metrics_log, out / "metrics.jsonl")
        if gpus and (work / "train.log").exists():  # GPU training is not bit-reproducible anyway; a CPU one's log holds timings
            shutil.copy2(work / "train.log", out / "train.log")
        render_training_curves(spec.metrics_log, out / "training_curves.png", cfg.ttt_steps)
        manifest = store.publish(
            out,
            DraftManifest(
                **provenance.model_dump(),
                path=out,
                epochs=epochs,
                num_steps=len({r["global_step"] for r in history if "train" in r}),
                tau_sim=epochs[selected]["tau_sim"],
                selected_epoch=selected,
                aux_layer_ids=hidden_states.aux_layer_ids,
                finished_at=datetime.now(UTC),
                backoffs=backoff.taken,
                gpu_memory_after_mib=gpu_memory_after,
                tokens_per_s=train_timing.median_tokens_per_s(spec.timing_log),
                time_breakdown_s=train_timing.time_breakdown(spec.timing_log, clock.wall_start, time.time()),
                seconds=clock(),
            ),
        )
        shutil.rmtree(work)
        return manifest
