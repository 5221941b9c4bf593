"""`eagle3 run [--config cfg.yaml] [key.sub=value ...]`: run the pipeline flow from a terminal.

With no Prefect server configured (PREFECT_API_URL unset) the flow runs against a temporary
local one; point PREFECT_API_URL at `prefect server start` to see runs in the UI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from eagle3.config import ConfigError, load_config, store_path
from eagle3.figures import with_error

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 draft models as one cached Prefect flow.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pipeline (default: SmolLM2-135M on a bundled sample; on CUDA if seen, else CPU)")
    run.add_argument("--config", help="YAML file shaped like PipelineConfig")
    run.add_argument("overrides", nargs="*", help="key.sub=value, e.g. train.lr=1e-4 verifier.path=./my-model")
    config = commands.add_parser("config", help="print every setting: its value, default, cache-key role and description")
    config.add_argument("--config", help="YAML file shaped like PipelineConfig, to show its resolved values")
    config.add_argument("overrides", nargs="*", help="key.sub=value, as for `eagle3 run`")
    plan = commands.add_parser(
        "plan", help="print whether the run fits its GPUs and disk, and what it will cost, from configs alone (no weights read)"
    )
    plan.add_argument("--config", help="YAML file shaped like PipelineConfig")
    plan.add_argument(
        "overrides", nargs="*", help="key.sub=value, as for `eagle3 run` (verifier.gpu_memory_gib=139.8 plans for GPUs this host lacks)"
    )
    server = commands.add_parser(
        "extraction-server", help="print the `vllm serve` command of a server that extracts hidden states (extract.backend=vllm)"
    )
    server.add_argument("--config", help="YAML file shaped like PipelineConfig (its verifier, extract.* and store_dir)")
    server.add_argument("overrides", nargs="*", help="key.sub=value, as for `eagle3 run`")
    server.add_argument(
        "--storage",
        help="directory the server writes states to and this host reads (default: extract.served_states_dir, else <store>/served-states)",
    )
    server.add_argument(
        "--cpu",
        action="store_true",
        help="for a CPU build of vLLM (run with its environment's python): this package's connector in place of vLLM's CUDA one",
    )
    limit = commands.add_parser(
        "gpu-limit", help="create or resize the Prefect 'gpu' concurrency limit GPU steps claim on a persistent server"
    )
    limit.add_argument("--gpus", type=int, help="slots (default: the GPUs this host sees)")
    lineage = commands.add_parser("lineage", help="print a flow run's or an artifact's lineage (Mermaid graph), from the store alone")
    lineage.add_argument("ref", help="flow run id or artifact digest, or a unique prefix of either")
    lineage.add_argument("--store", help="artifact store directory (default: PipelineConfig's store_dir)")
    lineage.add_argument("--table", action="store_true", help="print a table instead of a Mermaid graph")
    promoted = commands.add_parser("promoted", help="print the best promoted checkpoint per verifier and eval set, from the store alone")
    promoted.add_argument("--store", help="artifact store directory (default: PipelineConfig's store_dir)")
    artifacts = commands.add_parser("artifacts", help="manage the artifact store")
    artifact_commands = artifacts.add_subparsers(dest="artifacts_command", required=True)
    gc = artifact_commands.add_parser("gc", help="remove artifacts and shards the latest N runs did not reach")
    gc.add_argument("--keep-runs", type=int, default=5, help="recorded runs whose artifacts stay (default 5)")
    gc.add_argument("--store", help="artifact store directory (default: PipelineConfig's store_dir)")
    gc.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    verify = artifact_commands.add_parser(
        "verify", help="check every artifact against its digest and every hidden-state shard against its recorded sha256"
    )
    verify.add_argument("--store", help="artifact store directory (default: PipelineConfig's store_dir)")
    verify.add_argument("--remove", action="store_true", help="remove what is damaged (and what lists it): the next run computes it again")
    return parser


def _config(args) -> int:
    """Every setting, one block each: what `eagle3 run` would use, with its default where set otherwise."""
    import textwrap

    from eagle3.config import field_docs

    config = load_config(args.config, args.overrides)
    for doc in field_docs(config):
        set_to = "" if doc.value == doc.default else f"   (default: {doc.default!r})"
        key = {
            "value": "in the cache key",
            "when set": "in the cache key when set",
            "content": "in the cache key by content",
            "no": "not in the cache key",
        }[doc.cache_key]
        print(f"{doc.name} = {doc.value!r}{set_to}")
        marker = f"[{key}]".replace(" ", "\N{NO-BREAK SPACE}")  # never split over two lines
        text = textwrap.fill(f"{doc.description} {marker}", width=100, initial_indent="    ", subsequent_indent="    ")
        print(text.replace("\N{NO-BREAK SPACE}", " "))
    return 0


def _plan(args) -> int:
    """The plan; exit 1 where a step's verifier does not fit the GPUs it claims."""
    from eagle3.plan import make_plan
    from eagle3.preflight import verifier_problems

    config = load_config(args.config, args.overrides)
    if problems := verifier_problems(config):  # a missing or damaged file, named, before transformers reads it
        raise ConfigError("; ".join(map(str, problems)))
    plan = make_plan(config)
    print(plan.render())
    return 0 if plan.fits else 1


