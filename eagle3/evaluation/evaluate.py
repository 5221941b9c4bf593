"""Evaluate: measured acceptance length of the exported draft, by real speculative decoding.

For each prompt the verifier decodes `max_new_tokens` tokens greedily with the EAGLE-3 draft at
every k in `ks`, and plainly greedy next to them, and each output is compared token for token with
the plain greedy one of the baselines (`eagle3.evaluation.baseline`: plain greedy and n-gram prompt
lookup, measured once per verifier and prompts); the report counts any difference. The draft's
speed-up is over this step's own greedy decodes, not the baselines': baselines are cached, and a
cached one was timed at another time, perhaps on another host of the same GPU model, under another
load.

Output `report.json`: per method and k (the baselines' n-gram rows included), tau (tokens per
verifier pass) and its standard error over prompts, the acceptance rate of each draft position,
tokens/s and the speed-up over plain greedy decoding of the same prompts (each n-gram row over
the greedy decodes of its baselines run), and the number of prompts and tokens; at each k, what the draft adds over n-gram
(`gains_over_ngram`: the difference of the two taus and its standard error, paired over the same
prompts); plus the training-time simulated tau for comparison, and the draft's teacher-forced
first-token accuracy on the greedy outputs (`draft_token_accuracy`: what validation's step-0
accuracy would be on these prompts, counted per token rather than per verifier pass) and its
ceiling, the share of those tokens the draft vocabulary holds (`draft_vocab_coverage`: if low,
raise `vocab.draft_vocab_size`). `per_prompt.json`: each prompt's counts per method and k as tau
takes them (tokens: accepted draft tokens plus one per verifier pass; passes), in prompt order,
to break tau down by kind of prompt or compare two drafts on the same prompts. Cost: len(ks) + 1
decodes per prompt, and one forward of the verifier and the draft over each greedy output. Each
prompt's figures are appended to `done.jsonl` in the work dir as they finish (`eagle3.store.done_log`),
so a run killed midway resumes at its first undecoded prompt. On a GPU the verifier's passes and
the draft's rounds replay as CUDA graphs (`eagle3.verifier.forward.StaticForward`,
`eagle3.evaluation.draft_proposer.StaticEagle3Proposer`): tokens/s with the draft and without it
are measured on the same graphed verifier, as speculative decoding serves.

Backend `vllm` instead reads the same figures for the draft from a vLLM server that serves it
(`eagle3.evaluation.served_acceptance`), at the server's k, without the baselines (so without the gain over
n-gram and per-prompt counts).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import EvalConfig, VerifierConfig
from eagle3.data.prepare_dataset import SAMPLE_EVAL_PROMPTS
from eagle3.evaluation.baseline import (
    BaselineManifest,
    DecodingModel,
    baseline_provenance,
    chat_prompts,
    decode_remaining,
    decode_summary,
    eval_prompts,
    tokens_per_s,
)
from eagle3.evaluation.served_acceptance import measure_served_acceptance
from eagle3.evaluation.speculative import DecodeStats, greedy_decode, speculative_decode
from eagle3.evaluation.tau import PER_PROMPT, Counts, gain_over, per_prompt_counts, read_counts
from eagle3.runtime.attempts import NO_GPU, GpuClaim
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore, step_provenance
from eagle3.store.done_log import DONE_LOG, read_done
from eagle3.store.manifests import ArtifactManifest, Provenance
from eagle3.store.versions import route
from eagle3.training.export import ExportManifest
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.placement import decoding_placement
from eagle3.verifier.resolve_verifier import VerifierManifest

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch

__all__ = ["DraftDecodes", "EvalManifest", "eval_prompts_source", "evaluate", "evaluation_provenance", "load_draft", "summarize_decodes"]

logger = logging.getLogger(__name__)


class EvalManifest(ArtifactManifest):
    kind: str = "evaluation"
    num_prompts: int
    num_tokens: int
    tau_sim: float | None  # the checkpoint's (None: a draft trained elsewhere)
    results: list[dict]
    greedy_tokens_per_s: float | None  # the draft's rows' plain greedy (None: not measured, backend 'vllm')
    mismatches: int | None
    draft_token_accuracy: float | None = None  # teacher-forced step-0 accuracy on the greedy outputs (None: backend 'vllm')
    draft_vocab_coverage: float | None = None  # share of those drafted tokens inside the draft vocabulary (None: backend 'vllm')
    measured_on: str | None = None  # the device and verifier forward of the draft's decodes (None: backend 'vllm')
    greedy_measured_on: str | None = None  # where `greedy_tokens_per_s` was decoded: since evaluation 5, `measured_on`
    baselines_measured_on: str | None = None  # where the n-gram rows and their greedy were decoded (None: backend 'vllm')
    gains_over_ngram: list[dict] | None = None  # per k: draft tau minus n-gram tau, paired standard error (None: backend 'vllm')

    @property
    def greedy_on(self) -> str | None:
        """Where plain greedy was decoded (an evaluation from before `greedy_measured_on` was
        recorded is taken at its word: where the draft was)."""
        return self.greedy_measured_on or self.measured_on

    def speed_up(self, row: dict) -> float | None:
        """`row`'s (one of `results`) tokens/s over plain greedy's of the same prompts; None where
        either is unmeasured, or the two were decoded on different devices or verifier forwards.
        Rows hold their own since evaluation 5 (`decode_summary`); an earlier evaluation's are
        over the baselines' greedy."""
        if "speed_up" in row:
            return row["speed_up"]
        if not (row.get("tokens_per_s") and self.greedy_tokens_per_s) or self.greedy_on != self.measured_on:
            return None
        return row["tokens_per_s"] / self.greedy_tokens_per_s

    def counts(self, method: str, k: int) -> Counts | None:
        """Each prompt's (tokens, verifier passes) with `method` at k (None: not measured, or backend 'vllm')."""
        return read_counts(self.path, method, k)


