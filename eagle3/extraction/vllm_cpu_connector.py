"""vLLM's hidden-states connector for a CPU-only server: loaded by the server, not the pipeline.

vLLM's `ExampleHiddenStatesConnector` copies each finished request's states out of the KV cache on
a CUDA stream into pinned memory and waits on CUDA events, so a CPU build of vLLM fails at the
first request. This subclass copies on the host and hands the write to the same writer threads
(which hold the file's lock until it is written); on a CUDA cache it is the stock connector.
The server imports it by `kv_connector_module_path` (`server_args(cpu=True)`), so the repository
must be on the server's PYTHONPATH. Imports vLLM: it runs in vLLM's environment only.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector"]


class _Copied:
    """Stands in for the stock connector's CUDA event: the host copy is done once it exists."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        tensors = {
            # indexing by slot copies: the cache blocks are reused once the request is reported finished
            "hidden_states": extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken when the request arrived
        if lock_fd is None and self.use_lock:  # as the stock connector does, should it not have been
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
