"""Evaluate: measured acceptance length of the exported draft, by real speculative decoding.

For each prompt (chat-templated, greedy), the verifier decodes `max_new_tokens` tokens three
ways: plain greedy (reference output and speed), with the EAGLE-3 draft, and with n-gram prompt
lookup (the no-training baseline), each draft method at every k in `ks`. Every speculative output
is compared token for token with the plain one; the report counts any difference.

Output `report.json`: per method and k, tau (tokens per verifier pass), the acceptance rate of
each draft position, tokens/s, and the number of prompts and tokens; plus the training-time
simulated tau for comparison, and the draft's teacher-forced first-token accuracy on the greedy
outputs (`draft_token_accuracy`: what validation's step-0 accuracy would be on these prompts,
counted per token rather than per verifier pass) and its ceiling, the share of those tokens the
draft vocabulary holds (`draft_vocab_coverage`: if low, raise `vocab.draft_vocab_size`). Cost:
(1 + 2 x len(ks)) decodes per prompt, and one forward of the verifier and the draft over each
greedy output.

Backend `vllm` instead reads the same figures for the draft from a vLLM server that serves it
(`eagle3.served_acceptance`), at the server's k, without the baselines.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3 import endpoint, prepare_dataset, served_acceptance, speculative, verifier as verifier_module
from eagle3.config import EvalConfig
from eagle3.export import ExportManifest
from eagle3.extract_hidden_states import HiddenStateCapture, HiddenStatesManifest, resolve_device
from eagle3.isolation import NO_GPU, GpuClaim, in_process_device
from eagle3.prepare_dataset import read_user_turns
from eagle3.served_acceptance import measure_served_acceptance
from eagle3.speculative import DecodeStats, Eagle3Proposer, NgramProposer, draft_token_accuracy, greedy_decode, speculative_decode
from eagle3.store import ArtifactError, ArtifactManifest, ArtifactStore, Provenance, Stopwatch
from eagle3.verifier import VerifierManifest, eos_token_ids, load_text_model, load_tokenizer

__all__ = ["EvalManifest", "eval_prompts_source", "evaluate", "load_draft", "read_prompts"]

logger = logging.getLogger(__name__)
# What else computes the numbers: a change to any of them re-measures.
CODE_DEPENDENCIES = (speculative, served_acceptance, endpoint, prepare_dataset, verifier_module)


class EvalManifest(ArtifactManifest):
    kind: str = "evaluation"
    num_prompts: int
    num_tokens: int
    tau_sim: float
    results: list[dict]
    greedy_tokens_per_s: float | None  # None: not measured (backend 'vllm')
    mismatches: int | None
    draft_token_accuracy: float | None = None  # teacher-forced step-0 accuracy on the greedy outputs (None: backend 'vllm')
    draft_vocab_coverage: float | None = None  # share of those drafted tokens inside the draft vocabulary (None: backend 'vllm')


def eval_prompts_source(cfg: EvalConfig) -> Path:
    """The prompts file (the GSM8K test sample shipped with the package when none is set)."""
    if cfg.prompts_path:
        return Path(cfg.prompts_path).expanduser().resolve()
    return Path(__file__).parent / "data" / "sample_eval_prompts.jsonl"


def read_prompts(path: Path, limit: int) -> list[str]:
    """The first user turn of each of the first `limit` records, in any prompt shape."""
    prompts = [users[0] for _, _, users in read_user_turns(path, limit)]
    if not prompts:
        raise ArtifactError(path, "no prompts")
    return prompts


def load_draft(checkpoint: Path, verifier_path: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """The exported draft, with its verifier weights read from the local verifier directory."""
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(checkpoint)
    config.speculators_config.verifier.name_or_path = str(verifier_path)
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001  (not serialized)
    model = Eagle3DraftModel.from_pretrained(checkpoint, config=config)
    return model.to(device, dtype).eval()


def _summary(method: str, k: int, runs: list[DecodeStats]) -> dict:
    passes = [a for run in runs for a in run.accepted_per_pass]
    tokens = sum(len(run.tokens) for run in runs)
    seconds = sum(run.seconds for run in runs)
    return {
        "method": method,
        "k": k,
        "tau": (sum(passes) + len(passes)) / max(len(passes), 1),
        "acceptance_by_position": [sum(a >= i for a in passes) / max(len(passes), 1) for i in range(1, k + 1)],
        "tokens_per_s": tokens / seconds,
        "verifier_passes": len(passes),
        "tokens": tokens,
    }


@dataclass(frozen=True)
class _Measured:
    results: list[dict]
    num_tokens: int
    greedy_tokens_per_s: float | None
    mismatches: int | None
    draft_token_accuracy: float | None
    draft_vocab_coverage: float | None


def _measure_by_own_decoding(
    cfg: EvalConfig, checkpoint: ExportManifest, hidden_states: HiddenStatesManifest, verifier: VerifierManifest, texts: list[str]
) -> _Measured:
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(verifier.path)
    dtype = getattr(torch, cfg.dtype)
    model = load_text_model(verifier.path, dtype, device)
    capture = HiddenStateCapture(model.get_decoder(), hidden_states.aux_layer_ids)
    draft = Eagle3Proposer(load_draft(checkpoint.path, verifier.path, device, dtype))
    eos_ids = eos_token_ids(tokenizer, model)

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for p in texts
    ]
    runs: dict[tuple[str, int], list[DecodeStats]] = {}
    reference_runs, mismatches, correct, covered, drafted = [], 0, 0, 0, 0
    try:
        for prompt in tqdm(prompts, desc="evaluate", unit="prompt"):
            reference = greedy_decode(model, list(prompt), cfg.max_new_tokens, eos_ids)
            reference_runs.append(reference)
            right, total = draft_token_accuracy(model, capture, draft, list(prompt), reference.tokens)
            correct, drafted = correct + right, drafted + total
            covered += draft.in_vocabulary(reference.tokens[1:])  # the positions draft_token_accuracy counts
            for method, proposer in (("eagle3", draft), ("ngram", NgramProposer())):
                for k in cfg.ks:
                    run = speculative_decode(model, capture, proposer, list(prompt), cfg.max_new_tokens, k, eos_ids)
                    mismatches += run.tokens != reference.tokens
                    runs.setdefault((method, k), []).append(run)
    finally:
        capture.close()
    if mismatches:
        logger.warning("%d speculative decodes differ from plain greedy decoding (numerical ties?)", mismatches)
    num_tokens = sum(len(r.tokens) for r in reference_runs)
    return _Measured(
        results=[_summary(method, k, r) for (method, k), r in runs.items()],
        num_tokens=num_tokens,
        greedy_tokens_per_s=num_tokens / sum(r.seconds for r in reference_runs),
        mismatches=mismatches,
        draft_token_accuracy=correct / drafted if drafted else None,
        draft_vocab_coverage=covered / drafted if drafted else None,
    )


def evaluate(
    cfg: EvalConfig,
    checkpoint: ExportManifest,
    hidden_states: HiddenStatesManifest,
    verifier: VerifierManifest,
    prompts_path: Path,
    store: ArtifactStore,
    provenance: Provenance,
    claim: GpuClaim = NO_GPU,
) -> EvalManifest:
    """Measure tau of the draft: by our own speculative decoding (with the n-gram baseline, outputs
    checked against plain greedy), or (backend 'vllm') from a vLLM server's spec-decode counters,
    which has no baseline or greedy check (`greedy_tokens_per_s` and `mismatches` are None).

    `claim`: the CUDA device our own decoding runs on, claimed once this run holds the step (none
    claimed: `cfg.device`); the server backend claims nothing.

    Raises:
        ArtifactError: the prompts file is malformed, or the server rejected a prompt.
        EndpointError: (backend 'vllm') the server is unreachable, does not serve
            `endpoint.model`, or runs without a draft.
    """
    texts = read_prompts(prompts_path, cfg.num_prompts)
    with store.step_work_dir(EvalManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        if cfg.backend == "vllm":
            row = measure_served_acceptance(cfg, texts, prompts_path)
            measured = _Measured(results=[row], num_tokens=row["tokens"], greedy_tokens_per_s=None, mismatches=None,
                                 draft_token_accuracy=None, draft_vocab_coverage=None)
        else:
            with clock.excluding_wait(claim()) as gpus:
                on_device = cfg.model_copy(update={"device": in_process_device(gpus, cfg.device)})
                measured = _measure_by_own_decoding(on_device, checkpoint, hidden_states, verifier, texts)
        report = {"results": measured.results, "tau_sim": checkpoint.tau_sim, "mismatches": measured.mismatches,
                  "draft_token_accuracy": measured.draft_token_accuracy, "draft_vocab_coverage": measured.draft_vocab_coverage}
        (work / "report.json").write_text(json.dumps(report, indent=2, default=float))
        return store.publish(
            work,
            EvalManifest(
                **provenance.model_dump(),
                path=work,
                num_prompts=len(texts),
                num_tokens=measured.num_tokens,
                tau_sim=checkpoint.tau_sim,
                results=measured.results,
                greedy_tokens_per_s=measured.greedy_tokens_per_s,
                mismatches=measured.mismatches,
                draft_token_accuracy=measured.draft_token_accuracy,
                draft_vocab_coverage=measured.draft_vocab_coverage,
                seconds=clock(),
            ),
        )
