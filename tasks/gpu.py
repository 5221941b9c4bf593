"""GPU claims: a step that runs on CUDA takes slots of the Prefect global concurrency limit `gpu`
(on a persistent server; see below), so concurrent flow runs never oversubscribe a host, then picks
that many free devices of this host, which its child processes see as CUDA_VISIBLE_DEVICES. Tasks
hand `claim_gpus` to their step, which enters it after it holds its work directory
(`eagle3.runtime.attempts.GpuClaim` says when).

`strict=True`: a missing limit is an error, not a silent free-for-all. `eagle3 gpu-limit` creates it
with the host's GPU count. Slots are released when the step fails; those of a killed holder return
when its lease expires (`LEASE_SECONDS`; the holder renews it while alive), and `prefect gcl update gpu --active-slots 0`
frees leaked ones by hand. Device locks are per-host flocks, released by the kernel on kill.

Only a server that outlives the run returns a killed holder's slots: Prefect's lease reaper does
not run in a temporary server (the one `eagle3 run` starts, or Prefect's own), and the next run's
temporary server knows nothing of the dead one's leases, so the slots would stay taken in the
shared database for good and every later GPU step on the host would wait for them (a resumed GPU
run, after `timeout` had stopped the one before, waited 5 minutes, twice). With a temporary server
every run is on this host, so its device locks alone keep runs apart, and no slot is taken; a step
waits for them as long as it takes, as it waited for a slot.

The steps that run the verifier themselves claim `verifier.num_gpus` (`verifier_claim`; those that
decode with it in their own process only one where it fits one GPU, `decoding_claim`); how they use
them (a replica per GPU, or the layers spread over all) is theirs to decide, and changes no output:
their cache keys leave those settings out (`without_placement`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound

from eagle3.config import VerifierConfig
from eagle3.runtime.attempts import GpuClaim
from eagle3.runtime.devices import device_type, gpu_count, host_gpu_ids, lock_free_gpus
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.placement import gpus_to_decode
from eagle3.verifier.resolve_verifier import VerifierManifest
from tasks.temporary_server import TEMPORARY_API_URL

__all__ = [
    "GPU_LIMIT",
    "claim_gpus",
    "decoding_claim",
    "ensure_gpu_limit",
    "gpu_slots",
    "persistent_server",
    "set_gpu_limit",
    "verifier_claim",
    "without_placement",
]

GPU_LIMIT = "gpu"
LEASE_SECONDS = 60.0  # the server's minimum: a killed holder's slots return this soon


def persistent_server() -> bool:
    """Whether runs talk to a server that outlives them: PREFECT_API_URL names one, and not the
    temporary one `eagle3 run` started (with no URL Prefect starts a temporary one of its own)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return bool(url) and url != os.environ.get(TEMPORARY_API_URL)


@contextmanager
def gpu_slots(count: int) -> Iterator[None]:
    """Hold `count` slots of the server's `gpu` limit while the block runs; none with a temporary
    server (see the module's docstring)."""
    if not persistent_server():
        yield
        return
    try:
        with concurrency(GPU_LIMIT, occupy=count, strict=True, lease_duration=LEASE_SECONDS):
            yield
    except ConcurrencySlotAcquisitionError as exc:
        raise RuntimeError(
            f"cannot claim {count} GPU slot(s) from the Prefect concurrency limit '{GPU_LIMIT}': {exc}. "
            "Create it once per server with `eagle3 gpu-limit` (it counts this host's GPUs)."
        ) from exc


@contextmanager
def claim_gpus(device: str, count: int = 1) -> Iterator[list[str] | None]:
    """The claimed devices (CUDA_VISIBLE_DEVICES names) while the block runs, if `device` resolves
    to CUDA; else None and nothing is claimed."""
    if device_type(device) != "cuda":
        yield None
        return
    # With no slot taken (a temporary server) the device locks are the host's queue: no deadline.
    with gpu_slots(count), lock_free_gpus(host_gpu_ids(), count, timeout_s=3600 if persistent_server() else None) as devices:
        yield devices


def verifier_claim(device: str, placement: VerifierConfig | None) -> GpuClaim:
    """The claim of a step that runs the verifier itself: `placement.num_gpus` GPUs on CUDA (None: one)."""
    return partial(claim_gpus, device, placement.num_gpus if placement else 1)


@contextmanager
def _decoding_gpus(device: str, placement: VerifierConfig | None, verifier: Path, dtype: str) -> Iterator[list[str] | None]:
    import torch

    count = gpus_to_decode(verifier, placement, getattr(torch, dtype)) if device_type(device) == "cuda" else 1
    with claim_gpus(device, count) as devices:
        yield devices


def decoding_claim(device: str, placement: VerifierConfig | None, verifier: VerifierManifest, dtype: str) -> GpuClaim:
    """The claim of a step that decodes with the verifier in its own process (baselines, evaluation):
    one GPU where the verifier in `dtype` fits one, else `placement.num_gpus`, its layers spread."""
    return partial(_decoding_gpus, device, placement, verifier.path, dtype)


def without_placement(provenance: Callable[..., Provenance]) -> Callable[..., Provenance]:
    """A step's provenance from its task's inputs less `placement` (the verifier's GPU settings):
    where the verifier's layers sit changes no output, so it is no part of the key."""

    def keyed(store: ArtifactStore, placement: VerifierConfig | None = None, **inputs) -> Provenance:
        return provenance(store, **inputs)

    keyed.step_provenance = provenance  # type: ignore[attr-defined]  # what the step itself records: tests check they agree
    return keyed


def set_gpu_limit(slots: int) -> None:
    """Create or resize the server's `gpu` limit (`eagle3 gpu-limit`)."""
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, slots)


def ensure_gpu_limit(gpus: int | None = None) -> None:
    """Create the `gpu` limit with `gpus` slots (default: the GPUs this host sees) if a persistent
    server has none, so a GPU host's first `eagle3 run` needs no setup; an existing limit is left as
    its owner set it (`eagle3 gpu-limit`)."""
    if not persistent_server():
        return
    gpus = gpu_count() if gpus is None else gpus
    if gpus < 1:
        return
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, gpus)
            print(f"eagle3: created the Prefect concurrency limit '{GPU_LIMIT}' with {gpus} slot(s), one per GPU here", file=sys.stderr)
