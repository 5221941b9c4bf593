"""`eagle3 run [--config cfg.yaml] [key.sub=value ...]`: run the pipeline flow from a terminal.

With no Prefect server configured (PREFECT_API_URL unset) the flow runs against a temporary
local one; point PREFECT_API_URL at `prefect server start` to see runs in the UI.
"""

from __future__ import annotations

import argparse
import os
import sys

from eagle3.config import ConfigError, load_config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 draft models as one cached Prefect flow.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pipeline (default: SmolLM2-135M on a bundled sample, on CPU)")
    run.add_argument("--config", help="YAML file shaped like PipelineConfig")
    run.add_argument("overrides", nargs="*", help="key.sub=value, e.g. train.lr=1e-4 verifier.path=./my-model")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"eagle3: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.train_draft import train_eagle3_draft

    result = train_eagle3_draft(config)
    checkpoint, evaluation = result.checkpoint, result.evaluation
    print(f"checkpoint: {checkpoint.path}")
    print(f"simulated acceptance length (tau_sim): {checkpoint.tau_sim:.3f}")
    print(f"measured acceptance length on {evaluation.num_prompts} prompts ({evaluation.path / 'report.json'}):")
    for r in evaluation.results:
        print(f"  {r['method']:>6} k={r['k']}: tau {r['tau']:.3f}")
    print(f"serve it: vllm serve {checkpoint.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
