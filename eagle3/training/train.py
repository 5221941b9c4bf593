"""Train the draft with speculators' own model, data loader and Trainer.

Inputs: prepared dataset, hidden states, vocab mapping and verifier directory. speculators reads a
`datasets.save_to_disk` directory beside `hidden_states/hs_{i}.safetensors`; this step builds
that layout in its work dir (the hidden-state files are linked, not copied), then runs
`Eagle3DraftModel` under speculators' `Trainer` with test-time training (`ttt_steps`), a checkpoint
per epoch (resumed after a crash, optimizer included) and per-step `loss_k`/`full_acc_k`/`cond_acc_k`.

One attempt (`eagle3.training.train_worker`) runs in this process on CPU and under `torchrun` on GPUs, one
process per claimed device, so every attempt starts with empty GPUs; out of memory relaunches from
the last epoch checkpoint with half the batch (`total_seq_len`), recorded in the manifest.

Output: `checkpoint/` (the last epoch's `config.json` + `model.safetensors`, as speculators saves
them), `metrics.jsonl` (one line per step and per validation epoch), on GPUs `train.log` (what the
`torchrun` processes printed, dynamo's warnings included) and `training_curves.png` (loss and
per-TTT-step acceptance by epoch, drawn from `metrics.jsonl`). Step timings stay out of the
artifact, so identical CPU trainings publish one artifact: the manifest holds their summary
(`tokens_per_s`, `time_breakdown_s`). The simulated acceptance
length is `1 + sum_j prod_{i<=j} cond_acc_i` over the TTT steps, from validation accuracies.
Cost on CPU: ~1.3 s per 512-token step for a SmolLM2-135M verifier.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from pydantic import Field

from eagle3.config import TrainConfig
from eagle3.data.prepare_dataset import DatasetManifest, load_dataset_table
from eagle3.extraction.shards import HiddenStatesManifest, hidden_state_files
from eagle3.runtime.attempts import NO_GPU, Backoff, BatchBackoff, GpuClaim, OutOfMemory, dying_with_parent
from eagle3.runtime.devices import gpu_memory_used_mib, resolve_device
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import MANIFEST, ArtifactManifest, Provenance
from eagle3.store.promotions import promoted_checkpoints
from eagle3.training import train_timing
from eagle3.training.train_worker import TrainSpec, report_step, train_attempt
from eagle3.training.training_curves import render_training_curves
from eagle3.training.vocab_mapping import VocabManifest
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["DraftManifest", "previous_draft", "simulated_acceptance_length", "train_draft"]



class DraftManifest(ArtifactManifest):
    kind: str = "draft"
    epochs: list[dict[str, float]]
    num_steps: int
    tau_sim: float
    checkpoint: str = "checkpoint"
    backoffs: list[Backoff] = []
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


def simulated_acceptance_length(cond_acc: list[float]) -> float:
    """Expected tokens per verifier pass for a chain draft: 1 + sum_j prod_{i<=j} cond_acc_i."""
    return 1.0 + sum(math.prod(cond_acc[: j + 1]) for j in range(len(cond_acc)))


def previous_draft(
    store: ArtifactStore, cfg: TrainConfig, verifier: VerifierManifest, hidden_states: HiddenStatesManifest, dataset: DatasetManifest
) -> DraftManifest | None:
    """The draft to continue from: of the finished drafts trained for this verifier, aux layers and
    `cfg.num_layers` on a dataset other than `dataset`, the latest one behind a promoted checkpoint,
    else the latest one (so a smoke run does not displace the draft being served); None when the
    store holds none."""
    candidates = []
    for path in (store.root / "artifacts").glob(f"*/{MANIFEST}"):
        record = json.loads(path.read_text())
        if record.get("kind") != "draft" or record.get("finished_at") is None:
            continue  # another kind, or a draft from before drafts recorded when they finished
        draft = DraftManifest.model_validate(record)
        if (
            draft.parents.get("verifier") == verifier.digest
            and draft.aux_layer_ids == hidden_states.aux_layer_ids
            and draft.config.get("cfg", {}).get("num_layers") == cfg.num_layers
            and draft.parents.get("dataset") != dataset.digest
        ):
            candidates.append(draft)
    promoted = {
        json.loads(path.read_text())["parents"].get("draft")
        for record in promoted_checkpoints(store)
        if (path := store.artifact_dir(record.checkpoint) / MANIFEST).exists()
    }
    return max(candidates, key=lambda d: (d.digest in promoted, d.finished_at), default=None)


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


def _read_new_lines(path: Path, offset: int) -> tuple[list[dict], int]:
    """The complete JSON lines appended to `path` since `offset`, and the offset after them."""
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
    return [json.loads(line) for line in complete.splitlines()], offset + len(complete)


def _torchrun(spec: TrainSpec, gpus: list[str], on_step, compile_cache: Path) -> OutOfMemory | None:
    """One attempt as `torchrun` with a process per GPU; returns where memory ran out, if it did.
    Progress is read from the metrics log the rank-0 process appends to. `torch.compile`'s cache
    goes to `compile_cache` unless TORCHINDUCTOR_CACHE_DIR is set: compiling the draft cold takes
    minutes on an H200, against seconds for epochs of steps, and /tmp may not outlive the machine."""
    spec_file = spec.work / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(gpus)}",
               "-m", "eagle3.training.train_worker", str(spec_file)]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(compile_cache), **os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    log_path = spec.work / "train.log"
    # Follow only what this attempt appends (a resumed run's log already holds earlier attempts).
    offset = spec.metrics_log.stat().st_size if spec.metrics_log.exists() else 0
    with open(log_path, "ab") as log:
        child = subprocess.Popen(dying_with_parent(command), env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            code = child.poll()
            if on_step is not None and spec.metrics_log.exists() and (spec.work / "plan.json").exists():
                total = json.loads((spec.work / "plan.json").read_text())["total_steps"]
                records, offset = _read_new_lines(spec.metrics_log, offset)
                for record in records:
                    report_step(record, total, on_step)
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
    import torch

    oom = None
    try:
        train_attempt(spec, on_step)
    except torch.OutOfMemoryError as exc:
        oom = OutOfMemory(error=str(exc).splitlines()[0], where="in a training step")
    return oom  # returned outside the except block, so the error's frames (and tensors) are freed


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
    """Train an EAGLE-3 draft; resumes from the last epoch checkpoint of an interrupted run.

    `init`: an earlier draft whose trainable weights training starts from (None: fresh weights).
    `claim`: the CUDA devices to train on, claimed once this run holds the step; training then runs
    under torchrun, one process per device (none claimed: in this process on `cfg.device`). On
    out-of-memory, relaunches from the last checkpoint with half the `total_seq_len`, down to
    `cfg.min_total_seq_len`.
    `on_step(step, total, metrics)` is called after every optimizer step (for progress reports).
    """
    with store.step_work_dir(DraftManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        _speculators_data_dir(work, dataset, hidden_states)
        backoff = BatchBackoff(
            "train.total_seq_len", cfg.total_seq_len, "train.min_total_seq_len", cfg.min_total_seq_len,
            kept=f"Finished epochs are kept in {work / 'checkpoints'}: a re-run resumes from the last.",
        )
        with clock.excluding_wait(claim()) as gpus:
            spec = TrainSpec(
                cfg=cfg, work=work, verifier_path=verifier.path, aux_layer_ids=hidden_states.aux_layer_ids,
                hidden_size=hidden_states.hidden_size, vocab=vocab, total_seq_len=cfg.total_seq_len,
                device="cuda" if gpus else str(resolve_device(cfg.device)),
                init_checkpoint=init.path / init.checkpoint if init else None,
            )
            while (oom := _torchrun(spec, gpus, on_step, store.root / "compile-cache") if gpus else _in_process(spec, on_step)) is not None:
                spec = spec.model_copy(update={"total_seq_len": backoff.after(oom)})
            gpu_memory_after = gpu_memory_used_mib(gpus) if gpus else None

        last_epoch = max((int(p.name) for p in spec.checkpoints.iterdir() if p.name.isdigit()), default=-1)
        if last_epoch != cfg.epochs - 1:  # speculators saves and returns on SIGINT/SIGTERM instead of raising
            raise RuntimeError(
                f"training was interrupted after {last_epoch + 1} of {cfg.epochs} epochs; finished epochs are kept "
                f"in {spec.checkpoints}: a re-run resumes from the last."
            )
        history = [json.loads(line) for line in spec.metrics_log.read_text().splitlines()]
        epochs = _epoch_summaries(history, cfg.ttt_steps)
        out = work / "artifact"
        if out.exists():
            shutil.rmtree(out)
        (out / "checkpoint").mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(spec.checkpoints / str(last_epoch) / name, out / "checkpoint" / name)
        shutil.copy2(spec.metrics_log, out / "metrics.jsonl")
        if (work / "train.log").exists():  # GPU training is not bit-reproducible anyway; on CPU there is no such log
            shutil.copy2(work / "train.log", out / "train.log")
        render_training_curves(spec.metrics_log, out / "training_curves.png", cfg.ttt_steps)
        manifest = store.publish(
            out,
            DraftManifest(
                **provenance.model_dump(),
                path=out,
                epochs=epochs,
                num_steps=len({r["global_step"] for r in history if "train" in r}),  # a resumed step is logged twice
                tau_sim=epochs[-1]["tau_sim"],
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
