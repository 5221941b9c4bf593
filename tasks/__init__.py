"""Prefect tasks: each wraps one `eagle3` step with its cache policy and its UI artifacts."""

import logging

# Prefect passes the library's records to the run's log (PREFECT_LOGGING_EXTRA_LOGGERS=eagle3) but leaves
# the `eagle3` logger at the root's level, WARNING, which dropped its INFO lines: a step reusing what the
# store holds, each validated training epoch, vLLM's engine starting. A level set before this import stays.
if logging.getLogger("eagle3").level == logging.NOTSET:
    logging.getLogger("eagle3").setLevel(logging.INFO)
