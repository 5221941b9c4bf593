"""Kill trials: a tiny run killed at a random moment of one of its phases, then run again once.

    python bench/fault_trials.py [--trials 20] [--seed 0] [--work DIR] [--json OUT]

Each trial starts `eagle3 run` (the tiny run of `bench/tiny_run.py`, a temporary Prefect server,
a fresh store) and, a random delay after the log line that opens the phase, sends SIGKILL to the
run (what the OOM killer does) or SIGTERM to the run or to its whole process group (`kill`,
`timeout`, a scheduler), or kills its temporary server. Phases: baselines, extraction, training,
validation, export, evaluation and the server. Then it checks that the killed run and every
process it had started are gone within 10 s, runs the same command once more, and checks the
restart: it completes; `eagle3 artifacts verify` finds nothing damaged in the store; and its
artifacts are those of an uninterrupted run of the same configuration, digest for digest (an
evaluation's timings aside: its measured tau and outputs must match).

Prints one row per trial, then the totals (trials, completed, corrupt, identical to the
uninterrupted run, runs needing hand repair, processes that outlived their run), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_run import git_sha, make_inputs, newest_run_record, run_cli, start_cli
from tiny_runs import alive, descendants, tiny_run_args

from eagle3.evaluation.baseline import SPEED_FIELDS

# phase -> (the log line that opens it, the delay after it to kill at: uniform in [low, high] s)
PHASES = {
    "baselines": (r"Task run 'resolve-verifier-\w+' - Finished", (0.0, 3.0)),
    "extraction": (r"Task run 'prepare-dataset-\w+' - Finished", (0.0, 2.5)),
    "training": (r"Task run 'build-vocab-mapping-\w+' - Finished", (0.3, 2.0)),  # a tiny run trains for about 2.5 s
    "validation": (r"train draft: 100%", (0.0, 0.5)),  # the bar of steps done: validation runs next (a tiny run's: about 0.5 s)
    "export": (r"Task run 'train-draft-\w+' - Finished", (0.0, 0.3)),
    "evaluation": (r"Task run 'export-checkpoint-\w+' - Finished", (0.0, 4.0)),
    "server": (r"temporary Prefect server runs on http://127\.0\.0\.1:\d+", (0.0, 40.0)),
}
SIGNALS = ("SIGKILL to the run", "SIGTERM to the run", "SIGTERM to the group")
GONE_WITHIN_S = 10.0


def _server_pid(port: str) -> int | None:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prefect.server.api.server:create_app" in args and port.encode() in args:
            return int(cmdline.parent.name)
    return None


def _wait_for(pattern: str, log: Path, run, timeout_s: float = 600) -> re.Match | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.poll() is None:
        if match := re.search(pattern, log.read_text(errors="replace")):
            return match
        time.sleep(0.05)
    return None


def artifacts_by_kind(store: Path, record: dict) -> dict[str, list[str]]:
    """kind -> digests of the artifacts a run reached (from its record in the store)."""
    kinds: dict[str, list[str]] = {}
    for digest in record["artifacts"]:
        manifest = json.loads((store / "artifacts" / digest / "manifest.json").read_text())
        kinds.setdefault(manifest["kind"], []).append(digest)
    return {kind: sorted(digests) for kind, digests in kinds.items()}


def _measured(store: Path, digest: str) -> dict:
    """An evaluation's figures less its timings (speeds differ from run to run)."""
    report = json.loads((store / "artifacts" / digest / "report.json").read_text())
    for row in report["results"]:
        for timing in SPEED_FIELDS:
            row.pop(timing, None)
    per_prompt = store / "artifacts" / digest / "per_prompt.json"
    return {"report": report, "per_prompt": per_prompt.read_text() if per_prompt.exists() else None}


def differences(reference: tuple[Path, dict], trial: tuple[Path, dict]) -> list[str]:
    """The kinds of artifact whose content differs from the uninterrupted run's."""
    (ref_store, ref), (store, got) = reference, trial
    differ = []
    for kind in sorted(set(ref) | set(got)):
        if kind == "evaluation" and len(ref.get(kind, [])) == len(got.get(kind, [])) == 1:
            if _measured(ref_store, ref[kind][0]) != _measured(store, got[kind][0]):
                differ.append(kind)
        elif ref.get(kind) != got.get(kind):
            differ.append(kind)
    return differ


def _verify(store: Path, home: Path, log: Path) -> tuple[bool, str]:
    done = run_cli(["artifacts", "verify", "--store", str(store)], home, log)
    return done.returncode == 0, done.output.strip().splitlines()[-1] if done.output.strip() else ""