def _existing_store(path: str | None):
    """The artifact store at `path` (default: PipelineConfig's store_dir), or None, with a message,
    if there is none: the commands that only read or prune a store must not create one at a typo."""

    from eagle3.config import PipelineConfig
    from eagle3.store.artifacts import ArtifactStore

    root = store_path(path or PipelineConfig().store_dir)
    if not (root / "artifacts").is_dir():
        print(f"eagle3: {root}: no artifact store here (no artifacts/ directory); pass --store", file=sys.stderr)
        return None
    return ArtifactStore(root)


def _gc(args) -> int:
    from eagle3.store.artifacts import ArtifactError
    from eagle3.store.gc import collect_garbage

    if args.keep_runs < 1:
        print("eagle3: --keep-runs must be at least 1", file=sys.stderr)
        return 2
    if (store := _existing_store(args.store)) is None:
        return 2
    try:
        result = collect_garbage(store, args.keep_runs, args.dry_run)
    except ArtifactError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {result['removed']} artifacts/shards ({result['bytes'] / 1e6:.1f} MB); kept the latest {result['runs_kept']} runs")
    return 0


def _verify(args) -> int:
    """One line per damaged artifact or shard; exit 1 if any."""
    from eagle3.store.verify import remove_damaged, verify_store

    if (store := _existing_store(args.store)) is None:
        return 2
    checked, damaged = verify_store(store)
    for damage in damaged:
        print(damage)
    if damaged and args.remove:
        removed = remove_damaged(store, damaged)
        print(f"removed {len(removed)} artifacts/shards: the next run computes them again")
    elif damaged:
        print(
            f"{_this_command()} artifacts verify --remove deletes them (and the artifacts listing a damaged shard): "
            "the next run computes them again",
            file=sys.stderr,
        )
    print(f"checked {checked} artifacts and shards: {len(damaged)} damaged", file=sys.stderr)
    return 1 if damaged else 0


def _lineage(args) -> int:
    from eagle3.store.artifacts import ArtifactError
    from eagle3.store.lineage import change_summary, lineage, lineage_table, to_mermaid
    from eagle3.store.runs import lineage_roots

    if (store := _existing_store(args.store)) is None:
        return 2
    try:
        roots, run_id, parents = lineage_roots(store, args.ref)
        nodes = lineage(store, roots, parents=parents)
    except ArtifactError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    if args.table:
        rows = lineage_table(nodes, run_id)
        width = max((len(row["origin"]) for row in rows), default=0)
        for row in rows:
            print(f"{row['kind']:<14} {row['digest']}  {row['origin']:<{width}}  {row['parents']}")
    else:
        print(to_mermaid(nodes, run_id))
    if run_id is not None:
        print(change_summary(nodes, run_id), file=sys.stderr)  # stdout stays a valid Mermaid file
    return 0


def _promoted(args) -> int:
    from eagle3.store.artifacts import ArtifactError
    from eagle3.store.promotions import PROMOTIONS, promoted_checkpoints

    if (store := _existing_store(args.store)) is None:
        return 2
    try:
        best = promoted_checkpoints(store)
    except ArtifactError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    if not best:
        print(f"no promoted checkpoint recorded in {store.root / PROMOTIONS}")
    for record in best:
        key = record.key
        print(
            f"tau {record.tau:.3f} at k={key.k} (verifier {key.verifier[:12]}, eval prompts {key.prompts[:12]} x{key.num_prompts}, "
            f"max_new_tokens {key.max_new_tokens}, {key.backend}{'' if key.backend == 'vllm' else f' {key.dtype}'}; "
            f"run {record.run_id}): {record.checkpoint_path}"
        )
    return 0


