"""Which verifier forward decoding runs on: `StaticForward` (fixed KV buffers, CUDA graphs) where
it decodes exactly what transformers' own cache decodes, else `DynamicForward`.

The check decodes the first prompt both ways, plainly greedy and through partly rejected drafts,
before any timed decode: an architecture whose layers do not honour the fixed buffers, positions
and mask, or do not survive graph capture, shows it there, and decodes on the dynamic cache.
"""

from __future__ import annotations

import logging

from eagle3.evaluation.speculative import greedy_decode, speculative_decode
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.forward import DynamicForward, StaticForward, full_attention_only
from eagle3.verifier.loading import text_config

__all__ = ["PROBE_TOKENS", "decodes_like_dynamic", "forward_for"]

logger = logging.getLogger(__name__)


class _ReplayProposer:
    """Proposes, round by round, the reference continuation with its k-th token wrong (a pass of
    k + 1 tokens whose last draft is rolled back), with all but its first token wrong (k - 1 drafts
    rolled back), and nothing: a one-token pass, which first zeroes the forgotten entries it does not
    overwrite."""

    def __init__(self, reference: list[int], prompt_len: int):
        self.reference, self.prompt_len = reference, prompt_len
        self.rounds = 0

    def reset(self) -> None:
        self.rounds = 0

    def observe(self, aux_states) -> None:
        pass

    def propose(self, context: list[int], k: int) -> list[int]:
        right = self.reference[len(context) - self.prompt_len :][:k]
        self.rounds += 1
        kept = (len(right) - 1, 1, 0)[self.rounds % 3]
        return [*right[:kept], *(token - 1 if token else 1 for token in right[kept:])] if kept else []


PROBE_TOKENS = 12  # decoded from the probe prompt: enough passes of each kind to show a misplaced position


def decodes_like_dynamic(forward: StaticForward, probe: list[int], max_new_tokens: int = PROBE_TOKENS, k: int = 3) -> bool:
    """Whether `forward` decodes `probe` (a prompt) as `DynamicForward` does, plainly greedy and
    through partly rejected k-token drafts: a check that this architecture's layers honour the
    fixed buffers, positions and mask, and (on CUDA) survive graph capture."""
    expected = greedy_decode(DynamicForward(forward.model, None), probe, max_new_tokens, set()).tokens
    try:
        greedy = greedy_decode(forward, probe, max_new_tokens, set()).tokens
        drafted = speculative_decode(forward, _ReplayProposer(expected, len(probe)), probe, max_new_tokens, k, set()).tokens
    except Exception:
        logger.warning("decoding on fixed KV buffers failed on the first prompt", exc_info=True)
        return False
    return greedy == expected and drafted == expected


def forward_for(model, capture: HiddenStateCapture | None, max_len: int, probe: list[int]):
    """The fastest forward that decodes `model` exactly. On a GPU: `StaticForward` with CUDA graphs,
    for a full-attention verifier that decodes `probe` (a prompt) as transformers' own cache does.
    Otherwise `DynamicForward` (on a CPU, fixed buffers would only add attention over empty
    positions; layers spread over several devices run through accelerate's hooks). `max_len`: the longest sequence it will hold."""
    spread = len(set(getattr(model, "hf_device_map", {}).values())) > 1  # accelerate's hooks move weights and inputs: not capturable
    if next(model.parameters()).device.type == "cuda" and full_attention_only(text_config(model.config)) and not spread:
        forward = StaticForward(model, capture, max(max_len, len(probe) + PROBE_TOKENS))
        if decodes_like_dynamic(forward, probe):
            return forward
        logger.warning(
            "%s verifier: decoding on fixed KV buffers differs from transformers' dynamic cache on the first "
            "prompt; decoding on the dynamic cache instead",
            model.config.model_type,
        )
    return DynamicForward(model, capture)
