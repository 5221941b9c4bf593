"""How hidden states are stored, bf16 or FP8, and what that costs on disk: one place for the
arithmetic that extraction's disk check, `eagle3 plan` and the docs quote.

A sample's file holds, in speculators' format, `hidden_states` [seq, 4, H] and `token_ids` [seq]
int64. `bf16` (the default) stores the states in bfloat16: 8*H bytes a token (32 KiB at H 4096,
56 KiB at H 7168). `fp8` stores them exactly as hs-connectors 0.9.0's FP8 connector writes them and
its `FP8Transfer` reads them: `hidden_states` float8_e4m3fn and `hidden_states_scales` [seq, 1, 1]
float32, one scale per token over all four slots (amax / 448, at least 1e-12): 4*H + 4 bytes a
token, half. States are quantized from their bf16 rounding, as the connector receives them, so a
file is bit for bit the connector's. e4m3 keeps about 2.7% RMS error a value; speculators' PR 491
measured Qwen3-8B acceptance within 0.03 of bf16 states at k = 1..5.

Imports torch only (and lazily): vLLM's environment, where the engine route writes its files, has
no hs-connectors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `eagle3 plan` and the flow load this module, torch only where a step runs
    import torch

__all__ = [
    "MIN_FREE_BYTES",
    "ROOM_MARGIN",
    "SCALES_KEY",
    "SLOTS",
    "bytes_per_token",
    "decode",
    "encode",
    "per_token_arithmetic",
    "room_problem",
]

SLOTS = 4  # 3 aux layers and the final pre-norm state
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: each token's largest value lands on it
ROOM_MARGIN = 0.05  # token ids (8 B a token), file headers and done.json, on top of the states
MIN_FREE_BYTES = 512 * 2**20  # a floor, not an estimate (`eagle3 plan` estimates): below it even a tiny run fails midway


def bytes_per_token(hidden_size: int, storage: str) -> int:
    """Bytes of states a token takes in `storage` ('bf16' or 'fp8'), token ids and headers aside."""
    return SLOTS * hidden_size * 2 if storage == "bf16" else SLOTS * hidden_size + 4


def per_token_arithmetic(hidden_size: int, storage: str) -> str:
    """`bytes_per_token` with its terms, as messages and `eagle3 plan` print it."""
    terms = f"{SLOTS} slots x {hidden_size} x 2 B" if storage == "bf16" else f"{SLOTS} slots x {hidden_size} x 1 B + a 4 B scale"
    return f"{bytes_per_token(hidden_size, storage):,} B a token ({terms}, {storage})"


def _size(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def room_problem(tokens: int, hidden_size: int, storage: str, free_bytes: int) -> str | None:
    """Why the states of `tokens` tokens would not fit in `free_bytes`, with the numbers and the ways
    out; None when they fit with `ROOM_MARGIN` to spare, and the floor every run needs beside them."""
    need = tokens * bytes_per_token(hidden_size, storage)
    if need * (1 + ROOM_MARGIN) + MIN_FREE_BYTES <= free_bytes:
        return None
    ways = [] if storage == "fp8" else [f"extract.storage=fp8 stores them in {_size(tokens * bytes_per_token(hidden_size, 'fp8'))}"]
    ways += [
        "train.hidden_states=online stores none (the verifier computes them while the draft trains, every epoch)",
        "free space on the store's filesystem, or set store_dir elsewhere",
    ]
    return (
        f"{tokens:,} tokens of hidden states take {_size(need)} at {per_token_arithmetic(hidden_size, storage)}, plus "
        f"{ROOM_MARGIN:.0%} and {MIN_FREE_BYTES >> 20} MiB to spare, but the store's filesystem has {_size(free_bytes)} free. "
        f"Ways out: {'; '.join(ways)}."
    )


def encode(states: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """States [..., seq, 4, H] (any float dtype, any device) as a file stores them, without the
    token ids: {'hidden_states': bf16} or {'hidden_states': float8_e4m3fn, SCALES_KEY: [..., seq, 1, 1] float32}."""
    import torch

    rounded = states.to(torch.bfloat16)
    if storage == "bf16":
        return {"hidden_states": rounded}
    values = rounded.float()
    scale = (values.abs().amax(dim=(-2, -1), keepdim=True) / FP8_MAX).clamp(min=1e-12)  # one per token, over every slot
    return {"hidden_states": (values / scale).to(torch.float8_e4m3fn), SCALES_KEY: scale}


def decode(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The states in `dtype`, as hs-connectors' `FP8Transfer(dequantize_dtype=dtype)` hands them to
    training (the scale is cast to `dtype` before the multiply); bf16 states are only cast."""
    states = tensors["hidden_states"]
    if SCALES_KEY not in tensors:
        return states.to(dtype)
    return states.to(dtype) * tensors[SCALES_KEY].to(dtype)
