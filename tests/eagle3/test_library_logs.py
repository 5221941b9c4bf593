"""speculators' loguru records reach `logging` (and so the run's log) instead of stderr in a format of their own."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file
from speculators.utils.loading import load_model_layers

from eagle3.runtime.library_logs import forward_speculators_logs

LOADING = "speculators.utils.loading"


def _records(caplog) -> set[tuple[str, int, str]]:
    return {(r.name, r.levelno, r.getMessage()) for r in caplog.records}


@pytest.mark.parametrize("tied", [True, False])
def test_speculators_records_reach_logging_and_a_tied_verifier_s_missing_head_comes_at_debug(tied, tmp_path, caplog, capfd):
    save_file({"model.embed_tokens.weight": torch.ones(8, 4)}, str(tmp_path / "model.safetensors"))  # no lm_head, no index
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    forward_speculators_logs()
    forward_speculators_logs()  # a second call changes nothing

    with caplog.at_level(logging.DEBUG, logger="speculators"):
        loaded = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(tmp_path))

    assert list(loaded) == ["embed_tokens.weight"]
    records = _records(caplog)
    head = logging.DEBUG if tied else logging.WARNING  # untied, the draft would train against the embeddings: say so
    assert (LOADING, head, "Tensor 'lm_head.weight' not found in weight_map.") in records
    assert (LOADING, logging.WARNING, "Tensor 'model.norm.weight' not found in weight_map.") in records
    assert (LOADING, logging.INFO, f"Loading from local directory: {tmp_path}") in records
    assert any(level == logging.DEBUG and text.startswith("`model.safetensors.index.json` file not found") for _, level, text in records)
    assert "speculators.utils.loading:load_model_layers:" not in capfd.readouterr().err  # loguru's own sink (its format) printed none


def test_a_speculators_exception_record_keeps_its_traceback_and_success_is_info(caplog):
    from loguru import logger

    forward_speculators_logs()
    with caplog.at_level(logging.DEBUG, logger=__name__):  # loguru names a record by its caller's module, as logging does
        try:
            raise ValueError("broken shard")
        except ValueError:
            logger.exception("loading failed")
        logger.success("saved")

    failed = next(r for r in caplog.records if r.getMessage() == "loading failed")
    assert failed.levelno == logging.ERROR and failed.exc_info is not None and failed.exc_info[0] is ValueError
    assert any(r.getMessage() == "saved" and r.levelno == logging.INFO for r in caplog.records)
