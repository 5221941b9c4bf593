"""Acceptance length as a vLLM server measures it: its Prometheus spec-decode counters.

The server runs the verifier with the draft (`vllm serve <verifier> --speculative-config
'{"method": "eagle3", "model": "<checkpoint>", "num_speculative_tokens": k}'`) and counts, over
all its requests, drafts (verifier passes that checked a draft), draft tokens, accepted tokens and
accepted tokens per draft position. The counters are read at `/metrics` before and after the
prompts are answered (greedy; after, once they stop changing: the server may count a request's last
step after answering it); the difference is this evaluation's as long as nothing else uses the
server meanwhile. Same arithmetic as `eagle3.evaluation.evaluate`: tau = 1 + accepted / drafts, and the
acceptance of position i is the share of drafts whose first i tokens were all accepted.
"""

from __future__ import annotations

import base64
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from prometheus_client.parser import text_string_to_metric_families

from eagle3.config import EndpointConfig, EvalConfig, redacted_url
from eagle3.serving.endpoint import EndpointError, RequestRejected, chat, open_client
from eagle3.store.artifacts import ArtifactError

__all__ = ["SpecDecodeCounters", "measure_served_acceptance", "metrics_url", "read_spec_decode_counters"]

_PREFIX = "vllm:spec_decode_num_"


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    accepted: float
    accepted_per_position: list[float]  # [k]

    def __sub__(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        return SpecDecodeCounters(
            self.drafts - earlier.drafts,
            self.accepted - earlier.accepted,
            [a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)],
        )


def metrics_url(cfg: EndpointConfig) -> str:
    """The server's Prometheus endpoint: `/metrics` beside the OpenAI API root."""
    return cfg.base_url.rstrip("/").removesuffix("/v1") + "/metrics"


def read_spec_decode_counters(cfg: EndpointConfig) -> SpecDecodeCounters:
    """The served model's spec-decode counters, summed over engines.

    Raises:
        EndpointError: `/metrics` is unreachable or has no spec-decode counters for `cfg.model`.
    """
    url = metrics_url(cfg)
    parts = urlsplit(url)
    request = urllib.request.Request(parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl())
    if parts.username is not None:  # urllib takes credentials as a header only
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        request.add_header("Authorization", f"Basic {base64.b64encode(credentials).decode()}")
    url = redacted_url(url)  # as messages show it
    try:
        with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
            text = response.read().decode()
    except OSError as exc:
        raise EndpointError(f"{url}: cannot read the server's metrics: {exc}") from exc
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(_PREFIX) or not sample.name.endswith("_total"):
                continue
            if sample.labels.get("model_name") != cfg.model:
                continue
            name = sample.name.removeprefix(_PREFIX).removesuffix("_total")
            if name == "accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    if "drafts" not in totals or not per_position:
        raise EndpointError(
            f"{url}: no spec-decode counters ({_PREFIX}drafts_total) for model {cfg.model!r}: the server does not "
            "serve it, or serves it without the draft. Start it with --speculative-config "
            '\'{"method": "eagle3", "model": "<checkpoint>", "num_speculative_tokens": 3}\'.'
        )
    return SpecDecodeCounters(
        totals["drafts"],
        totals.get("accepted_tokens", 0.0),
        [per_position[i] for i in sorted(per_position)],
    )


def _settled_counters(cfg: EndpointConfig, interval_s: float = 0.5, attempts: int = 20) -> SpecDecodeCounters:
    latest = read_spec_decode_counters(cfg)
    for _ in range(attempts):
        time.sleep(interval_s)
        previous, latest = latest, read_spec_decode_counters(cfg)
        if latest == previous:
            break
    return latest


def measure_served_acceptance(cfg: EvalConfig, prompts: list[str], prompts_path: Path) -> dict:
    """Answer `prompts` on the server and read the draft's acceptance from its counters.

    Returns:
        One result row shaped as `eagle3.evaluation.evaluate`'s: method, k (the server's), tau,
        tau_standard_error (None: the counters are totals, not per prompt), acceptance_by_position,
        drafts_by_position (every draft drafts k), tokens_per_s (all requests together), greedy_tokens_per_s
        and speed_up (None: the server decodes no plain greedy beside the draft), their `decode_` forms
        after the first token (None: the server's requests are timed whole), verifier_passes, tokens.

    Raises:
        EndpointError: the server is unreachable, does not serve `endpoint.model`, or has no draft.
        ArtifactError: the server rejected a prompt (too long for its context, say).
    """
    client, _ = open_client(cfg.endpoint)
    sampling = {"max_tokens": cfg.max_new_tokens, "temperature": 0.0}
    before = read_spec_decode_counters(cfg.endpoint)
    start = time.perf_counter()
    with ThreadPoolExecutor(cfg.endpoint.concurrency) as pool:
        futures = [pool.submit(chat, client, cfg.endpoint, [{"role": "user", "content": p}], sampling) for p in prompts]
        tokens = 0
        for index, future in enumerate(futures):
            try:
                tokens += future.result().completion_tokens
            except RequestRejected as exc:
                raise ArtifactError(prompts_path, f"prompt {index}: the server rejected it: {exc}") from exc
    seconds = time.perf_counter() - start
    counted = _settled_counters(cfg.endpoint) - before
    drafts = max(counted.drafts, 1.0)
    return {
        "method": "eagle3",
        "k": len(counted.accepted_per_position),
        "tau": 1 + counted.accepted / drafts,
        "tau_standard_error": None,
        "acceptance_by_position": [a / drafts for a in counted.accepted_per_position],
        "drafts_by_position": [int(counted.drafts)] * len(counted.accepted_per_position),
        "tokens_per_s": tokens / seconds,
        "greedy_tokens_per_s": None,
        "speed_up": None,
        "decode_tokens_per_s": None,
        "greedy_decode_tokens_per_s": None,
        "decode_speed_up": None,
        "verifier_passes": int(counted.drafts),
        "tokens": tokens,
    }
