"""Regeneration's decode: transformers' sdpa (KV heads repeated under a padding mask) against grouped
decode attention (`eagle3.verifier.grouped_decode`), each with a dynamic and a static KV cache.

    python bench/regenerate_attention.py --prompts DIR/instructions_train.jsonl --num-records 2000   # one GPU
    python bench/regenerate_attention.py --num-records 6 --max-new-tokens 24                         # CPU smoke run

The verifier (SmolLM2-135M-Instruct unless `--verifier`) answers the first user turn of the same
records greedily, as regeneration batches them (one left-padded `generate` over all of them, in
`batch_order`), once per variant after an untimed warm-up of each. Prints a table: seconds,
milliseconds a decode step, generated tokens, answers equal to the first variant's, peak GPU memory,
and each variant's speed against the first; then, on a GPU, the top kernels of a few decode steps of
the first two variants (`--profile-tokens`), and one JSON line (`--json` writes it to a file too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.regenerate_batching import chat_prompts, first_turns, first_turns_arguments, timed
from eagle3.data.regenerate import batch_cache, batch_order, left_padded, until_eos
from eagle3.evaluation.baseline import device_name
from eagle3.verifier.grouped_decode import use_grouped_decode
from eagle3.verifier.loading import eos_token_ids

VARIANTS = ["sdpa/dynamic", "grouped/dynamic", "sdpa/static", "grouped/static"]


def generate(model, prompts: list[list[int]], pad: int, max_new_tokens: int, cache: str) -> list[list[int]]:
    """Left-padded greedy `generate` over `prompts`, as `eagle3.data.regenerate` runs it."""
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    static = {**batch_cache(model, width + max_new_tokens), "disable_compile": True} if cache == "static" else {}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            do_sample=False,
            **static,
        )
    return out[:, width:].tolist()


def switch(model, attention: str) -> None:
    model.set_attn_implementation("sdpa")
    if attention == "grouped" and not use_grouped_decode(model):
        raise SystemExit("the verifier has no grouped KV heads: grouped decode attention does not apply")


def main() -> None:
    parser = first_turns_arguments(__doc__)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS, help="ATTENTION/CACHE; the first is the reference")
    parser.add_argument("--profile-tokens", type=int, default=16, help="decode steps profiled per variant on a GPU (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, records = first_turns(args, device)
    prompts = chat_prompts(tokenizer, batch_order(records))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_token_ids(tokenizer, model)

    rows, reference = {}, None
    for variant in args.variants:
        attention, cache = variant.split("/")
        switch(model, attention)
        generate(model, prompts[:8], pad, 8, cache)  # untimed: kernel selection and allocator growth are no variant's
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        out, seconds = timed(lambda cache=cache: generate(model, prompts, pad, args.max_new_tokens, cache))
        answers = [until_eos(tokens, eos)[0] for tokens in out]
        reference = reference or answers
        rows[variant] = {
            "seconds": round(seconds, 2),
            "ms_a_step": round(1000 * seconds / args.max_new_tokens, 1),
            "generated_tokens": sum(map(len, answers)),
            "answers_equal_to_first": sum(a == b for a, b in zip(answers, reference)),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None,
        }
    first = rows[args.variants[0]]["seconds"]
    print(
        f"{len(prompts)} records, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_new_tokens} new tokens, {device_name(device)}"
    )
    print(f"{'variant':<16} {'seconds':>8} {'ms/step':>8} {'tokens':>9} {'equal':>6} {'peak GiB':>9} {'speed':>6}")
    for variant, row in rows.items():
        print(
            f"{variant:<16} {row['seconds']:>8.1f} {row['ms_a_step']:>8.1f} {row['generated_tokens']:>9} {row['answers_equal_to_first']:>6} "
            f"{row['peak_gib'] if row['peak_gib'] is not None else '-':>9} {first / row['seconds']:>5.2f}x"
        )
    if device.type == "cuda" and args.profile_tokens:
        from torch.profiler import ProfilerActivity, profile

        for variant in args.variants[:2]:
            attention, cache = variant.split("/")
            switch(model, attention)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                generate(model, prompts, pad, args.profile_tokens, cache)
            print(f"\n{variant}: {args.profile_tokens} tokens, top kernels by GPU time")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    result = {"device": device_name(device), "records": len(prompts), "max_new_tokens": args.max_new_tokens, "variants": rows}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
