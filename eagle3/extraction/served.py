"""Hidden states from a vLLM server (`extract.backend=vllm`): how a verifier too large to load in
the step (a 70B model over tensor parallelism, an MoE over expert parallelism) is extracted.

The server runs vLLM's `extract_hidden_states` speculative method with a hidden-states KV
connector (`server_args`, printed by `eagle3 extraction-server`): for each request it writes the
prompt's states at the given layers to a safetensors file, `hidden_states [seq, layers, H]` and
`token_ids`, and answers with the file's path. This module asks for one sample per request with
speculators' own response parsing and file lock, reads the file and removes it. Samples are spread
over several servers of the model where `extract.more_base_urls` lists more (one per host, say;
`eagle3.serving.replicas`): a server that stops answering loses only its requests in flight, which
the others answer again. Every server must write where this host reads (one host, or a filesystem
they share, mounted at the same path on each), into the states directory
(`extract.served_states_dir`): a path the server names is read and removed only if it lies inside
that directory once links are resolved, so a server (or whoever answers in its place) cannot make
this host read or delete any other file. The layers are fixed when the server starts; a file's
layer count and width are checked, not which layers they are. vLLM's stock connector copies
through CUDA streams; on a CPU-only server `eagle3.vllm_cpu_connector` stands in for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import ConfigError, EndpointConfig
from eagle3.serving.endpoint import EndpointError, RequestRejected, request, served_model
from eagle3.serving.replicas import Server, open_servers, spread

if TYPE_CHECKING:  # the step imports these when it runs: speculators alone takes 14 s to import on two cores
    import openai
    import torch

__all__ = ["ServedStates", "read_states", "server_args"]

Sample = tuple[int, str, list[int]]  # index in the dataset, record id, token ids

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
CPU_CONNECTOR = "CpuHiddenStatesConnector"  # in eagle3/extraction/vllm_cpu_connector.py
LOCK_TIMEOUT_S = 600.0  # the server holds a file's lock while it writes the file


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
        connector["kv_connector_module_path"] = "eagle3.extraction.vllm_cpu_connector"
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(connector)]


def read_states(
    path: str,
    token_ids: list[int],
    shape: tuple[int, int],
    source: str,
    storage: Path,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> torch.Tensor:
    """The states `[seq, *shape]` in the file a server wrote for `token_ids`, once its writer lets
    go of the file's lock; the file is removed whatever happens. `source` names the sample and
    server in errors; `storage` is the states directory the file must lie in.

    Raises:
        EndpointError: the path lies outside `storage` (nothing is read or removed), or the file
            cannot be read here (not shared, no permission, never written), or holds other tokens,
            non-finite values or another (layers, H) than `shape`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states

    path = _inside(path, storage, source)
    _wait_for_writer(path, source, lock_timeout_s)
    try:
        data = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise _unreadable(path, source, exc) from exc
    finally:
        _remove(path)
    try:
        check_hidden_states(data, token_ids)
    except ValueError as exc:
        raise EndpointError(f"{path} ({source}): {exc}") from exc
    states = data["hidden_states"]
    if tuple(states.shape[1:]) != shape:
        raise EndpointError(
            f"{path} ({source}): field 'hidden_states' holds {tuple(states.shape[1:])} (layers, H) per token, "
            f"expected {shape}: start the server with the flags of `eagle3 extraction-server`, for this "
            "verifier and extract.aux_layer_ids."
        )
    return states


def _inside(path: str, storage: Path, source: str) -> str:
    """`path`, links resolved, if it and its lock file lie inside `storage`.

    Raises:
        EndpointError: either lies elsewhere: the answer is not a states file this run asked for.
    """
    root = os.path.realpath(storage)
    resolved = os.path.realpath(path)
    for candidate in (resolved, os.path.realpath(path + ".lock")):
        if os.path.commonpath([root, candidate]) != root or candidate == root:
            raise EndpointError(
                f"{path} ({source}): the server named a file outside the states directory {root} "
                "(extract.served_states_dir), links resolved; it was neither read nor removed. Start the server "
                "with the flags `eagle3 extraction-server` prints for this configuration (its shared_storage_path), "
                "and make sure the base_url is that server."
            )
    return resolved


def _wait_for_writer(path: str, source: str, lock_timeout_s: float) -> None:
    """Return once the server's writer has let go of the file's lock.

    Raises:
        EndpointError: the lock is still held after `lock_timeout_s` (the file is left to its
            writer: removed now, it would be written afterwards and never removed), or cannot be
            opened here (the file and its lock are removed).
    """
    from speculators.data_generation.vllm_client import wait_for_lock

    try:
        if os.path.exists(path + ".lock"):
            wait_for_lock(path + ".lock", timeout=lock_timeout_s)
    except TimeoutError as exc:
        raise EndpointError(
            f"{path} ({source}): the server still held {path}.lock after {lock_timeout_s:g} s; delete the "
            "file and its lock once the server is done with it."
        ) from exc
    except OSError as exc:
        _remove(path)
        raise _unreadable(path, source, exc) from exc


