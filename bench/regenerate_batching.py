"""Regeneration's batching: its padded `generate` against transformers' continuous batching.

    python bench/regenerate_batching.py --prompts DIR/instructions_train.jsonl --num-records 2000   # one GPU
    python bench/regenerate_batching.py --num-records 4 --max-new-tokens 16                         # CPU smoke run

The verifier (SmolLM2-135M-Instruct unless `--verifier`) answers the first user turn of the same
records (the package's sample conversations unless `--prompts`) greedily, twice: as regeneration
does (`eagle3.data.regenerate`: one `generate` over all of them, left-padded, in `batch_order`, on a
static KV cache with grouped decode attention),
and through `model.generate_batch` (transformers' continuous batching: a paged KV cache, requests
joining and leaving the batch as they finish). Prints seconds, records/s and generated tokens of
each (end-of-sequence tokens not counted, as regeneration counts them), and how many of the
second's answers equal the first's, then one JSON line (`--json` writes it to a file too). On a CPU the paged cache is bounded to what the records need (unbounded, it
reserves most of the host's memory).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import RegenerateConfig, VerifierConfig
from eagle3.data.prepare_dataset import read_user_turns
from eagle3.data.regenerate import _answer_batch, batch_order
from eagle3.evaluation.baseline import device_name
from eagle3.runtime.devices import compute_dtype
from eagle3.store.artifacts import ArtifactStore
from eagle3.verifier.grouped_decode import use_grouped_decode
from eagle3.verifier.loading import chat_prompt_ids, eos_token_ids, load_text_model
from eagle3.verifier.resolve_verifier import resolve_verifier, verifier_tokenizer

SAMPLE = Path(__file__).resolve().parents[1] / "eagle3" / "data" / "sample_conversations.jsonl"


def timed(fn):
    """`fn()` and its seconds, the device synchronized on both sides."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return out, time.perf_counter() - start


def first_turns_arguments(description: str | None) -> argparse.ArgumentParser:
    """The options both regeneration benches take: which records, how many tokens, which verifier."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=SAMPLE)
    parser.add_argument("--num-records", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--verifier", default=VerifierConfig().path)
    return parser


def first_turns(args: argparse.Namespace, device: torch.device):
    """The verifier (`args.verifier`) loaded on `device`, its tokenizer, and the first user turn of
    each of the first `args.num_records` records of `args.prompts`, in the file's order."""
    with tempfile.TemporaryDirectory() as root:
        verifier = resolve_verifier(VerifierConfig(path=args.verifier), ArtifactStore(root))
        tokenizer = verifier_tokenizer(verifier)
        records = [(rid, system, users[:1]) for rid, system, users in read_user_turns(args.prompts, args.num_records)]
        return load_text_model(verifier.path, compute_dtype(device), device), tokenizer, records


def chat_prompts(tokenizer, records) -> list[list[int]]:
    """Each record's first user turn (after its system turn, if any), chat-templated for an answer."""
    return [chat_prompt_ids(tokenizer, [*system, {"role": "user", "content": users[0]}]) for _, system, users in records]


def main() -> None:
    parser = first_turns_arguments(__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, records = first_turns(args, device)
    cfg = RegenerateConfig(enabled=True, max_new_tokens=args.max_new_tokens, batch_size=len(records))
    use_grouped_decode(model)  # as a regeneration attempt loads it
    warm = records[:2]  # each path once, untimed: first-call costs (kernel selection, allocator growth) are neither's
    _answer_batch(model, tokenizer, batch_order(warm), cfg.model_copy(update={"batch_size": len(warm)}), device)
    padded, padded_s = timed(lambda: _answer_batch(model, tokenizer, batch_order(records), cfg, device))
    answers = {entry["id"]: entry["messages"][-1]["content"] for entry in padded if "messages" in entry}

    model.set_attn_implementation("sdpa")  # continuous batching pages its own sdpa
    eos = sorted(eos_token_ids(tokenizer, model))
    prompts = chat_prompts(tokenizer, records)
    greedy = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    paged = ContinuousBatchingConfig()
    if device.type == "cpu":
        paged = ContinuousBatchingConfig(
            num_blocks=math.ceil(sum(len(p) + args.max_new_tokens for p in prompts) / paged.page_size) + len(prompts)
        )
    model.generate_batch(prompts[:2], generation_config=greedy, continuous_batching_config=paged)
    served, continuous_s = timed(lambda: model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=paged))
    continuous = {rid: [t for t in served[f"req_{i}"].generated_tokens if t not in eos] for i, (rid, _, _) in enumerate(records)}

    same = sum(tokenizer.decode(ids, skip_special_tokens=True).strip() == answers.get(rid) for rid, ids in continuous.items())
    result = {
        "device": device_name(device),
        "verifier": args.verifier or "SmolLM2-135M-Instruct (the default)",
        "records": len(records),
        "max_new_tokens": args.max_new_tokens,
        "padded_generate": {"seconds": padded_s, "generated_tokens": sum(e.get("tokens", 0) for e in padded)},
        "continuous_batching": {"seconds": continuous_s, "generated_tokens": sum(map(len, continuous.values()))},
        "answers_equal": same,
    }
    print(f"{'batching':<20} {'seconds':>9} {'records/s':>10} {'tokens':>9}")
    for name in ("padded_generate", "continuous_batching"):
        row = result[name]
        print(f"{name:<20} {row['seconds']:>9.1f} {len(records) / row['seconds']:>10.1f} {row['generated_tokens']:>9}")
    print(f"continuous batching's answers equal to padded generate's: {same} of {len(records)}")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
