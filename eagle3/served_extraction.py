"""Hidden states from a vLLM server (`extract.backend=vllm`): how a verifier too large to load in
the step (a 70B dense model, a 1T-parameter MoE over tensor and expert parallelism) is extracted.

The server runs vLLM's `extract_hidden_states` speculative method with a hidden-states KV
connector (`server_args`, printed by `eagle3 extraction-server`): for each request it writes the
prompt's states at the given layers to a safetensors file, `hidden_states [seq, layers, H]` and
`token_ids`, and answers with the file's path. This module asks for one sample per request with
speculators' own response parsing and file lock, reads the file and removes it. The server must
write where this host reads (one host, or a shared filesystem). vLLM's stock connector copies
through CUDA streams; on a CPU-only server `eagle3.vllm_cpu_connector` stands in for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.data_generation.offline import check_hidden_states
from speculators.data_generation.vllm_client import InvalidResponseError, extract_output, wait_for_lock

from eagle3.config import EndpointConfig
from eagle3.endpoint import EndpointError, open_client, prefill

__all__ = ["CPU_CONNECTOR", "ServedStates", "server_args"]

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
CPU_CONNECTOR = "CpuHiddenStatesConnector"  # in eagle3/vllm_cpu_connector.py
_LOCK_TIMEOUT_S = 600.0  # the server holds a file's lock while it writes the file


def server_args(layer_ids: list[int], storage_dir: Path, cpu: bool = False) -> list[str]:
    """The `vllm serve` flags that make a server extract the states at `layer_ids` (the aux layers,
    then the final one: vLLM's state at layer n is the pre-norm output, as the draft needs) into
    files under `storage_dir`. `cpu`: the connector for a CPU-only server, which needs the
    repository on the server's PYTHONPATH."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    connector = {
        "kv_connector": CPU_CONNECTOR if cpu else STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    if cpu:
        connector["kv_connector_module_path"] = "eagle3.vllm_cpu_connector"
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(connector)]


class ServedStates:
    """A client of an extracting server, checked to serve `cfg.model`; `states` per sample."""

    def __init__(self, cfg: EndpointConfig, num_slots: int, hidden_size: int):
        self.cfg = cfg
        self.client = open_client(cfg)
        self.shape = (num_slots, hidden_size)

    def states(self, token_ids: list[int], sample: str) -> torch.Tensor:
        """The sample's states `[seq, num_slots, H]`, in the server's dtype.

        Raises:
            RequestRejected: the server refused the sample (longer than its `--max-model-len`).
            EndpointError: the server is unreachable, not set up to extract, or wrote a file this
                host cannot read or with the wrong layers.
        """
        response = prefill(self.client, self.cfg, token_ids)
        try:
            path, _ = extract_output(response, token_ids)
        except InvalidResponseError as exc:
            raise EndpointError(
                f"{self.cfg.base_url}: {sample}: {exc}. Is the server started with the flags of "
                "`eagle3 extraction-server` (method extract_hidden_states and a hidden-states connector)?"
            ) from exc
        try:
            if os.path.exists(path + ".lock"):
                wait_for_lock(path + ".lock", timeout=_LOCK_TIMEOUT_S)
            data = load_file(path)
            os.remove(path)
        except FileNotFoundError as exc:
            raise EndpointError(
                f"{self.cfg.base_url}: {sample}: the server wrote its states to {path}, which this host cannot "
                "read: its connector's shared_storage_path must be a directory both see."
            ) from exc
        try:
            check_hidden_states(data, token_ids)
        except ValueError as exc:
            raise EndpointError(f"{path} ({sample}, from {self.cfg.base_url}): {exc}") from exc
        states = data["hidden_states"]
        if tuple(states.shape[1:]) != self.shape:
            raise EndpointError(
                f"{path} ({sample}, from {self.cfg.base_url}): field 'hidden_states' holds {tuple(states.shape[1:])} "
                f"(layers, H) per token, expected {self.shape}: start the server with the flags of "
                "`eagle3 extraction-server`, for this verifier and extract.aux_layer_ids."
            )
        return states

