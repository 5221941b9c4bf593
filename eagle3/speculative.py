"""Greedy speculative decoding with a transformers verifier: the measurement behind `evaluate`.

Each round the proposer drafts up to k tokens after the last confirmed token; the verifier
scores them in one forward pass (KV cache on) and keeps the longest prefix that matches its own
argmax, plus one token of its own. Output is therefore token-for-token what plain greedy
decoding produces; tau (tokens per verifier pass) is what the draft buys.

Two proposers: `Eagle3Proposer` (an exported speculators EAGLE-3 checkpoint, run the way it was
trained: step 0 over the context from the verifier's aux hidden states, then its own outputs) and
`NgramProposer` (prompt lookup: the baseline that needs no trained draft).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from eagle3.extract_hidden_states import HiddenStateCapture

__all__ = ["DecodeStats", "Eagle3Proposer", "NgramProposer", "greedy_decode", "speculative_decode"]


@dataclass
class DecodeStats:
    tokens: list[int]
    verifier_passes: int = 0
    accepted_per_pass: list[int] = field(default_factory=list)
    seconds: float = 0.0


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, propose what followed."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def reset(self, prompt_len: int) -> None:
        pass

    def observe(self, aux_states: torch.Tensor) -> None:
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


class Eagle3Proposer:
    """Runs a speculators `Eagle3DraftModel` autoregressively for k steps.

    Mirrors the model's training forward: at the position of token x_{t+1} the draft reads
    embed(x_{t+1}) and fc(aux states of x_t); each later step reads its previous output and the
    token it drafted. The draft's KV cache holds step 0 over the whole context and one entry per
    chained step, which is the attention pattern test-time training teaches.
    """

    def __init__(self, draft):
        if draft.fc_norm is not None or draft.sliding_window_indices:
            raise ValueError(
                "this draft uses fc_norm or sliding-window layers, which the evaluation's own decoding does not "
                "run; measure it with evaluate.backend=vllm"
            )
        self.draft = draft.eval()
        self.aux: list[torch.Tensor] = []

    def reset(self, prompt_len: int) -> None:
        self.aux = []

    def observe(self, aux_states: torch.Tensor) -> None:
        """Aux hidden states [tokens, 3, H] of newly confirmed tokens, in order."""
        self.aux.append(aux_states)

    def _layers(self, hidden, mask, position_ids, cache):
        """The draft's layers over `hidden`; returns the last position's output state and logits
        (only the last position is drafted from, so only it goes through the vocabulary head)."""
        draft = self.draft
        position_embeddings = draft.rotary_emb(hidden, position_ids)
        for layer in draft.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                           position_embeddings=position_embeddings)
        last = hidden[:, -1:]
        if draft.config.norm_output:
            last = draft.norm(last)
            return last, draft.lm_head(last)
        return last, draft.lm_head(draft.norm(last))

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> list[int]:
        draft = self.draft
        aux = torch.cat(self.aux)  # [n_confirmed - 1 .. , 3, H]: states of context[:-1]
        n = aux.shape[0]
        assert n == len(context) - 1, (n, len(context))
        features = aux.reshape(1, n, -1).to(draft.fc.weight.dtype)
        if draft.input_norm is not None:
            features = draft.input_norm(features)
        features = draft.fc(features)  # [1, n, H]
        ids = torch.tensor([context[1:]], device=features.device)
        hidden = torch.cat([draft.embed_tokens(ids), features], dim=-1)
        position_ids = torch.arange(1, n + 1, device=features.device).unsqueeze(0)
        causal = torch.full((n, n), float("-inf"), device=features.device, dtype=features.dtype).triu(1)
        cache = DynamicCache()
        last_hidden, last_logits = self._layers(hidden, causal[None, None], position_ids, cache)
        proposal = []
        for step in range(k):
            draft_id = int(last_logits.argmax(-1))
            token = draft_id + int(draft.d2t[draft_id])
            proposal.append(token)
            if step == k - 1:
                break
            embeds = draft.embed_tokens(torch.tensor([[token]], device=features.device))
            hidden = torch.cat([embeds, last_hidden], dim=-1)
            position_ids = torch.tensor([[n + 1 + step]], device=features.device)
            last_hidden, last_logits = self._layers(hidden, None, position_ids, cache)
        return proposal


def _forward(model, capture, ids: list[int], cache, device):
    out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
    aux = capture.stacked()[0, :, :-1].float()  # [len(ids), 3, H]: aux slots only
    return out.logits[0].argmax(-1).tolist(), aux


@torch.inference_mode()
def speculative_decode(model, capture: HiddenStateCapture, proposer, prompt: list[int], max_new_tokens: int, k: int, eos_ids: set[int]) -> DecodeStats:
    """Generate greedily with drafts from `proposer`; stops at an EOS token or `max_new_tokens`."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    cache = DynamicCache()
    proposer.reset(len(prompt))
    argmax, aux = _forward(model, capture, prompt, cache, device)
    proposer.observe(aux)
    context = prompt + [argmax[-1]]
    stats = DecodeStats(tokens=[argmax[-1]])
    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in eos_ids:
        drafts = proposer.propose(context, min(k, max_new_tokens - len(stats.tokens)))
        argmax, aux = _forward(model, capture, [context[-1], *drafts], cache, device)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
            accepted += 1
        new = drafts[:accepted] + [argmax[accepted]]
        rejected = len(drafts) - accepted
        if rejected:
            cache.crop(-rejected)
        proposer.observe(aux[: accepted + 1])
        stats.verifier_passes += 1
        stats.accepted_per_pass.append(accepted)
        for token in new:
            if len(stats.tokens) >= max_new_tokens or stats.tokens[-1] in eos_ids:
                break
            stats.tokens.append(token)
            context.append(token)
    stats.seconds = time.perf_counter() - start
    return stats


@torch.inference_mode()
def greedy_decode(model, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> DecodeStats:
    """Plain greedy decoding, one verifier pass per token: the reference output and speed."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return DecodeStats(tokens=tokens, verifier_passes=len(tokens), seconds=time.perf_counter() - start)
