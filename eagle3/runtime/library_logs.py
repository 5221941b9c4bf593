"""speculators logs through loguru, whose default sink prints every record, INFO ones included, to
stderr in a format of its own and outside the run's log. `forward_speculators_logs` sends them to
the standard `logging` logger of the module that logged them instead, where the run's logging setup
(Prefect's: WARNING and above from libraries) shows them beside the pipeline's own records.

Two warnings speculators gives whenever it loads a small verifier's embeddings are forwarded at
DEBUG: its weights in one `model.safetensors` file with no index, which it then reads, and no
`lm_head.weight` in a verifier whose config.json ties it to `embed_tokens.weight`, which it then
takes. A verifier that does not say it ties them keeps that warning: its draft would train against
the embeddings as its output head."""

from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["forward_speculators_logs"]

SINGLE_FILE = "`model.safetensors.index.json` file not found"
NO_LM_HEAD = "Tensor 'lm_head.weight' not found in weight_map"
LOADING_FROM = "Loading from local directory: "  # what speculators logs before it reads a verifier's weights
LEVELS = {"TRACE": logging.DEBUG, "SUCCESS": logging.INFO}  # loguru's levels that `logging` lacks

_last_directory: list[Path] = []


def _ties_embeddings(directory: Path) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False)))


def _forward(message) -> None:
    record = message.record
    text, level = record["message"], LEVELS.get(record["level"].name, record["level"].no)
    if text.startswith(LOADING_FROM):
        _last_directory[:] = [Path(text.removeprefix(LOADING_FROM))]
    if text.startswith(SINGLE_FILE) or (text.startswith(NO_LM_HEAD) and _last_directory and _ties_embeddings(_last_directory[0])):
        level = logging.DEBUG
    error = record["exception"]
    exc_info = (error.type, error.value, error.traceback) if error is not None else None
    logging.getLogger(record["name"] or "speculators").log(level, text, exc_info=exc_info)


def forward_speculators_logs() -> None:
    """Replace loguru's default stderr sink with one into `logging`. Idempotent."""
    from loguru import logger

    try:
        logger.remove(0)  # the default sink, added on loguru's import
    except ValueError:  # removed already: forwarded by an earlier call, or by the user's own loguru setup
        return
    logger.add(_forward, level="DEBUG", format="{message}")