def eval_prompts_source(cfg: EvalConfig) -> Path:
    """The prompts file (the GSM8K test sample shipped with the package when none is set)."""
    if cfg.prompts_path:
        path = Path(cfg.prompts_path).expanduser().resolve()
        if not path.is_file():
            raise ArtifactError(path, "evaluate.prompts_path does not exist or is not a file")
        return path
    return SAMPLE_EVAL_PROMPTS


def load_draft(checkpoint: Path, verifier_path: Path, device: torch.device, dtype: torch.dtype | None = None):
    """The exported draft, with its verifier weights read from the local verifier directory, in
    `dtype` (None: float32)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(checkpoint)
    config.speculators_config.verifier.name_or_path = str(verifier_path)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(checkpoint, config=config)
    return model.to(device, dtype or torch.float32).eval()


@dataclass(frozen=True)
class _Measured:
    results: list[dict]
    num_tokens: int
    greedy_tokens_per_s: float | None
    mismatches: int | None
    draft_token_accuracy: float | None = None
    draft_vocab_coverage: float | None = None
    measured_on: str | None = None
    greedy_measured_on: str | None = None
    baselines_measured_on: str | None = None
    gains_over_ngram: list[dict] | None = None
    per_prompt: dict[str, dict[int, list]] | None = None  # method -> k -> (tokens, passes) of each prompt


def _gain_row(k: int, draft: Counts, ngram: Counts) -> dict:
    gain, error = gain_over(draft, ngram)
    return {"k": k, "gain": gain, "standard_error": error}


def _decode_prompts(
    cfg: EvalConfig,
    device: str,
    checkpoint: ExportManifest,
    verifier: VerifierManifest,
    prompts: list[list[int]],
    references: list[list[int]],
    done: dict,
    done_log: Path,
    max_memory: dict | None = None,
) -> dict:
    """Decode every prompt not in `done` plainly greedy, then with the draft at each k, on `device`
    (the verifier's layers spread over the devices of `max_memory` where given; the draft on
    `device`) and measure the draft's first-token accuracy on the greedy output, appending each
    prompt to `done_log` as it finishes; all entries. Greedy runs on the forward the draft's
    decodes use, whose passes also copy the aux states out: a few small copies next to a pass."""
    import torch

    from eagle3.evaluation.draft_proposer import draft_token_accuracy, proposer_for

    on = DecodingModel.load(verifier, prompts, device, cfg.dtype, max_memory)
    model = load_draft(checkpoint.path, verifier.path, on.device, getattr(torch, cfg.dtype))
    capture = HiddenStateCapture(on.model.get_decoder(), list(model.config.eagle_aux_hidden_state_layer_ids))  # checked by export
    forward = on.forward(capture, cfg.max_new_tokens)
    longest = max(map(len, on.prompts)) + cfg.max_new_tokens + max(cfg.ks)  # with a round's chained steps
    draft = proposer_for(model, forward, longest)

    def decode(i: int) -> dict:
        prompt, reference = on.prompts[i], references[i]
        correct, drafted = draft_token_accuracy(on.model, capture, draft, prompt, reference)
        covered = draft.in_vocabulary(reference[1:])  # the positions draft_token_accuracy counts
        greedy = greedy_decode(forward, prompt, cfg.max_new_tokens, on.eos_ids)
        runs = {k: speculative_decode(forward, draft, prompt, cfg.max_new_tokens, k, on.eos_ids) for k in cfg.ks}
        return {
            "greedy": asdict(greedy),
            "runs": {str(k): asdict(run) for k, run in runs.items()},
            "correct": correct,
            "drafted": drafted,
            "covered": covered,
        }

    def record_graphs() -> None:
        forward.record_graphs(max(cfg.ks) + 1)
        draft.record_graphs(max(cfg.ks))

    try:
        return decode_remaining(len(on.prompts), forward, done, done_log, "evaluate", decode, record_graphs)
    finally:
        capture.close()


@dataclass(frozen=True)
class DraftDecodes:
    """The figures of the draft's decodes of some prompts, beside n-gram's decodes of the same ones."""

    results: list[dict]  # per k: tau, its standard error, acceptance by position, speed and speed-up (`decode_summary`)
    greedy_tokens_per_s: float  # of the plain greedy decodes beside the draft's
    mismatches: int  # decodes (greedy's and each k's) that differ from the greedy reference
    draft_token_accuracy: float | None  # None: nothing was drafted (every answer one token long)
    draft_vocab_coverage: float | None
    gains_over_ngram: list[dict]  # per k n-gram was measured at: the draft's gain, paired standard error
    counts: dict[int, Counts]  # per k: each prompt's (tokens, passes)


def summarize_decodes(ks: list[int], entries: list[dict], references: list[list[int]], ngram: dict[int, Counts]) -> DraftDecodes:
    """`entries`: the evaluation's logged prompts; `references`: their greedy outputs, and `ngram`
    (per k): n-gram's counts of the same prompts, in the same order."""
    greedy = [DecodeStats(**entry["greedy"]) for entry in entries]
    runs = {k: [DecodeStats(**entry["runs"][str(k)]) for entry in entries] for k in ks}
    correct, covered, drafted = (sum(entry[field] for entry in entries) for field in ("correct", "covered", "drafted"))
    counts = {k: per_prompt_counts(r) for k, r in runs.items()}
    return DraftDecodes(
        results=[decode_summary("eagle3", k, r, greedy) for k, r in runs.items()],
        greedy_tokens_per_s=tokens_per_s(greedy),
        mismatches=sum(run.tokens != reference for decodes in [greedy, *runs.values()] for run, reference in zip(decodes, references)),
        draft_token_accuracy=correct / drafted if drafted else None,
        draft_vocab_coverage=covered / drafted if drafted else None,
        gains_over_ngram=[_gain_row(k, counts[k], ngram[k]) for k in ks if k in ngram],
        counts=counts,
    )


