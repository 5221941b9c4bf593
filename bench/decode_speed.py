"""Verifier decoding speed: transformers' dynamic KV cache against fixed buffers, eager and as CUDA graphs.

    python bench/decode_speed.py --prompts DIR/mt_bench_questions.jsonl --num-prompts 20   # one GPU
    python bench/decode_speed.py --num-prompts 2 --max-new-tokens 16                      # CPU smoke run

The verifier (SmolLM2-135M-Instruct unless `--verifier`) decodes the same chat-templated prompts
(the package's sample eval prompts unless `--prompts`) plainly greedy and with n-gram drafts at
k = 3, the baselines' work, through each forward of `eagle3.verifier.forward`: `dynamic`
(transformers' DynamicCache, every pass eager: what evaluation runs on a CPU), `static` (fixed
buffers and masks, eager) and, on CUDA, `graphs` (fixed buffers, each pass after the prompt
replayed as a CUDA graph: what evaluation runs on a GPU). Each forward first decodes one prompt untimed (warm-up, graph
captures). Every output must equal the `dynamic` one token for token. Prints a table of tokens/s
and the speed relative to `dynamic`, then one JSON line (`--json` writes it to a file too).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import EvalConfig, VerifierConfig
from eagle3.evaluation.baseline import DecodingModel, chat_prompts, device_name, read_prompts, tokens_per_s
from eagle3.evaluation.evaluate import eval_prompts_source
from eagle3.evaluation.speculative import NgramProposer, greedy_decode, speculative_decode
from eagle3.store.artifacts import ArtifactStore
from eagle3.verifier.forward import DynamicForward, StaticForward
from eagle3.verifier.resolve_verifier import resolve_verifier


def forwards(on: DecodingModel, max_len: int) -> dict:
    """Each forward to compare, by name; `graphs` only where there is a GPU to replay them on."""
    out = {"dynamic": DynamicForward(on.model, None), "static": StaticForward(on.model, None, max_len, graphs=False)}
    if on.device.type == "cuda":
        out["graphs"] = StaticForward(on.model, None, max_len, graphs=True)
    return out


def measure(forward, prompts: list[list[int]], max_new_tokens: int, k: int, eos_ids: set[int]) -> dict:
    """Greedy and n-gram decodes of every prompt: outputs, tokens/s of each, verifier passes per second."""
    greedy = [greedy_decode(forward, p, max_new_tokens, eos_ids) for p in prompts]
    ngram = [speculative_decode(forward, NgramProposer(), p, max_new_tokens, k, eos_ids) for p in prompts]
    seconds = sum(run.seconds for run in greedy + ngram)
    return {
        "outputs": [run.tokens for run in greedy + ngram],
        "greedy_tokens_per_s": tokens_per_s(greedy),
        "ngram_tokens_per_s": tokens_per_s(ngram),
        "verifier_passes_per_s": sum(r.verifier_passes for r in greedy + ngram) / seconds,
        "seconds": seconds,
    }


def main() -> None:
    """Decode the prompts through each forward, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifier", default="", help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=Path, help="prompts file (prompt, turns, question or messages)")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--store", type=Path, help="artifact store for the converted verifier (default: a temporary one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        verifier = resolve_verifier(VerifierConfig(path=args.verifier), ArtifactStore(args.store or Path(tmp)))
        source = args.prompts or eval_prompts_source(EvalConfig())
        prompts = chat_prompts(verifier, read_prompts(source, args.num_prompts + 1), source)
        on = DecodingModel.load(verifier, prompts, "auto", args.dtype)
    warm_up, timed = prompts[:1], prompts[1:]
    rows = {}
    for name, forward in forwards(on, max(map(len, prompts)) + args.max_new_tokens).items():
        measure(forward, warm_up, args.max_new_tokens, args.k, on.eos_ids)
        rows[name] = measure(forward, timed, args.max_new_tokens, args.k, on.eos_ids)

    reference = rows["dynamic"]
    print(f"{len(timed)} prompts x {args.max_new_tokens} tokens, greedy and n-gram k={args.k}, {args.dtype}, {device_name(on.device)}")
    print(f"{'forward':<8} {'greedy tok/s':>13} {'n-gram tok/s':>13} {'passes/s':>9} {'x dynamic':>10} {'outputs = dynamic':>18}")
    for name, row in rows.items():
        row["speedup"] = reference["seconds"] / row["seconds"]
        row["outputs_equal"] = row["outputs"] == reference["outputs"]
        print(
            f"{name:<8} {row['greedy_tokens_per_s']:>13.1f} {row['ngram_tokens_per_s']:>13.1f} {row['verifier_passes_per_s']:>9.1f} "
            f"{row['speedup']:>10.2f} {row['outputs_equal']!s:>18}"
        )
    summary = {
        "device": device_name(on.device),
        "prompts": str(source),
        "num_prompts": len(timed),
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "forwards": {name: {key: value for key, value in row.items() if key != "outputs"} for name, row in rows.items()},
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if not all(row["outputs_equal"] for row in rows.values()):
        sys.exit("outputs differ from the dynamic cache's")


if __name__ == "__main__":
    main()
