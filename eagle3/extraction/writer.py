"""Writing shard files off the critical path: device-to-host copies and file writes on worker
threads while the device computes the next batch."""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save

from eagle3.store.artifacts import ArtifactError
from eagle3.store.files import atomic_write_bytes

__all__ = ["OverlappedWriter"]


def _non_finite_per_slot(states: torch.Tensor) -> torch.Tensor:
    """[batch, seq, slots, H] -> [batch, slots] counts of NaN/Inf, computed where the states are."""
    return (~torch.isfinite(states)).sum(dim=(1, 3))


def _check_finite(path: Path, non_finite: torch.Tensor) -> None:
    if non_finite.any():
        raise ArtifactError(path, f"field 'hidden_states': non-finite values per layer slot {non_finite.tolist()}")


class OverlappedWriter:
    """Copies each batch's states to the host and writes its files on worker threads, so the
    device computes the next batch meanwhile. On CUDA the copy runs on its own stream; at most
    `max_pending` batches are in flight (each holds its states in device memory until copied)."""

    def __init__(self, device: torch.device, workers: int = 4, max_pending: int = 2):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hs-writer")
        self.pending: deque[Future] = deque()
        self.max_pending = max_pending
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.digests: dict[Path, str] = {}  # sha256 of each file, hashed from memory as written

    def submit(self, states: torch.Tensor, rows: list[tuple[Path, torch.Tensor]]) -> None:
        """`states` [batch, seq, 4, H] on the device; `rows`: (path, token ids) per batch row."""
        non_finite = _non_finite_per_slot(states)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()
            states.record_stream(self.stream)
            non_finite.record_stream(self.stream)
        self.pending.append(self.pool.submit(self._write, states, non_finite, event, rows))
        while len(self.pending) > self.max_pending:
            self.pending.popleft().result()

    def _write(self, states: torch.Tensor, non_finite: torch.Tensor, event, rows) -> None:
        if self.stream is not None:
            # Pinned destination: a copy to pageable memory cannot overlap the next batch's
            # kernels. torch's pinned allocator caches the blocks, so this is allocated once.
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(event)
                host = torch.empty(states.shape, dtype=torch.bfloat16, pin_memory=True)
                host.copy_(states, non_blocking=True)
                non_finite = non_finite.cpu()
            self.stream.synchronize()
        else:
            host = states.to(torch.bfloat16)
        for row, (path, token_ids) in enumerate(rows):
            _check_finite(path, non_finite[row])
            payload = save({"hidden_states": host[row, : len(token_ids)].contiguous(), "token_ids": token_ids})
            atomic_write_bytes(path, payload)  # on disk before the shard's done.json says so
            self.digests[path] = hashlib.sha256(payload).hexdigest()

    def drain(self) -> None:
        """Wait for every pending write; re-raise the first failure."""
        errors = []
        while self.pending:
            try:
                self.pending.popleft().result()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def discard(self) -> None:
        """Let every pending write finish, and forget them and their failures: they belong to a
        shard that failed and is redone from its start."""
        while self.pending:
            self.pending.popleft().exception()  # waits; never raises

    def close(self) -> None:
        self.pool.shutdown(wait=True)

