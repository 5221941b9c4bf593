"""GPU claims: a step that runs on CUDA first takes slots of the Prefect global concurrency limit
`gpu`, so concurrent flow runs never oversubscribe a host.

`strict=True`: a missing limit is an error, not a silent free-for-all. `eagle3 gpu-limit` creates it
with the host's GPU count. Slots of a killed holder return when its lease expires (~60 s with a
real server); `prefect gcl update gpu --active-slots 0` frees leaked ones by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency

from eagle3.extract_hidden_states import resolve_device

__all__ = ["GPU_LIMIT", "claim_gpus"]

GPU_LIMIT = "gpu"


@contextmanager
def claim_gpus(device: str, count: int = 1) -> Iterator[None]:
    """Hold `count` GPU slots while the block runs, if `device` resolves to CUDA; else nothing."""
    if resolve_device(device).type != "cuda":
        yield
        return
    try:
        with concurrency(GPU_LIMIT, occupy=count, strict=True):
            yield
    except ConcurrencySlotAcquisitionError as exc:
        raise RuntimeError(
            f"cannot claim {count} GPU slot(s) from the Prefect concurrency limit '{GPU_LIMIT}': {exc}. "
            "Create it once per server with `eagle3 gpu-limit` (it counts this host's GPUs)."
        ) from exc