def trial(n: int, phase: str, how: str, rng: random.Random, inputs: tuple[Path, Path], work: Path, home: Path, reference) -> dict:
    store, logs = work / f"store-{n}", work / "logs"
    marker, (low, high) = PHASES[phase]
    delay = rng.uniform(low, high)
    args = tiny_run_args(store, *inputs)
    log = logs / f"trial-{n}-killed.log"
    run = start_cli(args, home, log)
    row = {"trial": n, "phase": phase, "signal": how, "delay_s": round(delay, 2)}
    opened = _wait_for(marker, log, run)
    if opened is None:
        run.wait()
        row["killed"] = f"finished before the phase opened (exit {run.returncode})"
    else:
        time.sleep(delay)
        port = re.search(r"temporary Prefect server runs on http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
        server = _server_pid(port[1]) if port else None
        started = descendants(run.pid) | ({server} if server else set())
        killed_at = time.monotonic()
        finished = re.findall(r"Task run '([a-z-]+)-\w+' - Finished", log.read_text(errors="replace"))
        row["after_task"] = finished[-1] if finished else None  # where the kill landed: the phase is a window, not a guarantee
        if run.poll() is not None:
            row["killed"] = f"finished first (exit {run.returncode})"
        elif phase == "server":
            os.kill(server, signal.SIGKILL if "KILL" in how else signal.SIGTERM)
        elif how == "SIGKILL to the run":
            run.kill()
        elif how == "SIGTERM to the run":
            run.send_signal(signal.SIGTERM)
        else:
            os.killpg(run.pid, signal.SIGTERM)
        try:
            code = run.wait(timeout=30)
        except Exception:
            run.kill()
            code = run.wait()
        row |= {"exit": code, "exit_s": round(time.monotonic() - killed_at, 1)}
        survivors = [pid for pid in started if alive(pid)]
        while survivors and time.monotonic() - killed_at < GONE_WITHIN_S:
            time.sleep(0.2)
            survivors = [pid for pid in survivors if alive(pid)]
        row["outlived"] = len(survivors)
        for pid in survivors:  # the next trial must not share the CPUs with them
            os.kill(pid, signal.SIGKILL)
    restart = run_cli(args, home, logs / f"trial-{n}-restart.log")
    row["restart_exit"], row["restart_s"] = restart.returncode, round(restart.seconds, 1)
    row["completed"] = restart.returncode == 0 and "checkpoint: " in restart.output
    row["sound"], row["verify"] = _verify(store, home, logs / f"trial-{n}-verify.log")
    row["differs"] = differences(reference, (store, artifacts_by_kind(store, newest_run_record(store)))) if row["completed"] else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, help="directory for inputs, stores, logs and the Prefect home (default: a temporary one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        home = work / "prefect"
        home.mkdir(exist_ok=True)
        inputs = make_inputs(work)
        reference_store = work / "store-uninterrupted"
        first = run_cli(tiny_run_args(reference_store, *inputs), home, work / "logs" / "uninterrupted.log")
        if first.returncode != 0:
            raise RuntimeError(f"the uninterrupted run failed: {first.output[-3000:]}")
        if stale := [phase for phase, (marker, _) in PHASES.items() if not re.search(marker, first.output)]:
            raise RuntimeError(f"the uninterrupted run's output never opens phase(s) {stale}: their markers in PHASES are out of date")
        reference = (reference_store, artifacts_by_kind(reference_store, newest_run_record(reference_store)))
        phases = list(PHASES)
        rows = []
        print(
            f"{'#':>3} {'phase':<11} {'signal':<20} {'delay s':>7} {'exit':>5} {'exit s':>6} {'outlived':>8} "
            f"{'restart':>7} {'restart s':>9} {'verify':<8} differs",
            flush=True,
        )
        for n in range(args.trials):
            phase = phases[n % len(phases)]
            how = rng.choice(("SIGKILL", "SIGTERM")) if phase == "server" else rng.choice(SIGNALS)
            row = trial(n, phase, how, rng, inputs, work, home, reference)
            rows.append(row)
            print(
                f"{n:>3} {phase:<11} {how:<20} {row['delay_s']:>7} {row.get('exit', '-')!s:>5} {row.get('exit_s', '-')!s:>6} "
                f"{row.get('outlived', '-')!s:>8} {row['restart_exit']:>7} {row['restart_s']:>9} "
                f"{'ok' if row['sound'] else 'DAMAGED':<8} {row['differs'] if row['differs'] is not None else '-'}"
                + (f"  ({row['killed']})" if "killed" in row else ""),
                flush=True,
            )
    totals = {
        "trials": len(rows),
        "killed_in_their_phase": sum("killed" not in r for r in rows),
        "completed": sum(r["completed"] for r in rows),
        "corrupt": sum(not r["sound"] for r in rows),
        "identical_to_uninterrupted": sum(r["differs"] == [] for r in rows),
        "needing_hand_repair": sum(not r["completed"] for r in rows),
        "processes_outliving_their_run": sum(r.get("outlived", 0) for r in rows),
        "exit_s_max": max((r["exit_s"] for r in rows if "exit_s" in r), default=None),
    }
    print("  ".join(f"{k}: {v}" for k, v in totals.items()))
    result = {
        "git": git_sha(),
        "cpus": os.cpu_count(),
        "seed": args.seed,
        "uninterrupted_s": round(first.seconds, 1),
        "versions": {name: version(name) for name in ("prefect", "torch", "speculators")},
        "totals": totals,
        "trials": rows,
    }
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
