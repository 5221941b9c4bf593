"""Baselines: what evaluation compares a draft with, measured once per verifier and prompts.

The verifier decodes each eval prompt (chat-templated) plainly greedy, which gives the reference
output every speculative decode must equal and the speed without a draft, and with n-gram prompt
lookup at every k in `ks`, which gives the tau of no training at all. None of it depends on the
draft, so it is an artifact of its own: evaluating a new draft for the same verifier, prompts and
decoding settings runs only the draft's decodes. The key holds the device type (CPU or CUDA) the
decodes run on: the draft's decodes are checked token for token against the reference, and a GPU's
reduced-precision greedy output may differ from a CPU's; `measured_on` names the device and the
verifier's forward (`eagle3.verifier.forward`).

Output `reference.json`: the greedy tokens of each prompt, in order; `per_prompt.json`: each
prompt's n-gram counts at each k as tau takes them (tokens: accepted draft tokens plus one per
verifier pass; passes), for the draft's gain measured on the same prompts (`eagle3.evaluation.tau.gain_over`);
`report.json`: the manifest's measurements (the rows with their speeds, greedy's speed, where it was
measured), in the artifact's files so that its content digest tells two measurements apart: the
store keeps the first manifest of a digest, and two runs with the same outputs but another device or
speed would otherwise share one artifact and one of their manifests.
Each prompt's decodes are appended to `done.jsonl` in the work dir as they finish (`eagle3.store.done_log`),
so a run killed midway resumes at its first undecoded prompt.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import TemplateError
from tqdm import tqdm

from eagle3.config import EvalConfig, VerifierConfig
from eagle3.data.prepare_dataset import read_user_turns
from eagle3.evaluation.speculative import DecodeStats, NgramProposer, greedy_decode, speculative_decode
from eagle3.evaluation.tau import PER_PROMPT, Counts, per_prompt_counts, read_counts, tau_from_counts, tau_standard_error
from eagle3.runtime.attempts import NO_GPU, GpuClaim
from eagle3.runtime.devices import device_type, resolve_device
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore, step_provenance
from eagle3.store.done_log import DONE_LOG, append_done, read_done
from eagle3.store.manifests import ArtifactManifest, Provenance
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.loading import chat_prompt_ids, eos_token_ids
from eagle3.verifier.placement import decoding_placement, load_placed
from eagle3.verifier.resolve_verifier import VerifierManifest, verifier_tokenizer

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch
    from transformers import PreTrainedModel

__all__ = [
    "SPEED_FIELDS",
    "BaselineManifest",
    "DecodingModel",
    "baseline_provenance",
    "chat_prompts",
    "decode_remaining",
    "decode_summary",
    "device_name",
    "eval_prompts",
    "measure_baselines",
    "read_prompts",
    "tokens_per_s",
]

logger = logging.getLogger(__name__)
REFERENCE = "reference.json"
# a decode summary's timings: they vary run to run, outputs alike
SPEED_FIELDS = ("tokens_per_s", "greedy_tokens_per_s", "speed_up", "decode_tokens_per_s", "greedy_decode_tokens_per_s", "decode_speed_up")


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


def baseline_provenance(store: ArtifactStore, cfg: EvalConfig, verifier: VerifierManifest, prompts: Path) -> Provenance:
    """What the baselines depend on: the verifier, the prompts by content, the decoding settings and
    the device type, not the rest of `cfg` (the eval backend and its server measure the draft only)."""
    return step_provenance(
        "baseline",
        store,
        verifier=verifier,
        prompts=prompts,
        num_prompts=cfg.num_prompts,
        max_new_tokens=cfg.max_new_tokens,
        ks=cfg.ks,
        dtype=cfg.dtype,
        device_type=device_type(cfg.device),
    )


def read_prompts(path: Path, limit: int) -> list[str]:
    """The first user turn of each of the first `limit` records, in any prompt shape."""
    prompts = [users[0] for _, _, users in read_user_turns(path, limit)]
    if not prompts:
        raise ArtifactError(path, "no prompts")
    return prompts


def eval_prompts(path: Path, num_prompts: int) -> list[str]:
    """`read_prompts`, all `num_prompts` of them (`evaluate.num_prompts`).

    Raises:
        ArtifactError: the file holds fewer: a measurement on fewer would be compared, for
            promotion, with earlier ones as if it were on as many.
    """
    prompts = read_prompts(path, num_prompts)
    if len(prompts) < num_prompts:
        raise ArtifactError(
            path,
            f"holds {len(prompts)} prompts, but evaluate.num_prompts is {num_prompts}: "
            f"set evaluate.num_prompts to at most {len(prompts)}, or add prompts",
        )
    return prompts


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads"


@dataclass(frozen=True)
class DecodingModel:
    """The verifier as evaluation decodes with it, and the eval prompts as token ids."""

    model: PreTrainedModel
    device: torch.device
    eos_ids: set[int]
    prompts: list[list[int]]

    @classmethod
    def load(
        cls, verifier: VerifierManifest, prompts: list[list[int]], device: str, dtype: str, max_memory: dict | None = None
    ) -> DecodingModel:
        """`max_memory`: byte budgets of the devices the layers are spread over (None: all on `device`)."""
        import torch

        tokenizer = verifier_tokenizer(verifier)
        resolved = resolve_device(device)
        model = load_placed(verifier.path, getattr(torch, dtype), resolved, max_memory)
        return cls(model, resolved, eos_token_ids(tokenizer, model), prompts)

    def forward(self, capture: HiddenStateCapture | None, max_new_tokens: int):
        """The verifier's forward for decoding these prompts, `max_new_tokens` tokens each."""
        from eagle3.evaluation.forward_choice import forward_for  # transformers' cache classes: imported when decoding

        return forward_for(self.model, capture, max(map(len, self.prompts)) + max_new_tokens, self.prompts[0])


