"""Hidden-state extraction throughput on one GPU: the pipeline's extraction step against its parts.

    python bench/gpu_throughput.py                 # Llama-3.1-8B shape, random weights, 2048-token samples
    python bench/gpu_throughput.py --layers 8      # a quick smoke run

Measures, on the same random-weight verifier and the same packed data:
- `compute`: forward passes with the hidden-state hooks only (tokens/s, model FLOPs utilisation
  = FLOPs a token x tokens / time / measured bf16 matmul peak, a token's FLOPs counted as PaLM's
  MFU counts them: 2 per weight of the decoder's matmuls, not the embedding lookup nor the output
  head, which extraction never runs, plus causal attention's 2 x layers x hidden x seq_len);
- `pipeline`: `eagle3.extraction.extract_hidden_states` end to end (device-to-host copy, safetensors
  writes, verification), minus the verifier load time measured separately; then the same with
  `extract.storage=fp8` (states quantized on the GPU before the copy), with the bytes a token
  takes on disk for each precision;
- each stage alone, as tokens/s: the device-to-host copy into a reused pinned buffer, and the file
  writes (serialize, sha256, atomic write with fsync, 8 threads): the pipeline overlaps all three,
  so its rate is set by the slowest (`pipeline / slowest stage alone`, the target is >= 0.9);
- `naive`: one sample per forward with `output_hidden_states`, copied and written synchronously;
- `disk`: safetensors writes of bf16 tensors with fsync (GB/s).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_verifier import save_random_llama
from eagle3.config import ExtractConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.extraction.extract_hidden_states import extract_hidden_states, prefill_batches
from eagle3.extraction.shards import hs_path
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.loading import load_text_model
from eagle3.verifier.resolve_verifier import VerifierManifest


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def matmul_peak_tflops(n: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start = _sync_time()
        a @ b
        times.append(_sync_time() - start)
    return 2 * n**3 / statistics.median(times) / 1e12


def build_dataset(root: Path, samples: int, seq_len: int) -> DatasetManifest:
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (samples, seq_len), generator=g).tolist()
    pq.write_table(
        pa.table(
            {
                "input_ids": ids,
                "loss_mask": [[1] * seq_len] * samples,
                "seq_len": [seq_len] * samples,
                "record_id": [str(i) for i in range(samples)],
            }
        ),
        root / "data-00000.parquet",
    )
    return DatasetManifest(
        path=root,
        num_records=samples,
        num_tokens=samples * seq_len,
        num_supervised_tokens=0,
        num_truncated=0,
        dropped={},
        files=["data-00000.parquet"],
    )


@torch.inference_mode()
def compute_only(model, aux, ids: list[list[int]], budget: int) -> float:
    """Tokens/s of the hooked forward passes alone, at the pipeline's batch shapes."""
    decoder = model.get_decoder()
    capture = HiddenStateCapture(decoder, aux)
    lengths = {i: len(x) for i, x in enumerate(ids)}
    batches = prefill_batches(list(lengths), lengths, budget)
    run = lambda batch: decoder(input_ids=torch.tensor([ids[i] for i in batch], device="cuda"), use_cache=False)  # noqa: E731
    run(batches[0])
    start = _sync_time()
    for batch in batches:
        run(batch)
        states = capture.stacked()
    elapsed = _sync_time() - start
    capture.close()
    return sum(lengths.values()) / elapsed, states


def copy_only_tok_s(states: torch.Tensor, repeats: int = 10) -> float:
    """Tokens/s of the device-to-host copy alone: one batch's states into a reused pinned buffer,
    as the extraction writer copies them."""
    host = torch.empty(states.shape, dtype=torch.bfloat16, pin_memory=True)
    host.copy_(states, non_blocking=True)
    start = _sync_time()
    for _ in range(repeats):
        host.copy_(states, non_blocking=True)
    return repeats * states.shape[0] * states.shape[1] / (_sync_time() - start)