def _unreadable(path: str, source: str, exc: Exception) -> EndpointError:
    return EndpointError(
        f"{path} ({source}): {type(exc).__name__}: {exc}. The server's connector writes there "
        "(shared_storage_path): it must be a directory this host sees and may write, with files "
        "this user may read (run the server as the same user); the server's log says whether it "
        "failed to write the file."
    )


def _remove(path: str) -> None:
    for leftover in (path, path + ".lock"):
        with suppress(OSError):
            os.remove(leftover)


def prefill(client: openai.OpenAI, cfg: EndpointConfig, token_ids: list[int]):
    """A one-token completion of the prompt `token_ids`, answered with the prompt's ids: how an
    extracting server is asked for a sample's states.

    Raises:
        RequestRejected: the server refused this request (its message says why).
        EndpointError: the server could not answer after the retries.
    """
    model = served_model(cfg)
    return request(
        cfg,
        lambda: client.completions.create(model=model, prompt=token_ids, max_tokens=1, extra_body={"return_token_ids": True}),
    )


def _too_long(record_id: str, index: int, num_tokens: int, reason: str) -> ConfigError:
    return ConfigError(
        f"record {record_id!r} (sample {index}, {num_tokens} tokens): {reason}. Serve with a --max-model-len "
        "above dataset.max_seq_len, or lower dataset.max_seq_len."
    )


class ServedStates:
    """Clients of extracting servers of one model (`eagle3.serving.replicas`), each checked to serve
    it, that all write their files into `storage`; `extract` spreads samples over them."""

    def __init__(self, endpoints: Sequence[EndpointConfig], num_slots: int, hidden_size: int, storage: Path):
        self.storage = storage
        self.servers = open_servers(endpoints)
        self.shape = (num_slots, hidden_size)

    def check_fit(self, samples: list[Sample]) -> None:
        """Name the first sample longer than a server takes (with the one token it answers) before
        any request, not hours into the step: any sample may go to any server, so the smallest
        context any server reports bounds them all.

        Raises:
            ConfigError: a sample is too long for a server's context.
        """
        listed = [(server.max_model_len, server) for server in self.servers if server.max_model_len is not None]
        if not listed:
            return
        limit, smallest = min(listed, key=lambda pair: pair[0])
        which = "the server" if len(self.servers) == 1 else f"the server {smallest.endpoint.display_url} (of {len(self.servers)})"
        for index, record_id, token_ids in samples:
            if len(token_ids) >= limit:
                reason = f"{which} takes {limit} tokens a request, the sample and one answered token"
                raise _too_long(record_id, index, len(token_ids), reason)

    def extract(self, samples: list[Sample], write: Callable[[int, torch.Tensor], None]) -> None:
        """`write(index, states)` for each sample as its answer arrives (in any order),
        `endpoint.concurrency` requests in flight per server (`spread`): no more answers wait in
        memory than there are requests in flight, since none is sent while `write` runs. A server
        that stops answering, or whose answers cannot be read here, is dropped with a warning (for
        the later shards too) and its samples in flight go to the others. At the first other
        failure the requests not yet sent are dropped and the failure is raised.

        Raises:
            ConfigError: a server refused a sample (longer than its context), named.
            EndpointError: as `states`, from the last server left.
        """

        def states(sample: Sample, server: Server) -> tuple[int, torch.Tensor]:
            index, record_id, token_ids = sample
            try:
                return index, self.states(server, token_ids, f"record {record_id!r}")
            except RequestRejected as exc:
                raise _too_long(record_id, index, len(token_ids), f"the server refused it: {exc}") from exc

        for index, answer in spread(samples, self.servers, states):
            write(index, answer)

    def states(self, server: Server, token_ids: list[int], sample: str) -> torch.Tensor:
        """The sample's states `[seq, num_slots, H]` from `server`, in the server's dtype.

        Raises:
            RequestRejected: the server refused the sample (longer than its context).
            EndpointError: the server is unreachable or not set up to extract, or its file cannot
                be read here or holds something else (`read_states`).
        """
        from speculators.data_generation.vllm_client import InvalidResponseError, extract_output

        response = prefill(server.client, server.endpoint, token_ids)
        try:
            path, _ = extract_output(response, token_ids)
        except InvalidResponseError as exc:
            if written := (getattr(response, "kv_transfer_params", None) or {}).get("hidden_states_path"):
                with suppress(EndpointError):  # states of other tokens: unread, removed once written (if ours)
                    written = _inside(written, self.storage, sample)
                    _wait_for_writer(written, sample, LOCK_TIMEOUT_S)
                    _remove(written)
            raise EndpointError(
                f"{server.endpoint.display_url}: {sample}: {exc}. Is the server started with the flags of "
                "`eagle3 extraction-server` (method extract_hidden_states and a hidden-states connector)?"
            ) from exc
        return read_states(path, token_ids, self.shape, f"{sample}, from {server.endpoint.display_url}", self.storage)
