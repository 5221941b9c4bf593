"""Requests to an OpenAI-compatible server (`vllm serve`), as the server backends use them.

A failed request is one of two things. The server rejected it (HTTP 400, 413 or 422: say, a prompt
longer than the served context): that is the record's failure, raised as `RequestRejected` with the
server's message, for the caller to list. Or the server could not answer (connection refused, time
out, 5xx, bad key, unknown model) after the client's own `max_retries` retries with back-off: no
record is to blame, so `EndpointError` stops the step and a re-run resumes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from eagle3.config import EndpointConfig

if TYPE_CHECKING:  # imported where a request is made: 2 s on two cores, for runs that never make one
    import openai
    from openai.types.chat import ChatCompletionMessageParam

__all__ = ["EndpointError", "RequestRejected", "ServedAnswer", "chat", "open_client", "request", "served_model"]


class EndpointError(RuntimeError):
    """The server is unreachable, failing, or does not serve the configured model."""


class RequestRejected(Exception):
    """The server refused this one request; the message is the server's."""


@dataclass(frozen=True)
class ServedAnswer:
    content: str
    reasoning: str | None  # servers with a reasoning parser return thinking apart from the answer
    finish_reason: str
    completion_tokens: int  # as the server counts them: vLLM includes the stop token


def open_client(cfg: EndpointConfig) -> tuple[openai.OpenAI, openai.types.Model]:
    """A client for `cfg.base_url`, and the server's listing of `cfg.model` (vLLM's holds its
    `max_model_len`), after checking that the server lists it.

    Raises:
        EndpointError: the server cannot be reached, or does not serve `cfg.model`.
    """
    import openai

    client = openai.OpenAI(
        base_url=cfg.base_url,
        api_key=os.environ.get(cfg.api_key_env) or "EMPTY",
        timeout=cfg.timeout_s,
        max_retries=cfg.max_retries,
    )
    try:
        served = list(client.models.list())
    except openai.APIError as exc:
        raise _unreachable(cfg, exc) from exc
    if (listing := next((m for m in served if m.id == cfg.model), None)) is None:
        raise EndpointError(
            f"{cfg.display_url}: endpoint.model is {cfg.model!r}, but the server serves {[m.id for m in served]}; "
            "set endpoint.model to the served model name (`vllm serve --served-model-name`)."
        )
    return client, listing


def chat(client: openai.OpenAI, cfg: EndpointConfig, messages: list[dict[str, str]], sampling: dict) -> ServedAnswer:
    """One chat completion of `messages` by the served model.

    Raises:
        RequestRejected: the server refused this request (its message says why).
        EndpointError: the server could not answer after the retries.
    """
    model = served_model(cfg)
    # Plain role/content dicts: openai types each role's message as its own TypedDict.
    params = cast("list[ChatCompletionMessageParam]", messages)
    response = request(cfg, lambda: client.chat.completions.create(model=model, messages=params, **sampling))
    choice = response.choices[0]
    message = choice.message
    reasoning = getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None)
    return ServedAnswer(
        content=message.content or "",
        reasoning=reasoning,
        finish_reason=choice.finish_reason,
        completion_tokens=response.usage.completion_tokens,
    )


def served_model(cfg: EndpointConfig) -> str:
    """`cfg.model`, which the config requires wherever a step sends requests to a server."""
    if cfg.model is None:
        raise EndpointError(f"{cfg.display_url}: endpoint.model is not set: the served model name (`vllm serve --served-model-name`)")
    return cfg.model


def request(cfg: EndpointConfig, send):
    """`send()`, with the server's refusal of this request told apart from its failing to answer."""
    import openai

    try:
        return send()
    except openai.APIStatusError as exc:
        if isinstance(exc, (openai.BadRequestError, openai.UnprocessableEntityError)) or exc.status_code == 413:
            raise RequestRejected(_server_message(exc)) from exc
        raise _unreachable(cfg, exc) from exc
    except openai.APIError as exc:
        raise _unreachable(cfg, exc) from exc


def _server_message(exc: openai.APIStatusError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    return f"HTTP {exc.status_code}: {body.get('message') or exc.message}"


def _unreachable(cfg: EndpointConfig, exc: openai.APIError) -> EndpointError:
    import openai

    hint = ""
    if isinstance(exc, openai.AuthenticationError):
        hint = f" Put the server's API key in ${cfg.api_key_env} (endpoint.api_key_env)."
    elif isinstance(exc, openai.NotFoundError):
        hint = f" Is {cfg.display_url} the API root (it usually ends in /v1)?"
    return EndpointError(
        f"{cfg.display_url}: the server did not answer after {cfg.max_retries} retries "
        f"(endpoint.max_retries, endpoint.timeout_s={cfg.timeout_s:g}): {type(exc).__name__}: {exc}.{hint}"
    )
