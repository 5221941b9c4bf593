"""Data-parallel hidden-state extraction: tokens/s with 1, 2, 4, 8 workers, one per GPU.

    python bench/data_parallel.py                                  # Llama-3.1-8B shape on every GPU count up to this host's
    python bench/data_parallel.py --workers 0 0,1 0,1,2,3          # the claimed devices of each run
    python bench/data_parallel.py --workers cpu cpu,cpu --layers 8 --hidden 256 --samples 32 --seq-len 128   # a CPU smoke run

Runs the pipeline's extraction step (`eagle3.extraction.extract_hidden_states`) on the same
random-weight verifier and data once per entry of `--workers`, each a comma-separated list of the
devices its worker processes claim (`0,0`: two workers on GPU 0), each in a fresh store. Reports, per
run, the step's wall seconds (every worker loads the verifier: a user waits for that too), tokens/s,
tokens/s without one verifier load (measured once on the first run's first device: the workers load
theirs side by side), the scaling efficiency of each (tokens/s over the first run's times the ratio
of worker counts) and whether
the states' digest equals the first run's: workers take whole shards, so the artifact must not depend
on how many there are. Every worker writes to the same disk: at 32 KB of bf16 states a token for the
8B shape, the disk's write rate caps the total (`bench/gpu_throughput.py` measures it), and
`--storage fp8` halves the bytes. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_throughput import build_dataset
from bench.random_verifier import save_random_llama
from eagle3.config import ExtractConfig
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.runtime.attempts import fixed_devices
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.loading import load_text_model
from eagle3.verifier.resolve_verifier import VerifierManifest


def default_workers() -> list[str]:
    """1, 2, 4, 8 ... GPUs, up to the GPUs this host sees."""
    count, runs, n = torch.cuda.device_count(), [], 1
    while n <= count:
        runs.append(",".join(map(str, range(n))))
        n *= 2
    return runs


def extract(args, verifier: VerifierManifest, dataset, store: Path, devices: list[str]) -> dict:
    """One run of the step in its own store, removed afterwards (the default size writes 13 GB in bf16)."""
    n = args.layers
    cfg = ExtractConfig(
        aux_layer_ids=[2, n // 2, n - 3],
        records_per_shard=args.records_per_shard,
        device="cpu" if devices[0] == "cpu" else "cuda",
        prefill_batch_tokens=args.prefill_batch_tokens,
        storage=args.storage,
    )
    start = time.perf_counter()
    manifest = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(store), Provenance(), claim=fixed_devices(devices))
    seconds = time.perf_counter() - start
    shutil.rmtree(store)
    return {"devices": ",".join(devices), "workers": len(devices), "seconds": seconds, "digest": manifest.digest}


def load_seconds(verifier: VerifierManifest, device: str) -> float:
    """One load of the verifier onto `device`, as a worker loads it."""
    start = time.perf_counter()
    model = load_text_model(verifier.path, torch.bfloat16, torch.device("cpu" if device == "cpu" else f"cuda:{device}"))
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds


def run(args, root: Path) -> dict:
    verifier, _, _ = save_random_llama(
        root / "verifier",
        args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        max_positions=args.seq_len,
    )
    dataset = build_dataset(root / "dataset", args.samples, args.seq_len)
    tokens = args.samples * args.seq_len
    load_s = load_seconds(verifier, args.workers[0].split(",")[0])
    rows: list[dict] = []
    for i, entry in enumerate(args.workers):
        row = extract(args, verifier, dataset, root / f"store-{i}", entry.split(","))
        row["tok_s"] = tokens / row["seconds"]
        row["tok_s_after_load"] = tokens / (row["seconds"] - load_s)
        first = rows[0] if rows else row
        for rate in ("tok_s", "tok_s_after_load"):
            row[f"efficiency_{rate}"] = row[rate] / (first[rate] * row["workers"] / first["workers"])
        row["same_digest"] = row["digest"] == first["digest"]
        rows.append(row)
    return {
        "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "samples", "seq_len")},
        "records_per_shard": args.records_per_shard,
        "prefill_batch_tokens": args.prefill_batch_tokens,
        "storage": args.storage,
        "verifier_load_s": load_s,
        "runs": rows,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", nargs="+", help="devices of each run, comma-separated (default: 1, 2, 4 ... of this host's GPUs)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument(
        "--records-per-shard", type=int, default=8, help="every run shards alike: 384 / 8 = 48 shards, whole for 1 to 16 workers"
    )
    p.add_argument("--prefill-batch-tokens", type=int, default=16384)
    p.add_argument("--storage", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--workdir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the JSON result here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    args.workers = args.workers or default_workers()
    if not args.workers:
        parser().error("no GPU here: name CPU workers, e.g. --workers cpu cpu,cpu")
    if args.layers < 8:
        parser().error("--layers must be at least 8: the three aux layers (2, layers // 2, layers - 3) must be distinct")
    root = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        result = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    columns = [
        "devices",
        "workers",
        "seconds",
        "tok_s",
        "efficiency_tok_s",
        "tok_s_after_load",
        "efficiency_tok_s_after_load",
        "same_digest",
    ]
    print(f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}")
    for row in result["runs"]:
        print(f"| {' | '.join(str(round(row[c], 3) if isinstance(row[c], float) else row[c]) for c in columns)} |")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
