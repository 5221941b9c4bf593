"""Draft-training throughput on one GPU (or N, data-parallel): the pipeline's training step against speculators' own CLI entry,
and against training on online states.

    python bench/train_throughput.py                    # Llama-3.1-8B width, 4 layers, random weights
    python bench/train_throughput.py --samples 16 --epochs 1   # a quick smoke run
    python bench/train_throughput.py --layers 32 --sides pipeline online   # offline against online, 8B verifier
    python bench/train_throughput.py --gpus 4 --samples 384   # DDP on GPUs 0-3: as many steps per GPU as one GPU of the default

Both sides train the same EAGLE-3 draft (1 layer, draft vocab 32000, 3 TTT steps, flex attention,
fused loss, 8192-token batches) on the same hidden states, extracted once by the pipeline from a
random-weight verifier of Llama-3.1-8B width (H 4096, vocab 128256; its depth does not change the
draft's cost):
- `pipeline`: `eagle3.training.train.train_draft` as the flow runs it: data directory, `torchrun` worker,
  metrics log, progress, export of the last checkpoint, curves;
- `online`: the same step with `train.hidden_states=online` (`eagle3.training.online`): the verifier,
  loaded in the training process on the same GPU, prefills each batch's states as the trainer asks
  for them, none kept from one epoch to the next (`online_buffer_gb` 0, the default). Its per-step
  rate includes those prefills (speculators' step timer counts the batch fetch); the verifier's depth
  sets their cost, so compare it with `--layers 32` (the whole 8B verifier). Its store is separate,
  and the bytes of hidden-state files in it afterwards are reported (the target is 0);
- `direct`: `speculators.train.cli.main` under `torchrun` with the same speculators settings
  (`eagle3.training.train_worker.speculators_train_config`) and the same vocab mapping files, plus the one fix
  torch 2.11 needs (`trainer_compat.trainer_class`).
Per-GPU tokens/s is the median of speculators' own step timer on each side; wall seconds run from
launch to exit (the pipeline runs first, so any compile cache on disk favours `direct`); peak GPU
memory is polled with nvidia-smi (the device's view: CUDA context and allocator cache included).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_verifier import VOCAB, save_random_llama
from eagle3.config import ExtractConfig, TrainConfig, VocabConfig
from eagle3.data.prepare_dataset import DatasetManifest
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.runtime.attempts import fixed_devices
from eagle3.store.artifacts import ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.training import trainer_compat
from eagle3.training.online import online_states, online_states_provenance
from eagle3.training.train import _speculators_data_dir, train_draft
from eagle3.training.train_timing import median_tokens_per_s, time_breakdown
from eagle3.training.train_worker import TrainSpec, _collect_metrics, speculators_train_config
from eagle3.training.vocab_mapping import build_vocab_mapping, load_vocab_mapping
from eagle3.verifier.resolve_verifier import VerifierManifest

SIDES = ("pipeline", "direct", "online")


def build_verifier(root: Path, layers: int) -> VerifierManifest:
    """Random weights at Llama-3.1-8B width, with a word-level tokenizer that names a mask token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    verifier, _, _ = save_random_llama(root, layers, device="cuda")
    words = {"<unk>": 0, "<pad>": 1, "<mask>": 2}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")), unk_token="<unk>", pad_token="<pad>", mask_token="<mask>"
    ).save_pretrained(root)
    return verifier


