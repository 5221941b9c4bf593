"""Greedy speculative decoding with a transformers verifier: the measurement behind `evaluate`.

Each round the proposer drafts up to k tokens after the last confirmed token; the verifier
scores them in one forward pass (KV cache on) and keeps the longest prefix that matches its own
argmax, plus one token of its own. Output is therefore token-for-token what plain greedy
decoding produces; tau (tokens per verifier pass) is what the draft buys.

A proposer drafts from the context (and, for an EAGLE-3 draft, the verifier's aux hidden states,
which it is shown as they come): `NgramProposer` here (prompt lookup: the baseline that needs no
trained draft), `eagle3.evaluation.draft_proposer.Eagle3Proposer` for a trained draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eagle3.runtime.devices import inference_mode

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch

__all__ = ["DecodeStats", "NgramProposer", "greedy_decode", "speculative_decode"]


@dataclass
class DecodeStats:
    tokens: list[int]
    verifier_passes: int = 0
    accepted_per_pass: list[int] = field(default_factory=list)
    # fewer than k where the answer's end was nearer, 0 where n-gram found no match
    drafted_per_pass: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # until the host read the first token: the prompt's pass (prefill), which a draft cannot shorten. A
    # draft's own pass over the prompt comes after it, with the first round. None: recorded before it was
    first_token_seconds: float | None = None


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, propose what followed."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def reset(self) -> None:
        pass

    def observe(self, aux_states: torch.Tensor | None) -> None:
        pass

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k]
        return []


@inference_mode
def speculative_decode(forward, proposer, prompt: list[int], max_new_tokens: int, k: int, eos_ids: set[int]) -> DecodeStats:
    """Generate greedily with drafts from `proposer`; stops at an EOS token or `max_new_tokens`.
    `forward`: the verifier's (`eagle3.verifier.forward`), whose aux hidden states an EAGLE-3 proposer
    reads (none for n-gram).

    The host reads the device once a pass, drafts and verdict together: a proposer that drafts on
    the device hands its drafts over unread, the verifier's pass is queued behind its round, and the
    token the verifier adds is fed to the next pass from the device."""
    import torch

    start = time.perf_counter()
    forward.reset()
    proposer.reset()
    argmax, aux = forward(prompt)
    proposer.observe(aux)
    last = argmax[-1:]  # the last confirmed token, on the device: the next pass's first input
    context = [*prompt, int(last)]
    stats = DecodeStats(tokens=[context[-1]], first_token_seconds=time.perf_counter() - start)
    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in eos_ids:
        proposal = proposer.propose(context, min(k, max_new_tokens - len(stats.tokens)))  # host ids, or unread device ones
        drafts = torch.as_tensor(proposal, dtype=torch.long, device=last.device)
        argmax, aux = forward(torch.cat([last, drafts]))
        read = torch.cat([drafts, argmax]).tolist()
        drafted, verified = read[: len(drafts)], read[len(drafts) :]
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == verified[accepted]:
            accepted += 1
        new = [*drafted[:accepted], verified[accepted]]
        last = argmax[accepted : accepted + 1]
        forward.rollback(len(drafted) - accepted)
        proposer.observe(None if aux is None else aux[: accepted + 1])
        stats.verifier_passes += 1
        stats.accepted_per_pass.append(accepted)
        stats.drafted_per_pass.append(len(drafted))
        for token in new:
            if len(stats.tokens) >= max_new_tokens or stats.tokens[-1] in eos_ids:
                break
            stats.tokens.append(token)
            context.append(token)
    stats.seconds = time.perf_counter() - start
    return stats


@inference_mode
def greedy_decode(forward, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> DecodeStats:
    """Plain greedy decoding, one verifier pass per token: the reference output and speed. Each
    token is fed to the next pass from the device; the host reads it for the stop test."""
    start = time.perf_counter()
    forward.reset()
    last = forward(prompt)[0][-1:]
    tokens = [int(last)]
    first_token_seconds = time.perf_counter() - start
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        last = forward(last)[0]
        tokens.append(int(last))
    seconds = time.perf_counter() - start
    return DecodeStats(tokens=tokens, verifier_passes=len(tokens), seconds=seconds, first_token_seconds=first_token_seconds)
