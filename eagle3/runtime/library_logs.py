"""speculators logs through loguru, whose default sink prints every record, INFO ones included, to
stderr in a format of its own and outside the run's log. `forward_speculators_logs` sends them to
the standard `logging` logger of the module that logged them instead, where the run's logging setup
(Prefect's: WARNING and above from libraries) shows them beside the pipeline's own records.

Two warnings speculators gives whenever it loads a small verifier's embeddings are forwarded at
DEBUG: its weights in one `model.safetensors` file with no index, which it then reads, and no
`lm_head.weight` in a verifier that ties it to `embed_tokens.weight`, which it then takes."""

from __future__ import annotations

import logging

__all__ = ["forward_speculators_logs"]

BENIGN = (
    "`model.safetensors.index.json` file not found",
    "Tensor 'lm_head.weight' not found in weight_map",
)


def _forward(message) -> None:
    record = message.record
    text = record["message"]
    level = logging.DEBUG if text.startswith(BENIGN) else record["level"].no
    logging.getLogger(record["name"] or "speculators").log(level, text)


def forward_speculators_logs() -> None:
    """Replace loguru's default stderr sink with one into `logging`. Idempotent."""
    from loguru import logger

    try:
        logger.remove(0)  # the default sink, added on loguru's import
    except ValueError:  # removed already: forwarded by an earlier call, or by the user's own loguru setup
        return
    logger.add(_forward, level="DEBUG", format="{message}")
