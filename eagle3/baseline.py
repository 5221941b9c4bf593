"""Baselines: what evaluation compares a draft with, measured once per verifier and prompts.

The verifier decodes each eval prompt (chat-templated) plainly greedy, which gives the reference
output every speculative decode must equal and the speed without a draft, and with n-gram prompt
lookup at every k in `ks`, which gives the tau of no training at all. None of it depends on the
draft, so it is an artifact of its own: evaluating a new draft for the same verifier, prompts and
decoding settings runs only the draft's decodes. The key holds the device type (CPU or CUDA) the
decodes run on, since the speeds are compared with the draft's; `measured_on` names the device.

Output `reference.json`: the greedy tokens of each prompt, in order; `per_prompt.json`: each
prompt's n-gram counts at each k as tau takes them (tokens: accepted draft tokens plus one per
verifier pass; passes), for the draft's gain measured on the same prompts (`eagle3.tau.gain_over`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3 import prepare_dataset, speculative, tau, verifier as verifier_module
from eagle3.config import EvalConfig
from eagle3.extract_hidden_states import resolve_device
from eagle3.isolation import NO_GPU, GpuClaim, in_process_device
from eagle3.prepare_dataset import read_user_turns
from eagle3.speculative import DecodeStats, NgramProposer, greedy_decode, speculative_decode
from eagle3.store import ArtifactError, ArtifactManifest, ArtifactStore, Provenance, Stopwatch
from eagle3.tau import PER_PROMPT, Counts, per_prompt_counts, read_counts, tau_from_counts, tau_standard_error
from eagle3.verifier import VerifierManifest, eos_token_ids, load_text_model, load_tokenizer

__all__ = ["BaselineManifest", "DecodingModel", "decode_summary", "device_name", "measure_baselines", "read_prompts"]

logger = logging.getLogger(__name__)
CODE_DEPENDENCIES = (speculative, prepare_dataset, verifier_module, tau)
REFERENCE = "reference.json"


class BaselineManifest(ArtifactManifest):
    kind: str = "baseline"
    num_prompts: int
    num_tokens: int
    greedy_tokens_per_s: float
    results: list[dict]  # n-gram decoding, one summary per k
    mismatches: int  # n-gram outputs that differ from plain greedy
    measured_on: str

    def reference(self) -> list[list[int]]:
        """The verifier's greedy tokens for each prompt."""
        return json.loads((self.path / REFERENCE).read_text())

    def counts(self, method: str, k: int) -> Counts | None:
        """Each prompt's (tokens, verifier passes) with `method` ('ngram') at k (None: not measured)."""
        return read_counts(self.path, method, k)


def read_prompts(path: Path, limit: int) -> list[str]:
    """The first user turn of each of the first `limit` records, in any prompt shape."""
    prompts = [users[0] for _, _, users in read_user_turns(path, limit)]
    if not prompts:
        raise ArtifactError(path, "no prompts")
    return prompts


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads"


@dataclass(frozen=True)
class DecodingModel:
    """The verifier as evaluation decodes with it, and the eval prompts as token ids."""

    model: torch.nn.Module
    device: torch.device
    eos_ids: set[int]
    prompts: list[list[int]]

    @classmethod
    def load(cls, verifier: VerifierManifest, texts: list[str], device: str, dtype: str) -> DecodingModel:
        tokenizer = load_tokenizer(verifier.path)
        resolved = resolve_device(device)
        model = load_text_model(verifier.path, getattr(torch, dtype), resolved)
        template = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], **template)["input_ids"] for t in texts]
        return cls(model, resolved, eos_token_ids(tokenizer, model), [list(p) for p in prompts])


def decode_summary(method: str, k: int, runs: list[DecodeStats]) -> dict:
    """tau (tokens per verifier pass) and its standard error over prompts, acceptance by draft
    position, speed and counts of `runs` (one per prompt)."""
    passes = [a for run in runs for a in run.accepted_per_pass]
    tokens, counts = sum(len(run.tokens) for run in runs), per_prompt_counts(runs)
    return {
        "method": method,
        "k": k,
        "tau": tau_from_counts(counts),
        "tau_standard_error": tau_standard_error(counts),
        "acceptance_by_position": [sum(a >= i for a in passes) / max(len(passes), 1) for i in range(1, k + 1)],
        "tokens_per_s": tokens / sum(run.seconds for run in runs),
        "verifier_passes": len(passes),
        "tokens": tokens,
    }


def measure_baselines(
    cfg: EvalConfig, verifier: VerifierManifest, prompts_path: Path, store: ArtifactStore, provenance: Provenance, claim: GpuClaim = NO_GPU
) -> BaselineManifest:
    """Decode the first `cfg.num_prompts` prompts plainly greedy and with n-gram lookup at each of
    `cfg.ks`, `cfg.max_new_tokens` tokens each, on the claimed GPU (none claimed: `cfg.device`).

    Raises:
        ArtifactError: the prompts file is malformed.
    """
    texts = read_prompts(prompts_path, cfg.num_prompts)
    with store.step_work_dir(BaselineManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        with clock.excluding_wait(claim()) as gpus:
            on = DecodingModel.load(verifier, texts, in_process_device(gpus, cfg.device), cfg.dtype)
            references, ngram, mismatches = [], {k: [] for k in cfg.ks}, 0
            for prompt in tqdm(on.prompts, desc="baselines", unit="prompt"):
                references.append(greedy_decode(on.model, prompt, cfg.max_new_tokens, on.eos_ids))
                for k in cfg.ks:
                    ngram[k].append(speculative_decode(on.model, None, NgramProposer(), prompt, cfg.max_new_tokens, k, on.eos_ids))
                    mismatches += ngram[k][-1].tokens != references[-1].tokens
        if mismatches:
            logger.warning("%d n-gram decodes differ from plain greedy decoding (numerical ties?)", mismatches)
        (work / REFERENCE).write_text(json.dumps([r.tokens for r in references]))
        (work / PER_PROMPT).write_text(json.dumps({"ngram": {k: per_prompt_counts(runs) for k, runs in ngram.items()}}))
        num_tokens = sum(len(r.tokens) for r in references)
        return store.publish(
            work,
            BaselineManifest(
                **provenance.model_dump(),
                path=work,
                num_prompts=len(texts),
                num_tokens=num_tokens,
                greedy_tokens_per_s=num_tokens / sum(r.seconds for r in references),
                results=[decode_summary("ngram", k, runs) for k, runs in ngram.items()],
                mismatches=mismatches,
                measured_on=device_name(on.device),
                seconds=clock(),
            ),
        )
