from __future__ import annotations

import json

import pytest

from eagle3.store.artifacts import ArtifactError
from eagle3.training.training_curves import render_training_curves


def _metrics(path, epochs: int = 2, steps: int = 5):
    lines = []
    for epoch in range(epochs):
        for i in range(steps):
            acc = {f"{m}_{k}": 0.1 * (epoch + 1) for m in ("cond_acc", "full_acc") for k in range(3)}
            lines.append({"train": {"loss": 1.0 / (1 + i + epoch * steps), **acc}, "epoch": epoch, "global_step": epoch * steps + i})
        lines.append({"val": {"loss_epoch": 0.5 / (epoch + 1), **{f"cond_acc_{k}_epoch": 0.2 for k in range(3)}}, "epoch": epoch})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_equal_metrics_render_equal_bytes(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl")

    first = render_training_curves(metrics, tmp_path / "a.png", ttt_steps=3).read_bytes()
    second = render_training_curves(metrics, tmp_path / "b.png", ttt_steps=3).read_bytes()

    assert first == second  # the PNG is part of the draft's content digest


def test_a_malformed_metrics_line_names_the_file_and_line(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl")
    metrics.write_text(metrics.read_text() + '{"train": {"loss": 1.0}}\n')

    with pytest.raises(ArtifactError, match=r"metrics.jsonl: line 13: not a speculators metrics record"):
        render_training_curves(metrics, tmp_path / "curves.png", ttt_steps=3)


def test_a_log_without_training_steps_is_an_error(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"val": {"loss_epoch": 0.5}, "epoch": 0}\n')

    with pytest.raises(ArtifactError, match="no 'train' records"):
        render_training_curves(metrics, tmp_path / "curves.png", ttt_steps=3)
