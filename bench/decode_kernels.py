"""The kernels a decode pass picks for a few queries: attention backends and BLAS libraries, timed.

    python bench/decode_kernels.py            # one GPU: SmolLM2-135M's shapes
    python bench/decode_kernels.py --json bench/results/decode_kernels_h100.json

Why `eagle3.verifier.forward` runs decode passes with `decode_attention` (PyTorch's math backend,
and `grouped_attention` in place of transformers' sdpa attention) and `decode_matmuls` (cuBLASLt): a
pass of a few tokens over fixed KV buffers is a string of small kernels, and PyTorch's and
transformers' default choices are slow at that shape in float32. Each row times one operation
replayed as a CUDA graph (as decoding replays it), in microseconds, for 1, 2 and 4 rows:
scaled-dot-product attention of 9 query heads over `--keys` positions of 3 KV heads (SmolLM2-135M's
layer) with an additive mask, per backend on KV heads repeated beforehand; then as a pass runs it on
the buffers' 3 KV heads: transformers' sdpa path (which repeats them in the pass when a mask is given)
against `grouped_attention`; each of the layer's matrix products ([rows, in] x [in, out],
float32) per BLAS library; and a whole verifier pass of 1, 2 and 4 tokens (30 random-weight layers
of that shape, the microseconds of its graph's replay) with each attention. On a CPU only the math
and grouped rows run, eagerly (the other backend, both libraries and the graphs are CUDA's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.evaluation.baseline import device_name
from eagle3.verifier import forward
from eagle3.verifier.forward import attend_grouped, capture_graph

ROWS = (1, 2, 4)
PRODUCTS = {"q/o 576x576": (576, 576), "k/v 576x192": (576, 192), "gate/up 576x1536": (576, 1536), "down 1536x576": (1536, 576)}
BACKENDS = {"memory-efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def replayed(run, cuda: bool):
    """`run` as a CUDA graph's replay where there is a GPU (captured as decoding captures), else itself."""
    return capture_graph(run, None)[0].replay if cuda else run


def microseconds(run, repeats: int, cuda: bool) -> float:
    run()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def attention_rows(device: str, keys: int, repeats: int) -> dict:
    cuda = device == "cuda"
    k, v = (torch.randn(1, 3, keys, 64, device=device).repeat_interleave(3, dim=1) for _ in range(2))  # as transformers repeats KV heads
    rows = {}
    for name, backend in BACKENDS.items() if cuda else [("math", SDPBackend.MATH)]:
        times = []
        for q in ROWS:
            query = torch.randn(1, 9, q, 64, device=device)
            mask = torch.zeros(1, 1, q, keys, device=device)
            mask[..., keys // 2 :] = torch.finfo(torch.float32).min  # half the buffer past the sequence

            def run(query=query, mask=mask, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask)

            times.append(microseconds(replayed(run, cuda), repeats, cuda))
        rows[f"attention, {name}"] = times
    rows |= attention_in_a_pass(device, keys, repeats)
    return rows


def attention_in_a_pass(device: str, keys: int, repeats: int) -> dict:
    """Attention as a decode pass runs it on the 3 KV heads of the buffers: transformers' sdpa path
    (KV heads repeated, then the math backend) against `grouped_attention` (no repeat)."""
    cuda = device == "cuda"
    k, v = (torch.randn(1, 3, keys, 64, device=device) for _ in range(2))
    scaling = 64**-0.5
    variants = {
        "math, KV repeated in the pass": lambda query, mask: F.scaled_dot_product_attention(
            query, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=scaling
        ),
        "grouped (forward.grouped_attention)": lambda query, mask: attend_grouped(query, k, v, mask, scaling),
    }
    rows = {}
    for name, attend in variants.items():
        times = []
        for q in ROWS:
            query = torch.randn(1, 9, q, 64, device=device)
            mask = torch.zeros(1, 1, q, keys, device=device)
            mask[..., keys // 2 :] = torch.finfo(torch.float32).min

            def run(query=query, mask=mask, attend=attend):
                with sdpa_kernel([SDPBackend.MATH]):
                    return attend(query, mask)

            times.append(microseconds(replayed(run, cuda), repeats, cuda))
        rows[f"attention, {name}"] = times
    return rows


def product_rows(repeats: int) -> dict:
    rows = {}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for name, (n_in, n_out) in PRODUCTS.items():
            weight = torch.randn(n_out, n_in, device="cuda")
            times = []
            for m in ROWS:
                x = torch.randn(m, n_in, device="cuda")
                times.append(microseconds(replayed(lambda x=x, weight=weight: F.linear(x, weight), True), repeats, True))
            rows[f"{name}, {library}"] = times
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def pass_rows(keys: int, repeats: int) -> dict:
    """A whole graphed decode pass of a random-weight verifier of SmolLM2-135M-Instruct's shape, as
    `StaticForward` replays it, with transformers' attention and with `grouped_attention` at every
    query count (decoding keeps transformers' below `GROUPED_MIN_QUERIES`)."""
    from draft_speed import random_verifier

    from eagle3.verifier.loading import load_text_model

    with tempfile.TemporaryDirectory() as tmp:
        model = load_text_model(random_verifier(Path(tmp) / "verifier", 30), torch.float32, "cuda")
    rows = {}
    for name, min_queries in (("verifier pass, transformers' attention", max(ROWS) + 1), ("verifier pass, grouped attention", 1)):
        passes = forward.StaticForward(model, None, keys)
        before, forward.GROUPED_MIN_QUERIES = forward.GROUPED_MIN_QUERIES, min_queries
        try:
            with torch.inference_mode():
                times = []
                for q in ROWS:
                    passes.reset()
                    passes(list(range(100, 300)))
                    passes(list(range(q)))  # captured here
                    times.append(microseconds(passes._passes.captured[q][0].replay, repeats, True))
        finally:
            forward.GROUPED_MIN_QUERIES = before
        rows[name] = times
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=600, help="KV buffer positions (the longest sequence decoded)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows = attention_rows(device, args.keys, args.repeats if cuda else 10)
    if cuda:
        rows |= product_rows(args.repeats) | pass_rows(args.keys, args.repeats)
    print(f"{device_name(torch.device(device))}; float32; {args.keys} KV positions; microseconds per replay")
    print(f"{'':<44}" + "".join(f"{f'{m} rows':>10}" for m in ROWS))
    for name, times in rows.items():
        print(f"{name:<44}" + "".join(f"{t:>10.1f}" for t in times))
    summary = {"device": device_name(torch.device(device)), "torch": torch.__version__, "keys": args.keys, "rows": list(ROWS), "us": rows}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
