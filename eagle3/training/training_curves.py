"""Training curves: loss and per-TTT-step acceptance against epochs, drawn from `metrics.jsonl`.

Input: the draft step's `metrics.jsonl` (one `train` record per optimizer step, one `val` record
per epoch). Output: one PNG (two panels, ~45 KB at 80 dpi), written into the draft artifact so a
cached draft keeps its curves. Rendering takes ~1 s with matplotlib's Agg backend.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from eagle3.store.artifacts import ArtifactError
from eagle3.store.files import atomic_write_bytes

__all__ = ["render_training_curves"]


def _read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """Train records by global step and validation records by epoch; where a resumed run repeated
    a step or an epoch, the last report wins."""
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
            if "train" in record:
                train[record["global_step"]] = record
            elif "val" in record:
                val[record["epoch"]] = record
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ArtifactError(path, f"line {number}: not a speculators metrics record ({exc!r})") from exc
    if not train:
        raise ArtifactError(path, "no 'train' records: training logged no step")
    return [train[s] for s in sorted(train)], [val[e] for e in sorted(val)]


def _epoch_positions(train: list[dict]) -> list[float]:
    """x of each step in epochs: epoch e's n steps sit at e + i/n, so ticks mark epoch starts."""
    per_epoch: dict[int, int] = {}
    for record in train:
        per_epoch[record["epoch"]] = per_epoch.get(record["epoch"], 0) + 1
    seen: dict[int, int] = {}
    positions = []
    for record in train:
        epoch = record["epoch"]
        positions.append(epoch + seen.get(epoch, 0) / per_epoch[epoch])
        seen[epoch] = seen.get(epoch, 0) + 1
    return positions


def render_training_curves(metrics: Path, out: Path, ttt_steps: int) -> Path:
    """Draw train loss per step with validation loss per epoch, and each TTT step's conditional
    acceptance (train per step, validation per epoch), into the PNG `out`.

    Raises:
        ArtifactError: `metrics` is not speculators' metrics log or holds no training step.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training hosts
    from matplotlib.figure import Figure

    train, val = _read_metrics(metrics)
    x = _epoch_positions(train)
    val_x = [r["epoch"] + 1 for r in val]  # a validation pass closes its epoch
    figure = Figure(figsize=(9, 3.2), dpi=80, layout="constrained")
    loss, accept = figure.subplots(1, 2)
    loss.plot(x, [r["train"]["loss"] for r in train], lw=1, label="train (per step)")
    if val:
        loss.plot(val_x, [r["val"]["loss_epoch"] for r in val], "o-", label="validation (per epoch)")
    loss.set(title="loss", xlabel="epoch")
    loss.legend(fontsize="small")
    for k in range(ttt_steps):
        (line,) = accept.plot(x, [r["train"][f"cond_acc_{k}"] for r in train], lw=0.8, alpha=0.5)
        if val:
            accept.plot(val_x, [r["val"][f"cond_acc_{k}_epoch"] for r in val], "o-", color=line.get_color(), label=f"step {k} (val)")
    accept.set(title="acceptance per TTT step (faint: train)", xlabel="epoch", ylim=(0, 1))
    if val:
        accept.legend(fontsize="small")
    buffer = io.BytesIO()
    # No Software tag: equal metrics give equal bytes, so the draft's digest stays a content key.
    figure.savefig(buffer, format="png", metadata={"Software": None})
    atomic_write_bytes(out, buffer.getvalue())
    return out