def _extraction_server(args) -> int:
    """Print the command for the configured verifier and aux layers: the layers a server captures are
    fixed when it starts, so they come from the same configuration the run will use."""
    import shlex
    from urllib.parse import urlsplit

    import eagle3
    from eagle3.extraction.extract_hidden_states import resolve_aux_layer_ids
    from eagle3.extraction.served import server_args
    from eagle3.store.artifacts import SERVED_STATES, ArtifactStore
    from eagle3.verifier.resolve_verifier import resolve_verifier

    config = load_config(args.config, args.overrides)
    verifier = resolve_verifier(config.verifier, ArtifactStore(config.store_dir))
    aux = resolve_aux_layer_ids(config.extract.aux_layer_ids, verifier.num_hidden_layers, verifier.path)
    storage = Path(args.storage or config.extract.served_states_dir or store_path(config.store_dir) / SERVED_STATES).expanduser().resolve()
    endpoint = config.extract.endpoint
    url = urlsplit(endpoint.base_url)
    # The CPU build is not the distribution "vllm", which the `vllm` command looks up: start the module.
    serve = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"] if args.cpu else ["vllm", "serve"]
    command = [
        *serve,
        str(verifier.path),
        "--served-model-name",
        endpoint.model or "verifier",
        "--port",
        str(url.port or (443 if url.scheme == "https" else 80)),
    ]
    command += server_args([*aux, verifier.num_hidden_layers], storage, cpu=args.cpu)
    if verifier.trust_remote_code:  # the server tokenizes with the code the run trusts
        command.append("--trust-remote-code")
    environment = f"PYTHONPATH={shlex.quote(str(Path(eagle3.__file__).parents[1]))} " if args.cpu else ""
    print(environment + shlex.join(command))
    if endpoint.model is None:
        print("eagle3: then run with extract.backend=vllm extract.endpoint.model=verifier", file=sys.stderr)
    return 0


