"""An exported speculators EAGLE-3 draft as a proposer for `eagle3.evaluation.speculative`'s
decoding, run the way it was trained: step 0 from the verifier's aux hidden states, then its own
outputs.

`Eagle3Proposer` runs each step eagerly on transformers' cache: what a CPU runs. On a GPU that is
launch-bound (a draft step costs about 3 ms of Python and kernel launches, against 4.8 ms for a
graphed pass of SmolLM2-135M: `bench/results/`), so `StaticEagle3Proposer` runs the same steps on
fixed KV buffers, fused by torch.compile, and replays each round, all k steps and their argmaxes,
as one CUDA graph, as `eagle3.verifier.forward.StaticForward` replays the verifier's passes."""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache

from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.forward import FixedCache, Graphs, StaticForward, aux_states, decode_attention, decode_matmuls, drop_last

__all__ = ["Eagle3Proposer", "StaticEagle3Proposer", "draft_token_accuracy", "proposer_for"]

logger = logging.getLogger(__name__)


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
        if draft.sliding_window_indices:
            raise ValueError(
                "this draft has sliding-window layers, which the evaluation's own decoding does not run; "
                "measure it with evaluate.backend=vllm"
            )
        self.draft = draft.eval()
        self.reset()

    def reset(self) -> None:
        self.aux: list[torch.Tensor] = []  # aux states observed that step 0 has not run over yet
        self.cache = DynamicCache()  # step 0 over the confirmed context
        self.positions = 0  # how many positions the cache holds
        self.last: torch.Tensor | None = None  # step 0's output at the last of them

    def record_graphs(self, k: int) -> None:
        """Nothing to record: eager rounds (`StaticEagle3Proposer` replays graphs)."""

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

    def _features(self, aux: torch.Tensor) -> torch.Tensor:
        """The fc projection of aux states [1, m, 3H] to [1, m, H], after the draft's norms: one over
        the concatenation (norm_before_fc) or one per layer (EAGLE 3.1's fc_norm), as training runs them."""
        draft = self.draft
        if draft.input_norm is not None:
            aux = draft.input_norm(aux)
        if draft.fc_norm is not None:
            aux = torch.cat([norm(part) for norm, part in zip(draft.fc_norm, aux.chunk(len(draft.fc_norm), dim=-1), strict=True)], dim=-1)
        return draft.fc(aux)

    def _step_0(self, tokens: list[int], aux: torch.Tensor, start: int, cache):
        """TTT step 0 at positions start+1 .. start+m, after the `start` ones in `cache`: at the
        position of tokens[i] the draft reads embed(tokens[i]) and fc(aux[i]), the aux states of
        the token before it. Returns the layers' output [1, m, H]."""
        draft = self.draft
        m = aux.shape[0]
        assert m == len(tokens), (m, len(tokens))
        features = self._features(
            aux.reshape(1, m, -1).to(draft.fc.weight.device, draft.fc.weight.dtype)  # a spread verifier's last layer may sit elsewhere
        )
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

    def _chain(self, last_hidden, last_logits, k: int, advance) -> list[torch.Tensor]:
        """The k drafted tokens (verifier ids, each a [1] tensor on the device) after step 0's output:
        each chained step reads the token drafted before it and the state it came from; `advance(hidden,
        step)` runs the layers over one more position and the head: (the next state, its logits)."""
        draft = self.draft
        tokens = []
        for step in range(k):
            draft_id = last_logits[0, -1].argmax(-1, keepdim=True)
            tokens.append(draft_id + draft.d2t[draft_id])
            if step == k - 1:
                break
            hidden = torch.cat([draft.embed_tokens(tokens[-1][None]), last_hidden], dim=-1)
            last_hidden, last_logits = advance(hidden, step)
        return tokens

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> torch.Tensor:
        """The k drafted tokens after `context` (verifier ids [k], on the draft's device, unread)."""
        if self.aux:  # step 0 over the newly confirmed positions
            aux, self.aux = torch.cat(self.aux), []
            start = self.positions
            self.positions += aux.shape[0]
            assert self.positions == len(context) - 1, (self.positions, len(context))
            self.last = self._step_0(context[start + 1 :], aux, start, self.cache)[:, -1:]
        if self.last is None:
            raise ValueError("propose needs the aux states of the prompt first (observe)")
        n, device = self.positions, self.last.device

        def advance(hidden, step):
            return self._head(self._layers(hidden, None, torch.tensor([[n + 1 + step]], device=device), self.cache))

        last_hidden, last_logits = self._head(self.last)
        proposal = torch.cat(self._chain(last_hidden, last_logits, k, advance))
        drop_last(self.cache, self.cache.get_seq_length() - n)  # the chained steps' entries
        return proposal

    @torch.inference_mode()
    def first_tokens(self, sequence: list[int], aux: torch.Tensor) -> list[int]:
        """What the draft proposes first after each prefix `sequence[:i + 2]`, i = 0 .. len - 2, from
        one forward: teacher-forced, as validation's step-0 accuracy is measured. `aux`: the
        verifier's aux states of sequence[:-1]."""
        _, logits = self._head(self._step_0(sequence[1:], aux, 0, None))
        return self._to_verifier_ids(logits[0].argmax(-1))