def write_only_tok_s(states: torch.Tensor, out: Path, batches: int = 6, workers: int = 8) -> float:
    """Tokens/s of writing shard files alone (serialize, sha256, write; then every file fsynced), one
    file per sample on `workers` threads, as the extraction writer writes a shard."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save

    from eagle3.store.files import atomic_write_bytes, fsync

    out.mkdir(parents=True)
    host = states.to("cpu", torch.bfloat16)
    ids = torch.zeros(host.shape[1], dtype=torch.long)

    def write(name: str, row: int) -> None:
        payload = save({"hidden_states": host[row].contiguous(), "token_ids": ids})
        atomic_write_bytes(out / name, payload, sync=False)
        hashlib.sha256(payload).hexdigest()

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda job: write(*job), [(f"b{b}-r{r}.safetensors", r) for b in range(batches) for r in range(host.shape[0])]))
        list(pool.map(fsync, list(out.iterdir())))  # as a shard's files are synced before its done.json
    return batches * host.shape[0] * host.shape[1] / (time.perf_counter() - start)


@torch.inference_mode()
def naive(model, aux, ids: list[list[int]], out: Path) -> float:
    """One sample per forward, `output_hidden_states`, synchronous copy and write."""
    out.mkdir(parents=True)
    start = _sync_time()
    for i, sample in enumerate(ids):
        hs = model(input_ids=torch.tensor([sample], device="cuda"), output_hidden_states=True).hidden_states
        states = torch.stack([hs[k] for k in aux] + [hs[-1]], dim=2)[0].cpu()
        save_file({"hidden_states": states, "token_ids": torch.tensor(sample)}, hs_path(out, i))
    elapsed = _sync_time() - start
    return sum(map(len, ids)) / elapsed


def extract(args, aux: list[int], dataset: DatasetManifest, verifier: VerifierManifest, store: Path, storage: str):
    """The extraction step end to end in its own store: (manifest, seconds, bytes of state files);
    the store is removed afterwards (the default size writes 13 GB in bf16)."""
    cfg = ExtractConfig(
        aux_layer_ids=aux, records_per_shard=args.samples, device="cuda", prefill_batch_tokens=args.prefill_batch_tokens, storage=storage
    )
    start = time.perf_counter()
    manifest = extract_hidden_states(cfg, dataset, verifier, ArtifactStore(store), Provenance())
    seconds = time.perf_counter() - start
    state_bytes = sum(f.stat().st_size for f in store.rglob("hs_*.safetensors"))
    shutil.rmtree(store)
    return manifest, seconds, state_bytes


def disk_write_gbps(out: Path, total_gb: float = 2.0, file_mb: int = 64) -> float:
    out.mkdir(parents=True)
    tensor = torch.randn(file_mb * 2**20 // 2, dtype=torch.bfloat16)
    count = int(total_gb * 1024 / file_mb)
    start = time.perf_counter()
    for i in range(count):
        path = out / f"w{i}.safetensors"
        save_file({"x": tensor}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return count * file_mb / 1024 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--samples", type=int, default=192)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prefill-batch-tokens", type=int, default=16384)
    parser.add_argument("--workdir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    if args.layers < 8:
        parser.error("--layers must be at least 8: the three aux layers (2, layers // 2, layers - 3) must be distinct")

    root = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # ~50 GB at the default size: a second run must find the disk free


def run(args, root: Path) -> None:
    peak = matmul_peak_tflops()
    verifier, params, matmul_params = save_random_llama(root / "verifier", args.layers, device="cuda")
    dataset = build_dataset(root / "dataset", args.samples, args.seq_len)
    ids = pq.read_table(dataset.path / dataset.files[0]).column("input_ids").to_pylist()
    tokens = args.samples * args.seq_len
    n = args.layers
    aux = [2, n // 2, n - 3]  # EAGLE-3's layers: distinct from 8 layers up
    flops_per_token = 2 * matmul_params + 2 * n * 4096 * args.seq_len

    start = time.perf_counter()
    model = load_text_model(verifier.path, torch.bfloat16, torch.device("cuda"))
    load_s = time.perf_counter() - start
    compute_tps, last_states = compute_only(model, aux, ids, args.prefill_batch_tokens)
    copy_tps = copy_only_tok_s(last_states)
    write_tps = write_only_tok_s(last_states, root / "write-only")
    shutil.rmtree(root / "write-only")  # every stage's files go once measured: the disk must hold the next one's
    batch_tokens = last_states.shape[0] * last_states.shape[1]
    del last_states
    naive_tps = naive(model, aux, ids, root / "naive")
    shutil.rmtree(root / "naive")
    del model
    torch.cuda.empty_cache()

    runs = {storage: extract(args, aux, dataset, verifier, root / f"store-{storage}", storage) for storage in ("bf16", "fp8")}
    (manifest, pipeline_s, disk_bytes), (fp8_manifest, fp8_s, fp8_bytes) = runs["bf16"], runs["fp8"]
    pipeline_tps = tokens / (pipeline_s - load_s)  # the step loads the verifier again: not extraction time
    fp8_tps = tokens / (fp8_s - load_s)
    disk = disk_write_gbps(root / "disk")
    bytes_per_token = 4 * 4096 * 2

    result = {
        "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": {
            "layers": n,
            "hidden": 4096,
            "params": params,
            "flops_per_token": flops_per_token,
            "samples": args.samples,
            "seq_len": args.seq_len,
            "prefill_batch_tokens": args.prefill_batch_tokens,
        },
        "matmul_peak_tflops": peak,
        "verifier_load_s": load_s,
        "compute_tok_s": compute_tps,
        "compute_mfu": flops_per_token * compute_tps / (peak * 1e12),
        "pipeline_tok_s": pipeline_tps,
        "pipeline_mfu": flops_per_token * pipeline_tps / (peak * 1e12),
        "pipeline_total_s": pipeline_s,
        "pipeline_vs_naive": pipeline_tps / naive_tps,
        "naive_tok_s": naive_tps,
        "copy_only_tok_s": copy_tps,
        "write_only_tok_s": write_tps,
        "slowest_stage_tok_s": min(compute_tps, copy_tps, write_tps),
        "pipeline_vs_compute": pipeline_tps / compute_tps,
        "pipeline_vs_slowest_stage": pipeline_tps / min(compute_tps, copy_tps, write_tps),
        "per_batch_s": {
            "compute": batch_tokens / compute_tps,
            "host_copy": batch_tokens / copy_tps,
            "file_writes": batch_tokens / write_tps,
        },
        "batch_bytes": batch_tokens * 4 * 4096 * 2,
        "hidden_state_gb_s_needed_at_compute_rate": compute_tps * bytes_per_token / 1e9,
        "disk_write_gb_s": disk,
        "tokens": tokens,
        "backoffs": len(manifest.backoffs) + len(fp8_manifest.backoffs),
        "fp8_pipeline_tok_s": fp8_tps,
        "fp8_pipeline_vs_compute": fp8_tps / compute_tps,
        "fp8_over_bf16_tok_s": fp8_tps / pipeline_tps,
        "disk_bytes_per_token": {"bf16": disk_bytes / tokens, "fp8": fp8_bytes / tokens},
    }
    rows = [
        ("bf16 matmul peak", f"{peak:.0f} TFLOP/s"),
        ("compute only (hooks)", f"{compute_tps:,.0f} tok/s  MFU {result['compute_mfu']:.3f}"),
        ("pipeline extraction", f"{pipeline_tps:,.0f} tok/s  MFU {result['pipeline_mfu']:.3f}"),
        ("naive one-at-a-time", f"{naive_tps:,.0f} tok/s"),
        ("copy only (pinned, async)", f"{copy_tps:,.0f} tok/s"),
        ("file writes only (8 threads, synced)", f"{write_tps:,.0f} tok/s"),
        ("pipeline, fp8 storage", f"{fp8_tps:,.0f} tok/s  {result['fp8_over_bf16_tok_s']:.2f}x bf16"),
        ("pipeline / compute", f"{result['pipeline_vs_compute']:.2f} (fp8 {result['fp8_pipeline_vs_compute']:.2f})"),
        ("bytes a token on disk, bf16 / fp8", f"{disk_bytes / tokens:,.0f} / {fp8_bytes / tokens:,.0f}"),
        ("pipeline / slowest stage alone", f"{result['pipeline_vs_slowest_stage']:.2f}"),
        ("pipeline / naive", f"{result['pipeline_vs_naive']:.2f}x"),
        (
            "one batch: compute / copy / write",
            " / ".join(f"{v * 1e3:.0f}" for v in result["per_batch_s"].values()) + f" ms ({result['batch_bytes'] / 1e9:.2f} GB)",
        ),
        ("hidden states at compute rate", f"{result['hidden_state_gb_s_needed_at_compute_rate']:.2f} GB/s"),
        ("disk write (fsync)", f"{disk:.2f} GB/s"),
    ]
    print(f"{result['device']}, {n} layers x H4096 ({params / 1e9:.2f} B params), {args.samples} x {args.seq_len} tokens")
    for name, value in rows:
        print(f"  {name:<32} {value}")
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