def _gpu_limit(gpus: int | None) -> int:
    import torch

    from tasks.gpu import GPU_LIMIT, persistent_server, set_gpu_limit

    if not persistent_server():
        print(
            "eagle3: PREFECT_API_URL names no server: runs with a temporary one take no GPU slots (this host's device locks "
            "keep them apart, docs/gpus-and-backoff.md); set it to the server whose limit to set",
            file=sys.stderr,
        )
        return 2
    count = torch.cuda.device_count() if gpus is None else gpus
    if count < 1:
        print("eagle3: no GPU seen and --gpus not given; CPU runs claim nothing", file=sys.stderr)
        return 2
    set_gpu_limit(count)
    print(f"Prefect concurrency limit '{GPU_LIMIT}': {count} slot(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from tasks.settings import exit_cleanly_on_sigterm, set_prefect_defaults

    args = _parser().parse_args(argv)
    set_prefect_defaults()
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # GPU indices as nvidia-smi and the GPU locks number them
    with exit_cleanly_on_sigterm():
        return _command(args)


def _command(args) -> int:
    if args.command == "gpu-limit":
        return _gpu_limit(args.gpus)
    if args.command == "lineage":
        return _lineage(args)
    if args.command == "artifacts":
        return _verify(args) if args.artifacts_command == "verify" else _gc(args)
    if args.command == "promoted":
        return _promoted(args)
    if args.command == "config":
        try:
            return _config(args)
        except ConfigError as exc:
            print(f"eagle3: {exc}", file=sys.stderr)
            return 2
    if args.command == "plan":
        from eagle3.store.artifacts import ArtifactError

        try:
            return _plan(args)
        except (ConfigError, ArtifactError) as exc:
            print(f"eagle3: {exc}", file=sys.stderr)
            return 2
    if args.command == "extraction-server":
        from eagle3.store.artifacts import ArtifactError

        try:
            return _extraction_server(args)
        except (ConfigError, ArtifactError) as exc:
            print(f"eagle3: {exc}", file=sys.stderr)
            return 2
    return _run(args)


def _run(args) -> int:
    """Check what can be checked before Prefect starts (`eagle3.preflight`), then run the flow.
    Bad input, not a bug, ends in one line per problem naming its file, record and field, and exit 2
    (finished steps stay cached); tracebacks go to the run's log file, not the terminal."""
    from datetime import UTC, datetime

    from eagle3.preflight import preflight, storage_problem

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    if problems := preflight(config):
        for problem in problems:
            print(f"eagle3: {problem}", file=sys.stderr)
        return 2
    from tasks.temporary_server import preload_flow_engine, start_temporary_server

    store = store_path(config.store_dir)
    log_file = store / "logs" / f"run-{datetime.now(UTC):%Y%m%dT%H%M%S}-{os.getpid()}.log"
    server = start_temporary_server(log_file.with_suffix(".server.log"))  # it starts while the flow's modules load
    from eagle3.serving.endpoint import EndpointError
    from eagle3.store.artifacts import ArtifactError
    from flows.train_draft import train_eagle3_draft
    from tasks.gpu import ensure_gpu_limit
    from tasks.settings import tracebacks_to

    if server is not None:
        preload_flow_engine()
        server.wait_until_healthy()
    with tracebacks_to(log_file):
        try:
            ensure_gpu_limit()
            result = train_eagle3_draft(config)
        except (ConfigError, ArtifactError, EndpointError) as exc:
            print(f"eagle3: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:
            if (storage_error := storage_problem(exc, store)) is None:
                raise
            print(f"eagle3: {storage_error}", file=sys.stderr)
            return 2
    # as dataset_source reads it, empty is the sample; a draft trained elsewhere is not the demo draft
    _print_result(result, sample_data=not config.dataset.path and config.draft_path is None)
    return 0


DEMO_DRAFT_NOTE = (
    "a draft trained on the bundled sample for minutes on two cores, as the default run's is, is not expected to beat n-gram lookup: the best "
    "recipe in bench/results/README.md (one H100) measures SmolLM2-135M's draft at tau 2.59 against n-gram's 1.76 "
    "(MT-bench, 80 first turns, 256 tokens, k=3), decoding at 1.66x plain greedy's tokens/s with its rounds "
    "replayed as CUDA graphs; a draft whose tokens are seldom accepted decodes slower than plain greedy: each round pays "
    "for its draft steps"
)


def _print_result(result, sample_data: bool) -> None:
    """The run's outcome; `sample_data`: it trained on the bundled sample, a demo (DEMO_DRAFT_NOTE)."""
    checkpoint, evaluation = result.checkpoint, result.evaluation
    if checkpoint is not None:
        print(f"checkpoint: {checkpoint.path}")
        kept = "" if checkpoint.selected_epoch is None else f", epoch {checkpoint.selected_epoch + 1} of {checkpoint.epochs} (the best)"
        if checkpoint.tau_sim is not None:  # None: a draft trained elsewhere (draft_path)
            print(f"simulated acceptance length (tau_sim) on the validation split: {checkpoint.tau_sim:.3f}{kept}")
    if result.draft is not None:
        print(f"training curves (loss and acceptance by epoch): {Path(result.draft.path) / result.draft.curves}")
    if evaluation is None:
        print(
            f"stopped after {result.stopped_after} (stop_after): the same command without stop_after goes on from there, "
            "every finished step cached"
        )
    else:
        _print_evaluation(result, sample_data)
    command = _this_command()
    print(f"{result.lineage.changes} Lineage: {command} lineage {result.lineage.run_id}")
    print(f"replay: {command} run --config {result.lineage.config_file}")


def _this_command() -> str:
    """How to run this command again from here: `eagle3` where the shell finds this one by that
    name, else the path it was started by (`.venv/bin/eagle3`, as the README runs it)."""
    started = sys.argv[0]
    if os.path.basename(started) != "eagle3":  # `python -m eagle3.cli`
        return "eagle3"
    found = shutil.which("eagle3")
    return "eagle3" if found and os.path.realpath(found) == os.path.realpath(started) else started


def _print_evaluation(result, sample_data: bool) -> None:
    checkpoint, evaluation = result.checkpoint, result.evaluation
    print(f"measured acceptance length on {evaluation.num_prompts} prompts ({evaluation.path / 'report.json'}):")
    gains = {g["k"]: g for g in evaluation.gains_over_ngram or []}
    greedy = evaluation.greedy_tokens_per_s
    for r in evaluation.results:
        line = f"  {r['method']:>6} k={r['k']}: tau {with_error(r['tau'], r['tau_standard_error'])}"
        if r["method"] == "eagle3" and (gain := gains.get(r["k"])) and gain["gain"] is not None:
            line += f", {with_error(gain['gain'], gain['standard_error'], signed=True)} over n-gram"
        if (speed_up := evaluation.speed_up(r)) is not None:
            line += f"; {r['tokens_per_s']:.1f} tok/s, {speed_up:.2f}x plain greedy"
            if r.get("decode_speed_up"):
                line += f" ({r['decode_speed_up']:.2f}x after the first token)"
        elif r.get("tokens_per_s"):
            line += f"; {r['tokens_per_s']:.1f} tok/s"
        print(line)
    if greedy:
        print(f"  plain greedy: {greedy:.1f} tok/s (batch 1, {evaluation.greedy_on}, decoded beside the draft)")
    if ngram_greedy := next((r["greedy_tokens_per_s"] for r in evaluation.results if r["method"] == "ngram"), None):
        print(f"  n-gram's speed-ups: over its baselines' plain greedy, {ngram_greedy:.1f} tok/s ({evaluation.baselines_measured_on})")
    if evaluation.draft_token_accuracy is not None:
        print(f"draft's first-token accuracy on these outputs, per token as in validation: {evaluation.draft_token_accuracy:.3f}")
    if evaluation.draft_vocab_coverage is not None:
        print(f"share of these outputs' tokens the draft vocabulary holds (accuracy's ceiling): {evaluation.draft_vocab_coverage:.3f}")
    print(result.promotion.summary())
    if result.promotion.beats_ngram is False and sample_data:  # a user's own data earns no excuse
        print(DEMO_DRAFT_NOTE)
    if result.promotion.promoted:
        print(f"serve it: vllm serve {checkpoint.path}")


if __name__ == "__main__":
    sys.exit(main())