def chat_prompts(verifier: VerifierManifest, texts: list[str], source: Path) -> list[list[int]]:
    """`texts`, the first user turns of `source`'s records, as the verifier's chat template prompts them;
    done before a step claims a GPU, so a prompt the template refuses fails at once.

    Raises:
        ArtifactError: the template refuses a prompt (named by its record in `source`).
    """
    tokenizer = verifier_tokenizer(verifier)
    prompts = []
    for index, text in enumerate(texts):
        try:
            prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]))
        except (ValueError, TemplateError) as exc:
            record_id = read_user_turns(source, index + 1)[index][0]
            raise ArtifactError(
                source, f"record id {record_id!r}: the verifier's chat template refused its first user turn: {exc}"
            ) from exc
    return prompts


def tokens_per_s(runs: list[DecodeStats]) -> float:
    """The speed of decoding `runs` one after another."""
    return sum(len(run.tokens) for run in runs) / sum(run.seconds for run in runs)


def decode_tokens_per_s(runs: list[DecodeStats]) -> float | None:
    """The speed of `runs` after each one's first token, the verifier's pass over the prompt left
    out (a draft's own pass over it stays in, as its first round). None where no run went past its
    first token, or a run has no first-token time (decoded before decodes recorded it)."""
    firsts = [first for run in runs if (first := run.first_token_seconds) is not None]
    if len(firsts) < len(runs):
        return None
    tokens = sum(max(len(run.tokens) - 1, 0) for run in runs)
    seconds = sum(run.seconds for run in runs) - sum(firsts)
    return tokens / seconds if tokens and seconds > 0 else None


def decode_summary(method: str, k: int, runs: list[DecodeStats], greedy: list[DecodeStats]) -> dict:
    """tau (tokens per verifier pass) and its standard error over prompts, acceptance by draft
    position, speed and counts of `runs` (one per prompt), and the speed-up over `greedy`: the
    plain greedy decodes of the same prompts, each decoded next to its prompt's run, so that both
    speeds meet the same device, forward and load; `decode_*` leave out each prompt's pass up to
    its first token, which both pay alike and a long prompt makes weigh more. Position i's acceptance is over the
    passes that drafted an i-th token (`drafts_by_position`), as vLLM's counters divide by its
    drafts: the last passes before `max_new_tokens` draft fewer than k, and n-gram drafts nothing
    where it finds no match. So tau = 1 + sum(acceptance x drafts) / verifier_passes."""
    passes = [(a, d) for run in runs for a, d in zip(run.accepted_per_pass, run.drafted_per_pass, strict=True)]
    tokens, counts = sum(len(run.tokens) for run in runs), per_prompt_counts(runs)
    drafts_by_position = [sum(d >= i for _, d in passes) for i in range(1, k + 1)]
    speed, greedy_speed = tokens_per_s(runs), tokens_per_s(greedy)
    decode_speed, greedy_decode_speed = decode_tokens_per_s(runs), decode_tokens_per_s(greedy)
    return {
        "method": method,
        "k": k,
        "tau": tau_from_counts(counts),
        "tau_standard_error": tau_standard_error(counts),
        "acceptance_by_position": [
            sum(a >= i for a, d in passes if d >= i) / max(drafts, 1) for i, drafts in enumerate(drafts_by_position, 1)
        ],
        "drafts_by_position": drafts_by_position,
        "tokens_per_s": speed,
        "greedy_tokens_per_s": greedy_speed,
        "speed_up": speed / greedy_speed,
        "decode_tokens_per_s": decode_speed,
        "greedy_decode_tokens_per_s": greedy_decode_speed,
        "decode_speed_up": decode_speed / greedy_decode_speed if decode_speed and greedy_decode_speed else None,
        "verifier_passes": len(passes),
        "tokens": tokens,
    }


def _measured_here(done: dict, measured_on: str, done_log: Path) -> dict:
    """The finished prompts of `done` that were decoded as `measured_on` says. Those decoded on
    another device (a run resumed on another GPU model) or with another forward are decoded again:
    their speeds would mix into this one's."""
    elsewhere = sorted({entry["measured_on"] for entry in done.values()} - {measured_on})
    if elsewhere:
        logger.warning("%s: prompts decoded on %s are decoded again on %s", done_log, " and ".join(elsewhere), measured_on)
    return {i: entry for i, entry in done.items() if entry["measured_on"] == measured_on}


