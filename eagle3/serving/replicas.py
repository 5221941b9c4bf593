"""Requests spread over several servers of one model (`vllm serve` on each of several hosts).

Each server has up to `concurrency` requests in flight; a free slot takes the next item. A server
that stops answering (`EndpointError`: no answer after its client's retries) is dropped with a
warning naming it, and the items it had in flight go back to the front of the queue for the
others: a server that dies mid-run loses only the work it was doing. The step fails only when
no server is left. A server that refuses one request (`RequestRejected`) is not dropped: that is
the item's failure, which `work` reports.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from eagle3.config import EndpointConfig
from eagle3.serving.endpoint import EndpointError, open_client

if TYPE_CHECKING:  # openai is imported where a request is sent, not where this module is loaded
    import openai

__all__ = ["Server", "open_servers", "spread"]

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


class Server(NamedTuple):
    """A server that answered at the start, and what its listing said."""

    endpoint: EndpointConfig
    client: openai.OpenAI
    max_model_len: int | None  # tokens a request takes, where the server says (vLLM's listing does)


def open_servers(endpoints: Sequence[EndpointConfig]) -> list[Server]:
    """A client for each endpoint that answers and serves its model; those that do not are left
    out with a warning, while one does.

    Raises:
        EndpointError: none of them answers (the first one's error).
    """
    servers, errors = [], []
    for endpoint in endpoints:
        try:
            client, listing = open_client(endpoint)
            servers.append(Server(endpoint, client, getattr(listing, "max_model_len", None)))
        except EndpointError as exc:
            errors.append(exc)
    if not servers:
        raise errors[0]
    for error in errors:
        log.warning("%s; continuing with the other %d server(s)", error, len(servers))
    return servers


def spread(items: Sequence[Item], servers: list[Server], work: Callable[[Item, Server], Result]) -> Iterator[Result]:
    """`work(item, server)` for every item, at most `endpoint.concurrency` at once per server;
    results as they finish. No request is sent while the caller holds a result, so at most as many
    results wait as there are requests in flight. A server that stops answering is also removed
    from `servers`, so that a later call (the next shard of a step) does not wait on it again.

    Raises:
        EndpointError: every server stopped answering; the items finished before are yielded.
    """
    given = list(servers)
    pending: deque[Item] = deque(items)
    alive = list(range(len(given)))
    load = [0] * len(given)
    in_flight: dict[Future, tuple[Item, int]] = {}
    with ThreadPoolExecutor(sum(server.endpoint.concurrency for server in given)) as pool:
        try:
            while pending or in_flight:
                for s in alive:
                    while pending and load[s] < given[s].endpoint.concurrency:
                        item = pending.popleft()
                        in_flight[pool.submit(work, item, given[s])] = (item, s)
                        load[s] += 1
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    item, s = in_flight.pop(future)
                    load[s] -= 1
                    try:
                        yield future.result()
                    except EndpointError as exc:
                        if s in alive:
                            alive.remove(s)
                            servers.remove(given[s])
                            if alive:
                                log.warning("%s; its requests in flight go to the other %d server(s)", exc, len(alive))
                        if not alive:
                            raise
                        pending.appendleft(item)
        finally:
            for future in in_flight:
                future.cancel()
