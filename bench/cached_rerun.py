"""How long `eagle3 run` takes when there is nothing to do: every step cached.

    python bench/cached_rerun.py [--work DIR] [--repeats 3] [--json OUT]

Measures, on the tiny run of `bench/tiny_run.py` (first run not timed): the cold import of the flow
(`python -c "import flows.train_draft"`, and which heavy packages that import pulls in), then
`eagle3 run` of the same configuration again, every step cached, against a persistent
`prefect server start` (PREFECT_API_URL set) and with the temporary server it starts itself. Each
figure is the median of `--repeats` runs in fresh processes. The machine's load average is
recorded beside them: on a shared machine it moves the figures more than anything measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_run import ROOT, git_sha, make_inputs, run_cli, started_server
from tiny_runs import tiny_run_args

HEAVY = ("torch", "transformers", "speculators", "openai", "pyarrow", "numpy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cold_import(repeats: int) -> dict:
    """Wall seconds of a fresh interpreter importing the flow, and the heavy packages it imports."""
    seconds = []
    for _ in range(repeats):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", "import flows.train_draft"], cwd=ROOT, check=True)
        seconds.append(time.monotonic() - start)
    trace = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import flows.train_draft"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in trace.splitlines() if "|" in line}
    return {"median_s": statistics.median(seconds), "runs_s": seconds, "heavy_imported": [m for m in HEAVY if m in imported]}


def cached_reruns(args: list[str], home: Path, logs: Path, repeats: int, api_url: str | None) -> dict:
    seconds = []
    for i in range(repeats):
        done = run_cli(args, home, logs / f"{'persistent' if api_url else 'temporary'}-{i}.log", api_url)
        if done.returncode != 0 or "Nothing changed" not in done.output:
            raise RuntimeError(f"the rerun was not fully cached (exit {done.returncode}): {done.output[-3000:]}")
        seconds.append(done.seconds)
    return {"median_s": statistics.median(seconds), "runs_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="directory for the inputs, store and Prefect home (default: a temporary one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        home, logs = work / "prefect", work / "logs"
        home.mkdir(exist_ok=True)
        logs.mkdir(exist_ok=True)
        run = tiny_run_args(work / "store", *make_inputs(work))
        load_before = os.getloadavg()
        imports = cold_import(args.repeats)
        with started_server(home, _free_port()) as api_url:
            first = run_cli(run, home, logs / "first.log", api_url)
            if first.returncode != 0:
                raise RuntimeError(f"the first run failed: {first.output[-3000:]}")
            persistent = cached_reruns(run, home, logs, args.repeats, api_url)
        temporary = cached_reruns(run, home, logs, args.repeats, None)
        result = {
            "git": git_sha(),
            "cpus": os.cpu_count(),
            "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "versions": {name: version(name) for name in ("prefect", "torch", "transformers", "speculators")},
            "first_run_s": round(first.seconds, 1),
            "cold_import": imports,
            "cached_rerun_persistent_server": persistent,
            "cached_rerun_temporary_server": temporary,
        }
    print(
        f"{result['cpus']} CPUs, load average {result['load_average_1m'][0]} before, {result['load_average_1m'][1]} after; "
        f"git {result['git']}; median of {args.repeats}"
    )
    print(f"  {'what':<44} {'seconds':>8}")
    print(f"  {'cold import of the flow':<44} {imports['median_s']:>8.1f}   heavy packages imported: {imports['heavy_imported'] or 'none'}")
    print(f"  {'cached rerun, persistent server':<44} {persistent['median_s']:>8.1f}")
    print(f"  {'cached rerun, temporary server':<44} {temporary['median_s']:>8.1f}")
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