def decode_remaining(num_prompts: int, forward, done: dict, done_log: Path, desc: str, decode, record_graphs) -> dict:
    """Entries for all `num_prompts` prompts: those in `done` decoded on the device and with the kind
    of `forward` (`eagle3.verifier.forward`), and `decode(i)` (a dict of figures) for each other
    prompt i, appended to `done_log` as it finishes. With CUDA graphs, `record_graphs()` first
    captures every pass and round shape the decodes will replay, and the first prompt to decode is
    decoded once untimed (its prompt's eager pass, the allocator's first blocks): a graph captured
    inside a timed decode would slow the draft's and n-gram's tokens/s against greedy's."""
    name = f"{device_name(forward.device)}; {forward.kind}"
    done = _measured_here(done, name, done_log)
    if forward.graphs and (todo := [i for i in range(num_prompts) if i not in done]):
        record_graphs()
        decode(todo[0])
    with open(done_log, "a") as log, tqdm(total=num_prompts, initial=len(done), desc=desc, unit="prompt") as bar:
        for i in range(num_prompts):
            if i not in done:
                done[i] = {"id": i, "measured_on": name, **decode(i)}
                append_done(log, done[i])
                bar.update()
    return done


def _decode_prompts(on: DecodingModel, cfg: EvalConfig, done: dict, done_log: Path) -> dict:
    """Plain greedy and n-gram decodes of every prompt not in `done`; all entries."""
    forward = on.forward(None, cfg.max_new_tokens)

    def decode(i: int) -> dict:
        prompt = on.prompts[i]
        greedy = greedy_decode(forward, prompt, cfg.max_new_tokens, on.eos_ids)
        ngram = {k: speculative_decode(forward, NgramProposer(), prompt, cfg.max_new_tokens, k, on.eos_ids) for k in cfg.ks}
        return {"greedy": asdict(greedy), "ngram": {str(k): asdict(stats) for k, stats in ngram.items()}}

    return decode_remaining(len(on.prompts), forward, done, done_log, "baselines", decode, lambda: forward.record_graphs(max(cfg.ks) + 1))


def measure_baselines(
    cfg: EvalConfig,
    verifier: VerifierManifest,
    prompts_path: Path,
    store: ArtifactStore,
    provenance: Provenance,
    claim: GpuClaim = NO_GPU,
    placement: VerifierConfig | None = None,
) -> BaselineManifest:
    """Decode the first `cfg.num_prompts` prompts plainly greedy and with n-gram lookup at each of
    `cfg.ks`, `cfg.max_new_tokens` tokens each, on the claimed GPU (none claimed: `cfg.device`; of
    several, the verifier's layers spread over them: `eagle3.verifier.placement.decoding_placement`).
    Each prompt's decodes are logged as they finish: a run killed midway resumes at the next prompt,
    and claims no GPU if none is left.

    Raises:
        ArtifactError: the prompts file or the log of finished prompts is malformed, or the
            verifier's chat template refuses a prompt.
    """
    import torch

    prompts = chat_prompts(verifier, eval_prompts(prompts_path, cfg.num_prompts), prompts_path)
    with store.step_work_dir(BaselineManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        done_log = work / DONE_LOG
        done = read_done(done_log, "prompt")
        if len(done) < len(prompts):
            with clock.excluding_wait(claim()) as gpus:
                device, max_memory = decoding_placement(verifier.path, gpus, placement, getattr(torch, cfg.dtype), cfg.device)
                on = DecodingModel.load(verifier, prompts, device, cfg.dtype, max_memory)
                done = _decode_prompts(on, cfg, done, done_log)
        entries = [done[i] for i in range(len(prompts))]
        references = [DecodeStats(**entry["greedy"]) for entry in entries]
        ngram = {k: [DecodeStats(**entry["ngram"][str(k)]) for entry in entries] for k in cfg.ks}
        mismatches = sum(run.tokens != reference.tokens for runs in ngram.values() for run, reference in zip(runs, references))
        if mismatches:
            logger.warning("%d n-gram decodes differ from plain greedy decoding (numerical ties?)", mismatches)
        out = work / "artifact"
        out.mkdir(exist_ok=True)
        (out / REFERENCE).write_text(json.dumps([r.tokens for r in references]))
        (out / PER_PROMPT).write_text(json.dumps({"ngram": {k: per_prompt_counts(runs) for k, runs in ngram.items()}}))
        measured = {
            "greedy_tokens_per_s": tokens_per_s(references),
            "results": [decode_summary("ngram", k, runs, references) for k, runs in ngram.items()],
            "mismatches": mismatches,
            "measured_on": entries[0]["measured_on"],
        }
        (out / "report.json").write_text(json.dumps(measured, indent=2))
        manifest = store.publish(
            out,
            BaselineManifest(
                **provenance.model_dump(),
                **measured,
                path=out,
                num_prompts=len(prompts),
                num_tokens=sum(len(r.tokens) for r in references),
                seconds=clock(),
            ),
        )
        shutil.rmtree(work)
        return manifest
