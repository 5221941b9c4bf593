"""speculators' loguru records reach `logging` (and so the run's log) instead of stderr in a format of their own."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import save_file
from speculators.utils.loading import load_model_layers

from eagle3.runtime.library_logs import forward_speculators_logs


def test_speculators_records_reach_logging_and_a_tied_verifier_s_two_warnings_come_at_debug(tmp_path, caplog, capfd):
    save_file({"model.embed_tokens.weight": torch.ones(8, 4)}, str(tmp_path / "model.safetensors"))  # tied: no lm_head, no index
    forward_speculators_logs()
    forward_speculators_logs()  # a second call changes nothing

    with caplog.at_level(logging.DEBUG, logger="speculators"):
        loaded = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(tmp_path))

    assert list(loaded) == ["embed_tokens.weight"]
    levels = {(r.name, r.levelno, r.getMessage()) for r in caplog.records}
    assert ("speculators.utils.loading", logging.DEBUG, "Tensor 'lm_head.weight' not found in weight_map.") in levels
    assert ("speculators.utils.loading", logging.WARNING, "Tensor 'model.norm.weight' not found in weight_map.") in levels
    assert ("speculators.utils.loading", logging.INFO, f"Loading from local directory: {tmp_path}") in levels
    assert any(level == logging.DEBUG and text.startswith("`model.safetensors.index.json` file not found") for _, level, text in levels)
    assert capfd.readouterr().err == ""  # loguru's own sink printed none of them
