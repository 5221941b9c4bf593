"""What a draft round costs, eager against replayed as a CUDA graph, beside the verifier's passes.

    python bench/draft_speed.py --tau 2.554                    # one GPU: SmolLM2-135M's shape, random weights
    python bench/draft_speed.py --num-prompts 2 --max-new-tokens 16 --verifier-layers 8   # CPU smoke run
    python bench/draft_speed.py --checkpoint STORE/artifacts/<checkpoint digest> --prompts mt_bench_questions.jsonl --num-prompts 80

A random-weight verifier of SmolLM2-135M-Instruct's shape (30 layers, H 576, vocab 49152; the
tests' byte-level ChatML tokenizer) and a random-weight EAGLE-3 draft over it (speculators'
`Eagle3DraftModel`, `--draft-layers`, `--draft-vocab`) decode the package's sample eval prompts on
the verifier's fastest forward (`eagle3.evaluation.forward_choice.forward_for`: CUDA graphs on a GPU):
plainly greedy, then speculatively at k with each proposer of `eagle3.evaluation.draft_proposer`:
`eager` (`Eagle3Proposer`, every step launched from Python), `static` (`StaticEagle3Proposer`:
fixed KV buffers; on a GPU each round replayed as one CUDA graph) and `compiled` (the same, each
step's layers and head fused by torch.compile before the capture; its compile time is printed).
Each records the graph of every pass and round shape its decodes replay, then decodes one prompt
untimed (warm-up); every output must equal plain greedy's. The random draft has no norm before its
fc layer (trained drafts do: one fused kernel more); `--fc-norm` gives it EAGLE 3.1's per-layer
norms instead.

`--checkpoint DIR` decodes with a trained draft the pipeline exported instead, beside its verifier
(`--verifier`, default the pipeline's: SmolLM2-135M-Instruct's GGUF), on `--prompts` (default the
package's sample eval prompts): the same split of a pass's time for a draft whose tokens are
accepted, with rounds after 1 to k + 1 confirmed tokens, as the evaluation step decodes.

A random draft is untrained, so nearly every drafted token is rejected: the row's own tokens/s is not a
trained draft's. What it measures is the cost of a round (the draft's k steps, from the call to
the proposer to its k tokens done on the device) and of the verifier's (k + 1)-token pass (both
leave each prompt's first pass out; timed in a second decode of each prompt that waits for the
device around each call), and the wall time per verifier pass of the whole decode as evaluation
runs it (the host's bookkeeping and the prompts' passes included; where rounds and passes are
queued back to back, less than round + pass); `--tau T` adds what that wall time gives a draft
whose measured tau is T, T tokens a pass, against plain greedy's measured tokens/s: a projection
from measured costs, not a measured speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import tiny_tokenizer

from eagle3.config import ConfigError, EvalConfig, VerifierConfig
from eagle3.evaluation.baseline import DecodingModel, chat_prompts, device_name, read_prompts, tokens_per_s
from eagle3.evaluation.draft_proposer import Eagle3Proposer, StaticEagle3Proposer
from eagle3.evaluation.evaluate import eval_prompts_source, load_draft
from eagle3.evaluation.speculative import greedy_decode, speculative_decode
from eagle3.extraction.extract_hidden_states import resolve_aux_layer_ids
from eagle3.store.artifacts import ArtifactStore
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.resolve_verifier import resolve_verifier

VOCAB = 49152
PROPOSERS = ("eager", "static", "compiled")


def random_verifier(out: Path, layers: int) -> Path:
    """SmolLM2-135M-Instruct's shape with random weights (untied head: speculators reads it from the files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def random_draft(verifier: Path, aux: list[int], layers: int, draft_vocab: int, fc_norm: bool = False):
    """A speculators EAGLE-3 draft with random weights; its vocabulary: the verifier's first `draft_vocab` ids.
    `fc_norm`: EAGLE 3.1's per-layer norms of the aux states instead of one over their concatenation."""
    from speculators.models.eagle3 import Eagle3DraftModel

    layer_config = transformers.AutoConfig.from_pretrained(verifier)
    layer_config.num_hidden_layers = layers
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:draft_vocab] = True
    return Eagle3DraftModel.from_training_args(
        layer_config,
        t2d=t2d,
        d2t=torch.zeros(draft_vocab, dtype=torch.long),
        num_layers=layers,
        norm_before_residual=True,
        fc_norm=fc_norm,
        ttt_steps=3,
        verifier_name_or_path=str(verifier),
        draft_vocab_size=draft_vocab,
        target_layer_ids=aux,
        draft_attn_impl="sdpa",
    )