def _summarize(cfg: EvalConfig, entries: list[dict], references: list[list[int]], baselines: BaselineManifest) -> _Measured:
    """The figures of the draft's decodes of every prompt (`entries`, in prompt order)."""
    ngram = {k: counts for k in cfg.ks if (counts := baselines.counts("ngram", k)) is not None}
    draft = summarize_decodes(cfg.ks, entries, references, ngram)
    if draft.mismatches:
        logger.warning("%d decodes differ from the baselines' plain greedy output (numerical ties?)", draft.mismatches)
    return _Measured(
        results=draft.results + baselines.results,
        num_tokens=baselines.num_tokens,
        greedy_tokens_per_s=draft.greedy_tokens_per_s,
        mismatches=draft.mismatches + baselines.mismatches,
        draft_token_accuracy=draft.draft_token_accuracy,
        draft_vocab_coverage=draft.draft_vocab_coverage,
        measured_on=entries[0]["measured_on"],
        greedy_measured_on=entries[0]["measured_on"],
        baselines_measured_on=baselines.measured_on,
        gains_over_ngram=draft.gains_over_ngram,
        per_prompt={"eagle3": draft.counts, "ngram": ngram},
    )


def _unmatched(baselines: BaselineManifest, store: ArtifactStore, cfg: EvalConfig, verifier: VerifierManifest, prompts: Path) -> list[str]:
    """The inputs and settings of `baselines` that differ from those this evaluation decodes with,
    among those their provenance records (the flow's record all: `baseline_provenance`)."""
    expected = baseline_provenance(store, cfg, verifier, prompts)
    differ = [f"parents.{name}" for name, digest in expected.parents.items() if baselines.parents.get(name, digest) != digest]
    return differ + [f"config.{name}" for name, value in expected.config.items() if baselines.config.get(name, value) != value]


def evaluation_provenance(
    store: ArtifactStore,
    cfg: EvalConfig,
    checkpoint: ExportManifest,
    verifier: VerifierManifest,
    prompts: Path,
    baselines: BaselineManifest | None,
) -> Provenance:
    """The step's provenance: a server's counters are keyed by its served model name, not by local code."""
    step = route("evaluation", cfg.backend, local="transformers")
    return step_provenance(step, store, cfg=cfg, checkpoint=checkpoint, verifier=verifier, prompts=prompts, baselines=baselines)


