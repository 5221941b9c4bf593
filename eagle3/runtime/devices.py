"""Devices: where a step runs, in what precision, which of this host's GPUs are free, and what
they hold. Every GPU step stands on these; nothing here imports the rest of the pipeline."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.runtime.locks import exclusive_if_free

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, torch only where a step runs
    import torch

logger = logging.getLogger(__name__)
GPU_LOCK_DIR = Path("/tmp/eagle3-gpu-locks")  # not under TMPDIR: runs with TMPDIRs of their own must meet at the same locks

__all__ = [
    "compute_dtype",
    "device_type",
    "free_device_memory",
    "gpu_count",
    "gpu_lock_names",
    "gpu_memory_bytes",
    "gpu_memory_used_mib",
    "host_gpu_ids",
    "host_gpu_uuids",
    "in_process_device",
    "inference_mode",
    "lock_free_gpus",
    "resolve_device",
]


def resolve_device(device: str) -> torch.device:
    """`auto`: CUDA where torch sees a GPU, else the CPU."""
    import torch

    return torch.device(device_type(device) if device == "auto" else device)


def device_type(device: str) -> str:
    """`resolve_device(device).type`, without importing torch (3 s on two cores) on a host with no
    GPU driver: cache keys ask it of every step, cached or not."""
    if device != "auto":
        return device.split(":")[0]
    return "cuda" if gpu_count() > 0 else "cpu"


def gpu_count() -> int:
    """The GPUs torch sees. Without a GPU driver's device files (NVIDIA's, ROCm's, WSL's) torch sees
    none, and is not imported to say so."""
    if not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return 0
    import torch

    return torch.cuda.device_count()


def inference_mode(fn):
    """`@torch.inference_mode()` that imports torch when `fn` runs, not when its module loads."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


def compute_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on accelerators; float32 on CPU, where bf16 matmuls fall back to torch's scalar
    reference kernel unless the CPU has AVX512-BF16 or AMX: several times slower than float32."""
    import torch

    return torch.float32 if device.type == "cpu" else torch.bfloat16


def free_device_memory(device) -> None:
    """Return what an attempt held to the device: collect the dropped tensors (an out-of-memory
    exception's frames pin them until collected), then empty torch's CUDA cache."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _nvidia_smi(fields: str, devices: list[str] | None) -> list[list[str]] | None:
    """`fields` of each of `devices` (None: of every GPU) as the driver reports them (nvidia-smi),
    without creating a CUDA context here: one row of stripped values per device; None where
    nvidia-smi is not available."""
    chosen = [] if devices is None else ["-i", ",".join(devices)]
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", *chosen],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]


def gpu_memory_used_mib(devices: list[str]) -> dict[str, int] | None:
    """Memory in use on each device (MiB, by index); None where nvidia-smi is not available."""
    rows = _nvidia_smi("index,uuid,memory.used", devices)
    return None if rows is None else {index: int(mib) for index, _uuid, mib in rows}


def gpu_memory_bytes(devices: list[str]) -> list[int] | None:
    """Each device's total memory in bytes; None where nvidia-smi is not available."""
    rows = _nvidia_smi("memory.total", devices)
    return None if rows is None else [int(mib) * 2**20 for (mib,) in rows]


@functools.cache
def host_gpu_uuids() -> tuple[str, ...]:
    """This host's GPUs' UUIDs in PCI bus order, which is CUDA's index order under
    CUDA_DEVICE_ORDER=PCI_BUS_ID (`eagle3 run` and the deployments set it); () without nvidia-smi.
    Asked once a process: a hung nvidia-smi costs one timeout, not one per claim."""
    rows = _nvidia_smi("pci.bus_id,uuid", None) or []
    return tuple(uuid for _, uuid in sorted(row for row in rows if len(row) == 2))


def gpu_lock_names(device: str) -> list[str]:
    """Every name of `device` (as CUDA_VISIBLE_DEVICES names it) that another run may have been told:
    an index and its GPU's UUID, a UUID (or a prefix of one, as CUDA takes) and its index. A MIG
    instance, or a device nvidia-smi does not list, has its own name only."""
    uuids = host_gpu_uuids()
    if device.isdigit() and int(device) < len(uuids):
        return [device, uuids[int(device)]]
    if device.startswith("GPU-") and len(matches := [i for i, uuid in enumerate(uuids) if uuid.startswith(device)]) == 1:
        return [str(matches[0]), uuids[matches[0]]]
    return [device]


def host_gpu_ids() -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES names them (respecting an existing restriction)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(gpu_count())]


def in_process_device(devices: list[str] | None, fallback: str) -> str:
    """The torch device for work that stays in this process: the first claimed GPU, indexed as this
    process sees it (`fallback` when nothing was claimed)."""
    return fallback if devices is None else f"cuda:{host_gpu_ids().index(devices[0])}"


@contextmanager
def _all_free(locks: list[Path]) -> Iterator[bool]:
    """Hold every one of `locks` or, where another process holds one, none of them."""
    with ExitStack() as held:
        if all(held.enter_context(exclusive_if_free(lock, remove=False)) for lock in locks):
            yield True
            return
        held.close()
        yield False


@contextmanager
def lock_free_gpus(candidates: list[str], count: int, lock_dir: Path | None = None, timeout_s: float | None = 3600) -> Iterator[list[str]]:
    """Hold `count` of `candidates` that no other process on this host holds, by a lock per name of
    each device (`gpu_lock_names`: a run told "0" and one told that GPU's UUID meet at a lock, as do
    runs where nvidia-smi answers and where it does not; `eagle3.runtime.locks`: dropped at once
    when a holder dies). Waits while too few are free, for `timeout_s` at most (None: as long as it
    takes, as a queue for the host's GPUs)."""
    if count > len(candidates):
        raise RuntimeError(f"{count} GPU(s) requested but this host has {len(candidates)}: {candidates}")
    lock_dir = lock_dir or GPU_LOCK_DIR
    locks = {device: [lock_dir / f"gpu-{name}.lock" for name in gpu_lock_names(device)] for device in candidates}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    waiting = False
    while True:
        with ExitStack() as held:
            devices: list[str] = []
            for device in candidates:
                if len(devices) < count and held.enter_context(_all_free(locks[device])):
                    devices.append(device)
            if len(devices) == count:
                yield devices
                return
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"no {count} free GPU(s) among {candidates} after {timeout_s:.0f} s (locks in {lock_dir})")
        if not waiting:
            logger.info("waiting for %d free GPU(s) among %s: other runs on this host hold them (locks in %s)", count, candidates, lock_dir)
            waiting = True
        time.sleep(1.0)