def build_dataset(root: Path, samples: int, seq_len: int) -> DatasetManifest:
    root.mkdir(parents=True)
    ids = torch.randint(0, 128000, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    pq.write_table(
        pa.table(
            {
                "input_ids": ids.tolist(),
                "loss_mask": [[1] * seq_len] * samples,
                "seq_len": [seq_len] * samples,
                "record_id": [str(i) for i in range(samples)],
            }
        ),
        root / "data-00000.parquet",
    )
    tokens, counts = ids.unique(return_counts=True)
    pq.write_table(pa.table({"token_id": tokens.tolist(), "count": counts.tolist()}), root / "token_freq.parquet")
    return DatasetManifest(
        path=root,
        num_records=samples,
        num_tokens=samples * seq_len,
        num_supervised_tokens=samples * seq_len,
        num_truncated=0,
        dropped={},
        files=["data-00000.parquet"],
    )


class PeakMemory:
    """Highest memory.used (MiB) nvidia-smi reports on GPU 0 while the block runs."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True
            ).stdout
            self.peak = max(self.peak, int(out.strip() or 0))
            self._stop.wait(0.2)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def direct_worker(spec_file: Path) -> None:
    """Under torchrun: speculators' CLI entry point on the pipeline's data and vocab mapping."""
    from speculators.train import cli
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig

    # speculators 0.9.0's config does not mirror hs-connectors' `hidden_states_path`, which its file
    # backend reads: unset, it means the data directory's hidden_states/.
    flatten = SpeculatorsTrainConfig.flatten
    SpeculatorsTrainConfig.flatten = lambda self: {"hidden_states_path": None, **flatten(self)}

    spec = TrainSpec.model_validate_json(spec_file.read_text())
    d2t, t2d = load_vocab_mapping(spec.vocab)
    np.save(spec.work / "d2t.npy", d2t.numpy())
    np.save(spec.work / "t2d.npy", t2d.numpy())
    flat = speculators_train_config(spec).flatten()
    flat.update(d2t_path=str(spec.work / "d2t.npy"), t2d_path=str(spec.work / "t2d.npy"), logger="")
    with ExitStack() as stack:
        setup = cli.setup_metric_logger

        def setup_then_record_steps(*args, **kwargs):
            setup(*args, **kwargs)  # it resets the metrics logger's handlers: add the step sink after it
            stack.enter_context(_collect_metrics(spec.metrics_log, spec.timing_log, lambda _record: None))

        cli.setup_metric_logger = setup_then_record_steps
        with trainer_compat.trainer_class(torch.device("cuda")):
            cli.main(SpeculatorsTrainConfig.from_flat(flat))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4, help="verifier depth (the draft's cost does not depend on it)")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--total-seq-len", type=int, default=8192)
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--gpus", type=int, default=1, help="train data-parallel on GPUs 0..N-1 (DDP, one torchrun process each)")
    parser.add_argument(
        "--sides", nargs="+", choices=SIDES, default=["pipeline", "direct"], help="what to train (the first is the reference)"
    )
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the JSON result here")
    parser.add_argument("--direct-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.direct_worker:
        return direct_worker(args.direct_worker)

    root = Path(tempfile.mkdtemp(dir=args.workdir))
    store = ArtifactStore(root / "store")
    verifier = build_verifier(root / "verifier", args.layers)
    dataset = build_dataset(root / "dataset", args.samples, args.seq_len)
    aux = [1, args.layers // 2, args.layers - 1]
    extract = ExtractConfig(aux_layer_ids=aux, device="cuda")
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=args.draft_vocab_size), dataset, VOCAB, store, Provenance())
    cfg = TrainConfig(epochs=args.epochs, total_seq_len=args.total_seq_len, device="cuda", num_gpus=args.gpus)
    gpus = [str(i) for i in range(args.gpus)]
    hidden = None
    if {"pipeline", "direct"} & set(args.sides):
        hidden = extract_hidden_states(extract, dataset, verifier, store, Provenance(), claim=fixed_devices(["0"]))

    rows = {}
    for side in args.sides:
        if side == "pipeline":
            rows[side] = train_pipeline(cfg, dataset, hidden, vocab, verifier, store, gpus)
        elif side == "online":
            online_store = ArtifactStore(root / "online-store")
            states = online_states(
                extract, dataset, verifier, online_store, online_states_provenance(online_store, extract, dataset, verifier)
            )
            rows[side] = train_pipeline(cfg, dataset, states, vocab, verifier, online_store, gpus)
            rows[side]["hidden_state_bytes_on_disk"] = sum(f.stat().st_size for f in online_store.root.rglob("hs_*.safetensors"))
        else:
            rows[side] = train_direct(args, cfg, dataset, hidden, vocab, verifier, root / "direct", aux)
        print(f"{side}: {rows[side]}", flush=True)

    reference = args.sides[0]
    result = {
        "device": subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True
        ).stdout.strip(),
        "torch": torch.__version__,
        "shape": {
            "verifier_layers": args.layers,
            "hidden": 4096,
            "verifier_vocab": VOCAB,
            "draft_vocab": args.draft_vocab_size,
            "samples": args.samples,
            "seq_len": args.seq_len,
            "epochs": args.epochs,
            "total_seq_len": args.total_seq_len,
            "gpus": args.gpus,
        },
        **rows,
        "tokens_per_s_over_reference": {side: rows[side]["tokens_per_s"] / rows[reference]["tokens_per_s"] for side in args.sides},
        "reference": reference,
    }
    print(
        f"{result['device']}: draft for a {args.layers}-layer verifier of H4096 / vocab {VOCAB}, draft vocab "
        f"{args.draft_vocab_size}, {args.samples} x {args.seq_len} tokens, {args.epochs} epochs, batches of {args.total_seq_len} tokens, "
        f"{args.gpus} GPU(s)"
    )
    print(f"  {'':<10} {'tok/s/GPU':>10} {'/ ' + reference:>12} {'steps':>6} {'wall s':>8} {'peak MiB':>9}")
    for side in args.sides:
        row = rows[side]
        ratio = result["tokens_per_s_over_reference"][side]
        print(
            f"  {side:<10} {row['tokens_per_s']:>10,.0f} {ratio:>12.3f} {row['steps']:>6} {row['wall_s']:>8.1f} {row['peak_memory_mib']:>9,}"
        )
    for side in args.sides:
        print(f"  {side} seconds by phase: {rows[side]['seconds_by_phase']}")
    if "online" in rows:
        print(f"  online: hidden-state bytes on disk afterwards: {rows['online']['hidden_state_bytes_on_disk']:,}")
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


def train_pipeline(cfg, dataset, hidden_states, vocab, verifier, store, gpus: list[str]) -> dict:
    start = time.perf_counter()
    with PeakMemory() as memory:
        draft = train_draft(cfg, dataset, hidden_states, vocab, verifier, store, Provenance(), claim=fixed_devices(gpus))
    return {
        "tokens_per_s": draft.tokens_per_s,
        "steps": draft.num_steps,
        "wall_s": time.perf_counter() - start,
        "peak_memory_mib": memory.peak,
        "seconds_by_phase": draft.time_breakdown_s,
    }


def train_direct(args, cfg, dataset, hidden, vocab, verifier, work: Path, aux: list[int]) -> dict:
    work.mkdir()
    _speculators_data_dir(work, dataset, hidden)
    spec = TrainSpec(
        cfg=cfg,
        work=work,
        verifier_path=verifier.path,
        aux_layer_ids=aux,
        hidden_size=4096,
        vocab=vocab,
        total_seq_len=args.total_seq_len,
        device="cuda",
    )
    (work / "spec.json").write_text(spec.model_dump_json())
    start, started_at = time.perf_counter(), time.time()
    with PeakMemory() as memory:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={args.gpus}",
                __file__,
                "--direct-worker",
                str(work / "spec.json"),
            ],
            check=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(args.gpus)))},
        )
    return {
        "tokens_per_s": median_tokens_per_s(spec.timing_log),
        "steps": sum(1 for line in spec.metrics_log.read_text().splitlines() if "train" in json.loads(line)),
        "wall_s": time.perf_counter() - start,
        "peak_memory_mib": memory.peak,
        "seconds_by_phase": time_breakdown(spec.timing_log, started_at, time.time()),
    }


if __name__ == "__main__":
    main()