class StaticEagle3Proposer(Eagle3Proposer):
    """`Eagle3Proposer` on fixed KV buffers of `max_len` positions, each position's entries at its
    own index (rotary position = index + 1, as step 0 places token x_{t+1} after x_t's states), every
    query masked to the indices at or before its own. On CUDA (`graphs`) each round after a
    sequence's first, whose step 0 runs over the whole prompt, replays a CUDA graph of the whole
    round for its shape (tokens confirmed since the last round, k): step 0, the k - 1 chained
    steps, their argmaxes and vocabulary mapping on the device, and the chained entries zeroed
    again. The k tokens stay on the device, where the verifier's pass reads them: the host waits for
    neither, and reads them with the verifier's verdict (`eagle3.evaluation.speculative`).

    A graph replays its kernels without Python, but each kernel still costs a few microseconds of
    GPU time, and an eager draft layer launches dozens of small ones (norms, rotary embedding,
    residuals). `compiled` (the default beside `graphs`) runs each step's layers and head through
    `torch.compile` (inductor), which fuses them into a few kernels before the round is captured
    (on an H100, three steps of a two-layer draft: 0.69 ms against 1.07; `bench/draft_speed.py`).
    Fused kernels round differently from eager ones, so a compiled draft may now and then propose
    another token; the verifier checks every draft, so the output does not change. Steps run with
    PyTorch's math attention (`decode_attention`) and cuBLASLt (`decode_matmuls`)."""

    def __init__(self, draft, max_len: int, graphs: bool | None = None, compiled: bool | None = None):
        device = draft.fc.weight.device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self.static_cache = FixedCache(max_len)
        self.columns = torch.arange(max_len, device=device)
        self.compiled = self.graphs if compiled is None else compiled
        self._rounds = Graphs(warm=self.compiled) if self.graphs else None  # by (tokens confirmed, k)
        self._compiled_step = torch.compile(self._step) if self.compiled else None
        super().__init__(draft)
        if self.compiled:
            self._compile()

    def reset(self) -> None:
        super().reset()
        self.cache = self.static_cache  # type: ignore[assignment]  # a transformers Cache, as DynamicCache is
        self.static_cache.clear(0)

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile the steps for every shape a round runs them at (step 0 over several positions, a
        chained step over one: one, two, then any number, as torch.compile specializes) on dummy
        inputs, so that no decode pays for it; then zero the buffers again. An eager round first
        allocates the buffers, which a compiled one writes into."""
        device, dtype = self.columns.device, self.draft.fc.weight.dtype
        for m, step in ((2, None), (2, self._compiled_step), (3, self._compiled_step)):
            tokens = torch.zeros(m, dtype=torch.long, device=device)
            with decode_matmuls(device):
                self._round(tokens, torch.zeros(m, self.draft.fc.in_features, device=device, dtype=dtype), self.columns[:m], 2, step)
        self.reset()

    def _mask(self, positions: torch.Tensor) -> torch.Tensor:
        dtype = self.draft.fc.weight.dtype
        mask = torch.full((len(positions), len(self.columns)), torch.finfo(dtype).min, dtype=dtype, device=positions.device)
        return mask.masked_fill_(self.columns[None, :] <= positions[:, None], 0.0)[None, None]  # [1, 1, q, max_len]

    def _step(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over `hidden` [1, q, 2H] at buffer `positions` [q], then the head at the last
        of them: (the state the next step reads, its logits)."""
        self.static_cache.positions = positions
        with decode_attention():
            hidden = self._layers(hidden, self._mask(positions), positions[None] + 1, self.static_cache)
        return self._head(hidden[:, -1:])

    def _round(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, k: int, step=None) -> torch.Tensor:
        """Step 0 over `tokens` [m] (each after the token whose aux states [m, 3H] it reads) at
        `positions` [m], then the chain: the k drafted tokens [k] (verifier ids). `step`: what runs
        each step's layers and head (`_step`, or its compiled form). Nothing here synchronizes with
        the host, so a round can be captured whole."""
        draft, step = self.draft, step or self._step
        hidden = torch.cat([draft.embed_tokens(tokens[None]), self._features(aux.reshape(1, len(tokens), -1))], dim=-1)
        n = positions[-1:] + 1  # the first chained step's position
        last_hidden, last_logits = step(hidden, positions)
        drafted = torch.cat(self._chain(last_hidden, last_logits, k, lambda hidden, i: step(hidden, n + i)))
        self.static_cache.clear_at(n + torch.arange(k - 1, device=n.device))  # the chained steps' entries
        return drafted

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> torch.Tensor:
        """The k drafted tokens after `context` (verifier ids [k], on the device, unread; on CUDA a
        round's graph's own output: read or copy it before the next round).

        Raises:
            ValueError: no new aux states since the last round (each verifier pass brings some), or the
            round would outgrow the `max_len` positions."""
        with decode_matmuls(self.columns.device):
            return self._propose(context, k)

    def _propose(self, context: list[int], k: int) -> torch.Tensor:
        if not self.aux:
            raise ValueError("propose needs the aux states of the tokens confirmed since the last round")
        aux, self.aux = torch.cat(self.aux), []
        m, start = aux.shape[0], self.positions
        self.positions += m
        assert self.positions == len(context) - 1, (self.positions, len(context))
        if self.positions + k - 1 > len(self.columns):
            raise ValueError(f"a draft round at {self.positions} + {k - 1} positions outgrows the KV buffers of {len(self.columns)}")
        device, dtype = self.columns.device, self.draft.fc.weight.dtype
        tokens, positions = torch.tensor(context[start + 1 :], device=device), self.columns[start : start + m]
        aux = aux.to(device, dtype).reshape(m, -1)
        if self._rounds is None or not start:  # a sequence's first round (the prompt) has a length of its own: no graph
            return self._round(tokens, aux, positions, k, self._compiled_step)
        return self._replay(tokens, aux, positions, k)

    def _replay(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        """`_round` as the graph of its shape (tokens confirmed, k), captured on first use."""
        return self._rounds(  # type: ignore[misc]  # only with graphs
            (len(tokens), k),
            lambda tokens, aux, positions: self._round(tokens, aux, positions, k, self._compiled_step),
            tokens=tokens,
            aux=aux,
            positions=positions,
        )

    @torch.inference_mode()
    def record_graphs(self, k: int) -> None:
        """Capture the round of every shape a decode at up to `k` drafted tokens replays: 1 .. k + 1
        tokens confirmed (the drafts accepted and the verifier's own), 1 .. k drafted (fewer where the
        answer's end is nearer), so that none is captured inside a timed decode; then start a new
        sequence. Nothing to record without graphs. Rounds that do not fit the buffers after a one-token
        prompt cannot come up in a decode either: they are left out."""
        if self._rounds is None:
            return
        device = self.columns.device
        with decode_matmuls(device):
            self._round(torch.zeros(1, dtype=torch.long, device=device), self._no_aux(1), self.columns[:1], 1, self._compiled_step)
            for m in range(1, k + 2):  # after a first round at position 0, as a decode's rounds follow the prompt's
                for drafted in range(1, min(k, len(self.columns) - m) + 1):  # step 0 at 1 .. m, the chain up to m + drafted - 1
                    self._replay(torch.zeros(m, dtype=torch.long, device=device), self._no_aux(m), self.columns[1 : m + 1], drafted)
        self.reset()

    def _no_aux(self, m: int) -> torch.Tensor:
        """Zero aux states of `m` tokens, [m, 3H], as `_propose` hands them to a round."""
        return torch.zeros(m, self.draft.fc.in_features, device=self.columns.device, dtype=self.draft.fc.weight.dtype)


def proposer_for(draft, forward, max_len: int) -> Eagle3Proposer:
    """The draft's proposer for decoding with `forward`: graphed rounds of compiled steps beside a
    graphed verifier (a GPU; uncompiled steps where torch.compile fails on this draft), else eager.
    `max_len`: the longest sequence decoded."""
    if not (isinstance(forward, StaticForward) and forward.graphs):
        return Eagle3Proposer(draft)
    try:
        return StaticEagle3Proposer(draft, max_len)
    except Exception:
        logger.warning("torch.compile failed on the draft's steps: its rounds replay them uncompiled (slower)", exc_info=True)
        return StaticEagle3Proposer(draft, max_len, compiled=False)


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