class Timed:
    """`inner` (a verifier forward or a proposer) with the wall seconds of each call of its `method`
    recorded beside the call's first argument's length, the device's work included: the device is
    synchronized before and after each call (decoding itself reads it once a pass, so these
    decodes are timed for the split alone)."""

    def __init__(self, inner, method: str):
        self.inner, self.method = inner, method
        self.calls: list[tuple[int, float]] = []

    def _timed(self, first, *args):
        synchronize()
        start = time.perf_counter()
        out = getattr(self.inner, self.method)(first, *args)
        synchronize()
        self.calls.append((len(first), time.perf_counter() - start))
        return out

    def __call__(self, *args):
        return self._timed(*args)

    def propose(self, *args):
        return self._timed(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def mean_ms(self, longest: int | None = None) -> float:
        """Mean milliseconds a call, of the calls whose first argument is at most `longest` long
        (a forward's: leaves the prompts' passes out)."""
        times = [seconds for length, seconds in self.calls if longest is None or length <= longest]
        return 1e3 * sum(times) / len(times)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode(forward, proposer, prompts: list[list[int]], max_new_tokens: int, k: int, eos_ids: set[int]) -> dict:
    """Speculative decodes of `prompts` (greedy where `proposer` is None): outputs, tokens/s, tau,
    wall per verifier pass; then the same decodes again with each call timed: ms per round (by the
    tokens it confirms: a trained draft's rounds confirm 1 to k + 1, an untrained one's 1), per
    round over a prompt, and per verifier pass after the prompt's."""
    timed_forward = Timed(forward, "__call__")
    by_confirmed: dict[int, list[float]] = {}
    prompt_rounds: list[float] = []
    if proposer is None:
        runs = [greedy_decode(forward, p, max_new_tokens, eos_ids) for p in prompts]
        for p in prompts:
            greedy_decode(timed_forward, p, max_new_tokens, eos_ids)
    else:
        timed_proposer = Timed(proposer, "propose")
        runs = [speculative_decode(forward, proposer, p, max_new_tokens, k, eos_ids) for p in prompts]
        for p in prompts:
            first = len(timed_proposer.calls)
            timed = speculative_decode(timed_forward, timed_proposer, p, max_new_tokens, k, eos_ids)
            prompt_rounds += [seconds for _, seconds in timed_proposer.calls[first : first + 1]]  # none: ended at its first token
            del timed_proposer.calls[first : first + 1]  # the round over the prompt, as the prompt's pass is left out
            for (_, seconds), accepted in zip(timed_proposer.calls[first:], timed.accepted_per_pass, strict=False):
                by_confirmed.setdefault(accepted + 1, []).append(seconds)  # after a pass that accepted `accepted`
    tokens = sum(len(r.tokens) for r in runs)
    firsts = sum(r.first_token_seconds or 0.0 for r in runs)
    row = {
        "outputs": [r.tokens for r in runs],
        "tokens_per_s": tokens_per_s(runs),  # the prompts' passes included, as evaluation counts
        "pass_ms": timed_forward.mean_ms(longest=1 if proposer is None else k + 1),
        "first_token_ms": 1e3 * firsts / len(runs),  # the verifier's pass over the prompt, to the host's read
    }
    if proposer is not None:
        passes = sum(r.verifier_passes for r in runs)
        row["tau"] = (tokens - len(runs)) / passes  # a decode's first token: the prompt's pass
        row["round_ms"] = timed_proposer.mean_ms()
        row["round_ms_by_tokens_confirmed"] = {m: 1e3 * sum(t) / len(t) for m, t in sorted(by_confirmed.items())}
        row["rounds_by_tokens_confirmed"] = {m: len(t) for m, t in sorted(by_confirmed.items())}
        row["prompt_round_ms"] = 1e3 * sum(prompt_rounds) / len(prompt_rounds) if prompt_rounds else None
        row["wall_ms_per_pass"] = 1e3 * sum(r.seconds for r in runs) / passes
        row["wall_ms_per_pass_after_first_token"] = 1e3 * (sum(r.seconds for r in runs) - firsts) / passes
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--verifier-layers", type=int, default=30)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--fc-norm", action="store_true", help="a draft with EAGLE 3.1's per-layer norms (train.fc_norm)")
    parser.add_argument("--tau", type=float, help="project tokens/s for a trained draft of this measured tau")
    parser.add_argument("--checkpoint", type=Path, help="a trained draft's exported checkpoint, in place of a random draft")
    parser.add_argument("--verifier", help="the checkpoint's verifier (default: the pipeline's)")
    parser.add_argument("--prompts", type=Path, help="prompts to decode (default: the package's sample eval prompts)")
    parser.add_argument(
        "--proposers",
        nargs="+",
        choices=PROPOSERS,
        default=list(PROPOSERS),
        help="which proposers to time (default: all three; `compiled` alone is what evaluation decodes with on a GPU)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        store = ArtifactStore(Path(tmp) / "store")
        if args.checkpoint:
            verifier = resolve_verifier(VerifierConfig(path=args.verifier), store)
        else:
            path = random_verifier(Path(tmp) / "verifier", args.verifier_layers)
            verifier = resolve_verifier(VerifierConfig(path=str(path)), store)
        source = args.prompts or eval_prompts_source(EvalConfig())
        prompts = chat_prompts(verifier, read_prompts(source, args.num_prompts + 1), source)
        on = DecodingModel.load(verifier, prompts, "auto", args.dtype)
        if args.checkpoint:
            draft = load_draft(args.checkpoint, verifier.path, on.device, getattr(torch, args.dtype))
            aux = list(draft.config.eagle_aux_hidden_state_layer_ids)
            args.verifier_layers, args.draft_layers = verifier.num_hidden_layers, draft.config.transformer_layer_config.num_hidden_layers
            args.draft_vocab, args.fc_norm = draft.config.draft_vocab_size, draft.fc_norm is not None
        else:
            try:
                aux = resolve_aux_layer_ids(None, verifier.num_hidden_layers, verifier.path)
            except ConfigError:
                parser.error(
                    f"--verifier-layers {args.verifier_layers}: the aux layers [2, n//2, n-3] repeat one from 4 to 6 layers; use 7 or more"
                )
            draft = (
                random_draft(verifier.path, aux, args.draft_layers, args.draft_vocab, args.fc_norm)
                .to(on.device, getattr(torch, args.dtype))
                .eval()
            )
    capture = HiddenStateCapture(on.model.get_decoder(), aux)
    max_len = max(map(len, on.prompts)) + args.max_new_tokens + args.k
    forward = on.forward(capture, args.max_new_tokens)
    warm_up, timed = on.prompts[:1], on.prompts[1:]

    forward.record_graphs(args.k + 1)
    decode(forward, None, warm_up, args.max_new_tokens, args.k, on.eos_ids)
    rows = {"greedy": decode(forward, None, timed, args.max_new_tokens, args.k, on.eos_ids)}
    proposers, compile_s = {}, None
    if "eager" in args.proposers:
        proposers["eager"] = Eagle3Proposer(draft)
    if "static" in args.proposers:
        proposers["static"] = StaticEagle3Proposer(draft, max_len, compiled=False)
    if "compiled" in args.proposers:
        start = time.perf_counter()
        proposers["compiled"] = StaticEagle3Proposer(draft, max_len, compiled=True)
        compile_s = time.perf_counter() - start
    for name, proposer in proposers.items():
        proposer.record_graphs(args.k)
        decode(forward, proposer, warm_up, args.max_new_tokens, args.k, on.eos_ids)
        rows[name] = decode(forward, proposer, timed, args.max_new_tokens, args.k, on.eos_ids)
        rows[name]["outputs_equal_greedy"] = rows[name]["outputs"] == rows["greedy"]["outputs"]
        if args.tau:
            rows[name]["projected_tokens_per_s"] = 1e3 * args.tau / rows[name]["wall_ms_per_pass"]
            rows[name]["projected_over_greedy"] = rows[name]["projected_tokens_per_s"] / rows["greedy"]["tokens_per_s"]
    capture.close()

    static = [p for p in proposers.values() if isinstance(p, StaticEagle3Proposer)]
    static_kind = ("CUDA graphs" if static[0].graphs else "eager") if static else None
    verifier_weights = f"weights of {args.verifier or 'the default verifier'}" if args.checkpoint else "random weights"
    draft_weights = f"trained ({args.checkpoint})" if args.checkpoint else "random weights"
    print(
        f"{device_name(on.device)}; verifier: {getattr(forward, 'kind', type(forward).__name__)}, {args.verifier_layers} layers "
        f"x H{verifier.hidden_size}, {verifier_weights}; draft: {args.draft_layers} layers, vocab {args.draft_vocab}, {draft_weights}; "
        f"{len(timed)} prompts x {args.max_new_tokens} tokens, k={args.k}, {args.dtype}"
    )
    print(
        f"{'':<8} {'tok/s':>8} {'tau':>6} {'round ms':>9} {'pass ms':>8} {'wall ms':>8} {'1st ms':>7} {'= greedy':>9}"
        + (f" {'at tau ' + str(args.tau):>14}" if args.tau else "")
    )
    for name, row in rows.items():
        line = f"{name:<8} {row['tokens_per_s']:>8.1f} {row.get('tau', 1.0):>6.3f} {row.get('round_ms', 0.0):>9.2f} {row['pass_ms']:>8.2f}"
        line += f" {row.get('wall_ms_per_pass', row['pass_ms']):>8.2f} {row['first_token_ms']:>7.2f}"
        line += f" {row.get('outputs_equal_greedy', True)!s:>9}"
        if args.tau and name != "greedy":
            line += f" {row['projected_tokens_per_s']:>7.1f} tok/s, {row['projected_over_greedy']:.2f}x greedy"
        print(line)
    for name, row in rows.items():
        if "round_ms_by_tokens_confirmed" in row:
            split = ", ".join(
                f"{m}: {ms:.2f} ms x {row['rounds_by_tokens_confirmed'][m]}" for m, ms in row["round_ms_by_tokens_confirmed"].items()
            )
            print(
                f"{name}: rounds by tokens confirmed {split}; a round over a prompt {row['prompt_round_ms'] or 0.0:.2f} ms; "
                f"wall a pass after the first token {row['wall_ms_per_pass_after_first_token']:.2f} ms"
            )
    if static_kind:
        print(f"static rounds: {static_kind}" + (f"; compiling the draft's steps: {compile_s:.1f} s" if compile_s is not None else ""))
    summary = {
        "device": device_name(on.device),
        "verifier_forward": getattr(forward, "kind", type(forward).__name__),
        "static_rounds": static_kind,
        "compile_s": compile_s,
        "checkpoint": str(args.checkpoint) if args.checkpoint else None,
        "prompts": str(args.prompts) if args.prompts else f"eagle3/data/{source.name} (the package's)",
        "verifier_layers": args.verifier_layers,
        "draft_layers": args.draft_layers,
        "draft_vocab": args.draft_vocab,
        "fc_norm": args.fc_norm,
        "num_prompts": len(timed),
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "dtype": args.dtype,
        "tau_for_projection": args.tau,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": {name: {key: value for key, value in row.items() if key != "outputs"} for name, row in rows.items()},
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if not all(row.get("outputs_equal_greedy", True) for row in rows.values()):
        sys.exit("speculative outputs differ from plain greedy decoding")


if __name__ == "__main__":
    main()