def evaluate(
    cfg: EvalConfig,
    checkpoint: ExportManifest,
    verifier: VerifierManifest,
    prompts_path: Path,
    store: ArtifactStore,
    provenance: Provenance,
    baselines: BaselineManifest | None = None,
    claim: GpuClaim = NO_GPU,
    placement: VerifierConfig | None = None,
) -> EvalManifest:
    """Measure tau of the draft: by our own speculative decoding, outputs checked against the plain
    greedy ones of `baselines` (the same verifier, prompts and settings) and reported beside their
    n-gram rows, or (backend 'vllm', no `baselines`) from a vLLM server's spec-decode counters,
    which has no baseline or greedy check (`greedy_tokens_per_s` and `mismatches` are None).

    `claim`: the CUDA device our own decoding runs on, claimed once this run holds the step (none
    claimed: `cfg.device`; of several, the verifier's layers spread over them by `placement`); the
    server backend claims nothing. Our own decoding logs each prompt as
    it finishes: a run killed midway resumes at the next prompt, and claims no GPU if none is left.

    Raises:
        ArtifactError: the prompts file or the log of finished prompts is malformed, the verifier's
            chat template refuses a prompt, the baselines are of other prompts, or the server
            rejected a prompt.
        ValueError: backend 'transformers' without `baselines`.
        EndpointError: (backend 'vllm') the server is unreachable, does not serve
            `endpoint.model`, or runs without a draft.
    """
    import torch

    if cfg.backend == "transformers" and baselines is None:
        raise ValueError("backend 'transformers' compares the draft with baselines: pass `baselines` (eagle3.evaluation.baseline)")
    if cfg.backend == "transformers" and baselines is not None and (differ := _unmatched(baselines, store, cfg, verifier, prompts_path)):
        raise ArtifactError(
            baselines.path,
            f"baselines measured otherwise than this evaluation decodes ({', '.join(differ)}): measure them with its settings",
        )
    texts = eval_prompts(prompts_path, cfg.num_prompts)
    prompts = chat_prompts(verifier, texts, prompts_path) if cfg.backend == "transformers" else None  # a server templates its own
    with store.step_work_dir(EvalManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        if cfg.backend == "vllm":
            row = measure_served_acceptance(cfg, texts, prompts_path)
            measured = _Measured(results=[row], num_tokens=row["tokens"], greedy_tokens_per_s=None, mismatches=None)
        else:
            assert baselines is not None and prompts is not None  # backend 'transformers': checked and templated above
            references = baselines.reference()
            if len(references) != len(texts):
                raise ArtifactError(baselines.path, f"baselines of {len(references)} prompts for an evaluation of {len(texts)}")
            done_log = work / DONE_LOG
            done = read_done(done_log, "prompt")
            if len(done) < len(texts):
                with clock.excluding_wait(claim()) as gpus:
                    device, max_memory = decoding_placement(verifier.path, gpus, placement, getattr(torch, cfg.dtype), cfg.device)
                    done = _decode_prompts(cfg, device, checkpoint, verifier, prompts, references, done, done_log, max_memory)
            measured = _summarize(cfg, [done[i] for i in range(len(texts))], references, baselines)
        report = {
            "results": measured.results,
            "tau_sim": checkpoint.tau_sim,
            "mismatches": measured.mismatches,
            "draft_token_accuracy": measured.draft_token_accuracy,
            "draft_vocab_coverage": measured.draft_vocab_coverage,
            "gains_over_ngram": measured.gains_over_ngram,
        }
        out = work / "artifact"
        out.mkdir(exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2, default=float))
        if measured.per_prompt is not None:
            (out / PER_PROMPT).write_text(json.dumps(measured.per_prompt))
        manifest = store.publish(
            out,
            EvalManifest(
                **provenance.model_dump(),
                path=out,
                num_prompts=len(texts),
                num_tokens=measured.num_tokens,
                tau_sim=checkpoint.tau_sim,
                results=measured.results,
                greedy_tokens_per_s=measured.greedy_tokens_per_s,
                mismatches=measured.mismatches,
                draft_token_accuracy=measured.draft_token_accuracy,
                draft_vocab_coverage=measured.draft_vocab_coverage,
                measured_on=measured.measured_on,
                greedy_measured_on=measured.greedy_measured_on,
                baselines_measured_on=measured.baselines_measured_on,
                gains_over_ngram=measured.gains_over_ngram,
                seconds=clock(),
            ),
        )
        shutil.rmtree(work)
        return manifest
