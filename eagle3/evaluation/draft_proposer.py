"""An exported speculators EAGLE-3 draft as a proposer for `eagle3.evaluation.speculative`'s
decoding, run the way it was trained: step 0 from the verifier's aux hidden states, then its own
outputs."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.forward import aux_states, drop_last

__all__ = ["Eagle3Proposer", "draft_token_accuracy"]


class Eagle3Proposer:
    """Runs a speculators `Eagle3DraftModel` autoregressively for k steps.

    Mirrors the model's training forward: at the position of token x_{t+1} the draft reads
    embed(x_{t+1}) and fc(aux states of x_t); each later step reads its previous output and the
    token it drafted. The draft's KV cache holds step 0 over every position whose aux states it has
    been shown, and while `propose` runs one entry per chained step: the attention pattern
    test-time training teaches. Step 0 runs once per position: each round extends the cache over
    the states observed since the last, and `propose` drops the chained entries before returning.
    """

    def __init__(self, draft):
        if draft.fc_norm is not None or draft.sliding_window_indices:
            raise ValueError(
                "this draft uses fc_norm or sliding-window layers, which the evaluation's own decoding does not "
                "run; measure it with evaluate.backend=vllm"
            )
        self.draft = draft.eval()
        self.reset()

    def reset(self) -> None:
        self.aux: list[torch.Tensor] = []  # aux states observed that step 0 has not run over yet
        self.cache = DynamicCache()  # step 0 over the confirmed context
        self.positions = 0  # how many positions the cache holds
        self.last: torch.Tensor | None = None  # step 0's output at the last of them

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's aux states [tokens, 3, H] from its latest pass, of the tokens it confirmed
        there: the context's last token it was fed and the drafts it accepted. They trail the context
        by one token, the verifier's own new one, whose states come with its next pass."""
        self.aux.append(states)

    def _layers(self, hidden, mask, position_ids, cache):
        """The draft's layers over `hidden`, at every position."""
        draft = self.draft
        position_embeddings = draft.rotary_emb(hidden, position_ids)
        for layer in draft.layers:
            hidden = layer(
                hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache, position_embeddings=position_embeddings
            )
        return hidden

    def _head(self, hidden):
        """The state the next TTT step reads, and the vocabulary logits (draft ids)."""
        draft = self.draft
        if draft.config.norm_output:
            hidden = draft.norm(hidden)
            return hidden, draft.lm_head(hidden)
        return hidden, draft.lm_head(draft.norm(hidden))

    def _step_0(self, tokens: list[int], aux: torch.Tensor, start: int, cache):
        """TTT step 0 at positions start+1 .. start+m, after the `start` ones in `cache`: at the
        position of tokens[i] the draft reads embed(tokens[i]) and fc(aux[i]), the aux states of
        the token before it. Returns the layers' output [1, m, H]."""
        draft = self.draft
        m = aux.shape[0]
        assert m == len(tokens), (m, len(tokens))
        features = aux.reshape(1, m, -1).to(
            draft.fc.weight.device, draft.fc.weight.dtype
        )  # a spread verifier's last layer may sit elsewhere
        if draft.input_norm is not None:
            features = draft.input_norm(features)
        features = draft.fc(features)  # [1, m, H]
        ids = torch.tensor([tokens], device=features.device)
        hidden = torch.cat([draft.embed_tokens(ids), features], dim=-1)
        position_ids = torch.arange(start + 1, start + m + 1, device=features.device).unsqueeze(0)
        if m == 1:  # one query sees every key: no mask, as for the chained steps
            return self._layers(hidden, None, position_ids, cache)
        causal = torch.full((m, start + m), float("-inf"), device=features.device, dtype=features.dtype).triu(start + 1)
        return self._layers(hidden, causal[None, None], position_ids, cache)

    def in_vocabulary(self, tokens: list[int]) -> int:
        """How many of `tokens` (verifier ids) the draft can propose at all: its vocabulary is the
        verifier's most frequent training tokens, so a token outside it is always a rejection."""
        return int(self.draft.t2d[torch.tensor(tokens, dtype=torch.long, device=self.draft.t2d.device)].sum())

    def _to_verifier_ids(self, draft_ids: torch.Tensor) -> list[int]:
        return (draft_ids + self.draft.d2t[draft_ids]).tolist()

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> list[int]:
        draft = self.draft
        if self.aux:  # step 0 over the newly confirmed positions
            aux, self.aux = torch.cat(self.aux), []
            start = self.positions
            self.positions += aux.shape[0]
            assert self.positions == len(context) - 1, (self.positions, len(context))
            self.last = self._step_0(context[start + 1 :], aux, start, self.cache)[:, -1:]
        n = self.positions
        last_hidden, last_logits = self._head(self.last)
        proposal = []
        for step in range(k):
            [token] = self._to_verifier_ids(last_logits[0, -1].argmax(-1, keepdim=True))
            proposal.append(token)
            if step == k - 1:
                break
            embeds = draft.embed_tokens(torch.tensor([[token]], device=last_hidden.device))
            hidden = torch.cat([embeds, last_hidden], dim=-1)
            position_ids = torch.tensor([[n + 1 + step]], device=last_hidden.device)
            last_hidden, last_logits = self._head(self._layers(hidden, None, position_ids, self.cache))
        drop_last(self.cache, self.cache.get_seq_length() - n)  # the chained steps' entries
        return proposal

    @torch.inference_mode()
    def first_tokens(self, sequence: list[int], aux: torch.Tensor) -> list[int]:
        """What the draft proposes first after each prefix `sequence[:i + 2]`, i = 0 .. len - 2, from
        one forward: teacher-forced, as validation's step-0 accuracy is measured. `aux`: the
        verifier's aux states of sequence[:-1]."""
        _, logits = self._head(self._step_0(sequence[1:], aux, 0, None))
        return self._to_verifier_ids(logits[0].argmax(-1))


@torch.inference_mode()
def draft_token_accuracy(
    model, capture: HiddenStateCapture, proposer: Eagle3Proposer, prompt: list[int], continuation: list[int]
) -> tuple[int, int]:
    """(correct, total) over the positions a draft is asked for (every generated token but the
    first): is the draft's first token after the true prefix the next token of `continuation`, the
    verifier's greedy output? Validation's step-0 accuracy, per token, on the eval prompts; measured
    acceptance counts per verifier pass instead, and passes start more often where drafting is hard."""
    sequence = prompt + continuation
    drafted = range(len(prompt) - 1, len(sequence) - 2)  # predicted[i] is the proposal for sequence[i + 2]
    if not drafted:
        return 0, 0
    model(input_ids=torch.tensor([sequence[:-1]], device=next(model.parameters()).device), use_cache=False)
    predicted = proposer.first_tokens(sequence, aux_states(capture))
    return sum(predicted[i] == sequence[i + 2] for i in drafted), len(drafted)
