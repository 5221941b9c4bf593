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

from quality import category_rows, markdown_table, print_categories

from eagle3.data.prepare_dataset import read_records
from eagle3.evaluation.baseline import REFERENCE
from eagle3.evaluation.evaluate import summarize_decodes
from eagle3.evaluation.tau import read_counts, tau_from_counts, tau_standard_error
from eagle3.store.done_log import parse_done


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)  # standard errors need two prompts


def read_done(path: Path) -> list[dict]:
    """The finished prompts' entries, in prompt order, read as the evaluation reads its log."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        done = parse_done(f.read(), path, "prompt")
    return [done[i] for i in sorted(done)]


def summarize(entries: list[dict], baseline: Path, prompts: Path | None) -> dict:
    """One row per k of the finished prompts, each paired with the baselines' decodes of the same
    prompts (n-gram columns empty where the baselines did not decode at that k)."""
    ids = [entry["id"] for entry in entries]
    references = json.loads((baseline / REFERENCE).read_text())
    ks = [int(k) for k in entries[0]["runs"]]
    ngram = {k: [counts[i] for i in ids] for k in ks if (counts := read_counts(baseline, "ngram", k)) is not None}
    draft = summarize_decodes(ks, entries, [references[i] for i in ids], ngram)
    categories = [record.get("category") for _, record in read_records(prompts)] if prompts else None
    gains = {g["k"]: g for g in draft.gains_over_ngram}
    summary = {
        "prompts": ids,
        "of_prompts": len(references),
        "measured_on": sorted({entry["measured_on"] for entry in entries}),
        "mismatches": draft.mismatches,
        "draft_token_accuracy": _rounded(draft.draft_token_accuracy),
        "draft_vocab_coverage": _rounded(draft.draft_vocab_coverage),
        "by_k": {},
    }
    for result in draft.results:
        k = result["k"]
        row = {
            "tokens": result["tokens"],
            "eagle3": round(result["tau"], 3),
            "eagle3_se": _rounded(result["tau_standard_error"]),
            "ngram": _rounded(tau_from_counts(ngram[k])) if k in ngram else None,
            "ngram_se": _rounded(tau_standard_error(ngram[k])) if k in ngram else None,
            "gain": _rounded(gains[k]["gain"]) if k in gains else None,
            "gain_se": _rounded(gains[k]["standard_error"]) if k in gains else None,
            "accepted_by_position": [round(a, 3) for a in result["acceptance_by_position"]],
            "eagle3_tokens_per_s": round(result["tokens_per_s"], 1),
            "eagle3_speedup": round(result["speed_up"], 2),
        }
        if k in ngram and categories and None not in categories:
            row["by_category"] = category_rows(draft.counts[k], ngram[k], [categories[i] for i in ids], k)
        summary["by_k"][str(k)] = row
    return summary


def print_summary(summary: dict) -> None:
    print(
        f"{len(summary['prompts'])} of {summary['of_prompts']} prompts finished, measured on {', '.join(summary['measured_on'])}; "
        f"first-token accuracy {summary['draft_token_accuracy']}, draft vocab coverage {summary['draft_vocab_coverage']}; "
        f"{summary['mismatches']} decodes differ from greedy"
    )
    columns = [
        "eagle3",
        "eagle3_se",
        "ngram",
        "ngram_se",
        "gain",
        "gain_se",
        "accepted_by_position",
        "tokens",
        "eagle3_tokens_per_s",
        "eagle3_speedup",
    ]
    print(markdown_table("k", summary["by_k"], columns))
    for k, row in summary["by_k"].items():
        if categories := row.get("by_category"):
            print_categories(f"k={k}", categories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--done", type=Path, required=True, help="the evaluation's done.jsonl (or .gz)")
    parser.add_argument(
        "--baseline", type=Path, required=True, help="the finished baselines artifact the evaluation was measuring against (its parent)"
    )
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
