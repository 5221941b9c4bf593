"""What reading a hidden-state file costs a training data-loader worker, fp8 against bf16.

    python bench/fp8_read.py                       # SmolLM2-135M's and an 8B verifier's width
    python bench/fp8_read.py --hidden-sizes 7168   # Kimi-K2.5's

Training reads each sample's states through speculators' `FP8Transfer`, in the DataLoader's worker
processes on the CPU: bf16 files are handed over as they are, fp8 ones are dequantized there
(e4m3 to bfloat16, times the token's scale). The script writes sample files as extraction writes
them (`eagle3.extraction.storage.encode`, `--tokens` tokens of random states), then reads them back
through `FP8Transfer` on one thread, as a worker does, and prints tokens/s a worker reads in each
precision: the rate the loader's workers together must beat to keep the trainer fed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.extraction.shards import hs_path
from eagle3.extraction.storage import SLOTS, encode


def read_rate(directory: Path, hidden_size: int, storage: str, tokens: int, files: int, repeats: int) -> float:
    """Tokens/s one thread reads (and dequantizes) through `FP8Transfer`, over `files` files: the
    median of `repeats` passes (one pass of a few hundred MB varies by 2x on a busy host)."""
    from hs_connectors import FP8Transfer

    generator = torch.Generator().manual_seed(0)
    for i in range(files):
        states = torch.randn(tokens, SLOTS, hidden_size, generator=generator)
        save_file({**encode(states, storage), "token_ids": torch.arange(tokens)}, str(hs_path(directory, i)))
    transfer = FP8Transfer(directory, dequantize_dtype=torch.bfloat16)
    transfer.get_cached(0)  # warm: page cache, first-call overheads
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(files):
            sample = transfer.get_cached(i)
            assert sample is not None and sample["hidden_states"].dtype == torch.bfloat16
            sample["hidden_states"].clone()  # the bytes read: a bf16 file is mapped lazily, and the loader's collation copies either
        rates.append(tokens * files / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-sizes", type=int, nargs="+", default=[576, 4096])
    parser.add_argument("--tokens", type=int, default=256, help="tokens a sample file holds")
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7, help="timed passes over the files; their median is reported")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a DataLoader worker's share
    rows = []
    for hidden_size in args.hidden_sizes:
        rates = {}
        for storage in ("bf16", "fp8"):
            with tempfile.TemporaryDirectory() as tmp:
                rates[storage] = read_rate(Path(tmp), hidden_size, storage, args.tokens, args.files, args.repeats)
        rows.append({"hidden_size": hidden_size, "bf16_tok_s": round(rates["bf16"]), "fp8_tok_s": round(rates["fp8"])})
    print(
        f"one thread, {args.files} files of {args.tokens} tokens, page cache warm, median of {args.repeats} passes; torch {torch.__version__}"
    )
    print(f"  {'hidden size':>11} {'bf16 tok/s':>12} {'fp8 tok/s':>12} {'fp8 / bf16':>11}")
    for row in rows:
        print(f"  {row['hidden_size']:>11} {row['bf16_tok_s']:>12,} {row['fp8_tok_s']:>12,} {row['fp8_tok_s'] / row['bf16_tok_s']:>11.3f}")
    line = json.dumps({"tokens": args.tokens, "files": args.files, "repeats": args.repeats, "torch": torch.__version__, "rows": rows})
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
