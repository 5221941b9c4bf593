"""The figures of an evaluation cut short, over the prompts it finished.

    python bench/unfinished_evaluation.py --done STORE/work/evaluation-KEY/done.jsonl \
        --baseline STORE/artifacts/DIGEST [--prompts PROMPTS.jsonl] [--json OUT]

The evaluation step appends each finished prompt to `done.jsonl` in its work directory, and a
rerun of the flow finishes the rest. Where no rerun is possible (the GPU time ran out), this
reports what is there: tau of the draft over the finished prompts, n-gram's tau over the same
prompts from the finished baselines artifact (`--baseline`, the evaluation's parent), the gain
paired over those prompts, acceptance by position, first-token accuracy, and whether each decode
equals the greedy reference; by category where `--prompts` (the eval prompts file) gives one.
`--done` may be gzipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality import category_rows, markdown_table, print_categories  # noqa: E402

from eagle3.baseline import REFERENCE, decode_summary  # noqa: E402
from eagle3.prepare_dataset import read_records  # noqa: E402
from eagle3.speculative import DecodeStats  # noqa: E402
from eagle3.tau import PER_PROMPT, gain_over, per_prompt_counts, tau_from_counts, tau_standard_error  # noqa: E402


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)  # standard errors need two prompts


def read_done(path: Path) -> list[dict]:
    """The finished prompts' entries, in prompt order. As the evaluation reads its log: a last line
    without its newline (a write cut short by the kill) is skipped, and of a prompt logged twice (a
    resumed run decoding again what another device or forward measured) the later entry counts."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    by_id = {entry["id"]: entry for entry in map(json.loads, complete.splitlines())}
    return [by_id[i] for i in sorted(by_id)]


def _ratio(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, 3) if denominator else None  # nothing drafted: every answer one token long


def summarize(entries: list[dict], baseline: Path, prompts: Path | None) -> dict:
    """One row per k of the finished prompts, each paired with the baselines' decodes of the same
    prompts (n-gram columns empty where the baselines did not decode at that k)."""
    ids = [entry["id"] for entry in entries]
    references = json.loads((baseline / REFERENCE).read_text())
    ngram = json.loads((baseline / PER_PROMPT).read_text())["ngram"]
    categories = [record.get("category") for _, record in read_records(prompts)] if prompts else None
    drafted = sum(entry["drafted"] for entry in entries)
    summary = {
        "prompts": ids,
        "of_prompts": len(references),
        "measured_on": sorted({entry["measured_on"] for entry in entries}),
        "draft_token_accuracy": _ratio(sum(entry["correct"] for entry in entries), drafted),
        "draft_vocab_coverage": _ratio(sum(entry["covered"] for entry in entries), drafted),
        "by_k": {},
    }
    for k in entries[0]["runs"]:
        runs = [DecodeStats(**entry["runs"][k]) for entry in entries]
        draft, draft_counts = decode_summary("eagle3", int(k), runs), per_prompt_counts(runs)
        row = {
            "tokens": draft["tokens"],
            "mismatches": sum(run.tokens != references[i] for run, i in zip(runs, ids)),
            "eagle3": round(draft["tau"], 3),
            "eagle3_se": _rounded(draft["tau_standard_error"]),
            "accepted_by_position": [round(a, 3) for a in draft["acceptance_by_position"]],
            "eagle3_tokens_per_s": round(draft["tokens_per_s"], 1),
            "ngram": None, "ngram_se": None, "gain": None, "gain_se": None,
        }
        if k in ngram:
            ngram_counts = [tuple(ngram[k][i]) for i in ids]
            gain, gain_error = gain_over(draft_counts, ngram_counts)
            row.update(ngram=round(tau_from_counts(ngram_counts), 3), ngram_se=_rounded(tau_standard_error(ngram_counts)),
                       gain=_rounded(gain), gain_se=_rounded(gain_error))
            if categories and None not in categories:
                row["by_category"] = category_rows(draft_counts, ngram_counts, [categories[i] for i in ids], int(k))
        summary["by_k"][k] = row
    return summary


def print_summary(summary: dict) -> None:
    print(f"{len(summary['prompts'])} of {summary['of_prompts']} prompts finished, measured on {', '.join(summary['measured_on'])}; "
          f"first-token accuracy {summary['draft_token_accuracy']}, draft vocab coverage {summary['draft_vocab_coverage']}")
    columns = ["eagle3", "eagle3_se", "ngram", "ngram_se", "gain", "gain_se", "accepted_by_position", "tokens", "mismatches",
               "eagle3_tokens_per_s"]
    print(markdown_table("k", summary["by_k"], columns))
    for k, row in summary["by_k"].items():
        if categories := row.get("by_category"):
            print_categories(f"k={k}", categories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--done", type=Path, required=True, help="the evaluation's done.jsonl (or .gz)")
    parser.add_argument("--baseline", type=Path, required=True,
                        help="the finished baselines artifact the evaluation was measuring against (its parent)")
    parser.add_argument("--prompts", type=Path, help="the eval prompts file, for its categories")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    entries = read_done(args.done)
    if not entries:
        raise SystemExit(f"{args.done}: no finished prompt")
    summary = summarize(entries, args.baseline, args.prompts)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)


if __name__ == "__main__":
    main()
