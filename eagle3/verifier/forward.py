"""The verifier's forward pass as decoding calls it: tokens appended to a KV cache, the cache cut
back after rejected drafts, and each pass's argmax and aux hidden states returned.

Decoding a small verifier on a GPU is bound by kernel launches, not by compute: each of
transformers' eager forwards launches hundreds of kernels from Python (`bench/decode_speed.py`
measures it). `StaticForward` keeps the KV cache in fixed buffers and passes its own attention
mask, so every pass of one length runs the same kernels on the same addresses; on CUDA each
length is captured once as a CUDA graph and replayed. A replay runs the kernels the eager pass
runs, so it computes what the eager pass computes. On CUDA every pass multiplies with cuBLASLt
(`decode_matmuls`), and passes after the prompt's attend with kernels made for a few queries
(`decode_attention`: for several tokens, without copying the KV buffers).
Evaluation uses it on a GPU for verifiers whose layers are all full attention and which decode
the first prompt as transformers' own cache does (`eagle3.evaluation.forward_choice`); the others
(sliding windows, linear attention, layers that cannot be captured), and every verifier on a CPU,
decode with `DynamicForward`, on transformers' own cache and masks.
"""

from __future__ import annotations

import contextlib
from typing import Any, overload

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.loading import text_config

__all__ = [
    "DynamicForward",
    "FixedCache",
    "Graphs",
    "StaticForward",
    "attend_grouped",
    "aux_states",
    "capture_graph",
    "decode_attention",
    "decode_matmuls",
    "drop_last",
    "full_attention_only",
    "grouped_attention",
]


def drop_last(cache: DynamicCache, n: int) -> None:
    """Forget the last `n` positions of `cache` (a negative crop: transformers 5.18 drops positive
    ones; and crop(-0) would empty the cache on some versions)."""
    if n:
        cache.crop(-n)


@overload
def aux_states(capture: HiddenStateCapture) -> torch.Tensor: ...
@overload
def aux_states(capture: HiddenStateCapture | None) -> torch.Tensor | None: ...
def aux_states(capture: HiddenStateCapture | None) -> torch.Tensor | None:
    """The last forward's aux states [tokens, 3, H], what an EAGLE-3 draft reads (None without capture)."""
    return capture.stacked()[0, :, :-1].float() if capture else None


@contextlib.contextmanager
def decode_matmuls(device: torch.device):
    """cuBLASLt for the matrix products of a decode pass on CUDA: for a few rows in float32 cuBLAS
    picks SIMT kernels that take up to twice as long (on an H100, [4, 576] x [576, 576]: 10.4 us
    against 4.5; `bench/decode_kernels.py`), the bulk of what a 4-token verifier pass cost over a
    1-token one. Set around each pass (and its capture: a graph replays the kernels it captured) and
    restored after."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def decode_attention(config=None):
    """The attention kernels for a pass of a few queries over fixed KV buffers. Scaled-dot-product
    attention runs PyTorch's math backend (matmuls and a softmax): its fused float32 kernel
    (memory-efficient attention) walks all `max_len` keys in one block per head, on an H100 73 us a
    layer for SmolLM2's shape over 600 positions against math's 23 (`bench/decode_kernels.py`), half
    of a graphed verifier pass. For a model whose `config` runs transformers' sdpa attention,
    `grouped_attention` stands in for it (the name stays "sdpa": models that branch on it keep their
    path). Set around each pass (a CUDA graph replays what its capture ran) and undone after; the
    draft's compiled steps, which pass no config, trace the math backend's context alone."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return sdpa_kernel([SDPBackend.MATH])
    return _grouped_in_place_of_sdpa()


@contextlib.contextmanager
def _grouped_in_place_of_sdpa():
    """`grouped_attention` as transformers' "sdpa" entry (a local one in its table, removed again
    after, or the one there before put back), with the math backend for what it hands on."""
    had_entry = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = grouped_attention
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        if had_entry:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]


GROUPED_MIN_QUERIES = 2
"""Passes of fewer queries keep transformers' attention: on an H200 plain greedy decoding (one-token
passes) took 3.20 ms a pass with grouped attention against 3.11 without it, across two commits
whose loops differ too, while one layer's attention alone was faster grouped (25.4 against 27.3 us;
bench/results). `bench/decode_kernels.py` times whole verifier passes both ways on one commit."""


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention for a pass of a few queries over fixed KV buffers, without copying
    them: each KV head's query heads are stacked as the rows of one product with it. With a mask,
    transformers repeats the K/V heads of the whole buffer in every layer of every pass (and the math
    backend scales every key): on an H200, 41.3 us a layer for 4 queries against 25.8 here
    (`bench/decode_kernels.py`). `query` [b, Hq, q, d], `key` / `value` [b, Hkv, L, d / dv],
    `attention_mask` additive [b, 1, q, L]; returns ([b, q, Hq, dv], None), as transformers'
    attention functions do.

    transformers' own sdpa attention runs instead for fewer than `GROUPED_MIN_QUERIES` queries,
    outside float32 (the math backend computes half precision in float32; this would not), and for
    what only it handles: no or a boolean mask, dropout, a position bias, a paged cache."""
    plain = (
        query.shape[2] >= GROUPED_MIN_QUERIES
        and query.dtype == torch.float32
        and not dropout
        and attention_mask is not None
        and attention_mask.is_floating_point()
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
    )
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return attend_grouped(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling), None


def attend_grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with each KV head's query heads as rows of one product:
    `grouped_attention`'s arithmetic, shapes as there; returns [b, q, Hq, dv]."""
    b, heads, q, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query head h reads KV head h // group, as transformers' repeat_kv pairs them
    scores = torch.matmul(query.reshape(b, kv_heads, group * q, d) * scale, key.transpose(-1, -2))
    probs = torch.softmax(scores.view(b, kv_heads, group, q, length) + mask[:, :, None], dim=-1)
    out = torch.matmul(probs.view(b, kv_heads, group * q, length), value)
    return out.view(b, heads, q, value.shape[-1]).transpose(1, 2)


class DynamicForward:
    """Any verifier, eagerly, on transformers' `DynamicCache`."""

    kind = "transformers' dynamic KV cache"  # what decoding speeds are measured with
    graphs = False  # records no CUDA graphs (StaticForward's on a GPU)

    def __init__(self, model, capture: HiddenStateCapture | None):
        self.model, self.capture = model, capture
        self.device = next(model.parameters()).device
        self.reset()

    def reset(self) -> None:
        """Start a new sequence."""
        self.cache = DynamicCache()

    def __call__(self, ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `ids`; the verifier's argmax after each [len(ids)], and their aux states [len(ids), 3, H]
        (None without capture), on the device and not yet read."""
        out = self.model(input_ids=torch.as_tensor(ids, device=self.device)[None], past_key_values=self.cache, use_cache=True)
        return out.logits[0].argmax(-1), aux_states(self.capture)

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens."""
        drop_last(self.cache, n)

    def record_graphs(self, max_tokens: int) -> None:
        """Nothing to record: eager passes."""


class FixedCache(Cache):
    """K/V buffers of `max_len` positions per layer, written at `positions` (a device tensor the caller
    sets before each forward). It ignores the cache_kwargs a transformers version passes, so one
    code path serves them all; the caller's mask hides every position past the current pass."""

    def __init__(self, max_len: int):
        super().__init__(layers=[])
        self.max_len = max_len
        self.positions: torch.Tensor | None = None
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx not in self.keys:  # on the first (eager) pass, never inside a graph capture
            batch, heads, _, _ = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros(batch, heads, self.max_len, key_states.shape[-1])
            self.values[layer_idx] = value_states.new_zeros(batch, heads, self.max_len, value_states.shape[-1])
        if self.positions is None:
            raise RuntimeError("no write positions for the KV buffers: the caller sets `positions` before each forward")
        self.keys[layer_idx].index_copy_(2, self.positions, key_states)
        self.values[layer_idx].index_copy_(2, self.positions, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def clear(self, start: int) -> None:
        """Zero every position from `start` on: the mask gives them weight 0, but 0 x NaN is NaN, so an
        overflow in a forgotten entry would otherwise reach every later pass."""
        for buffer in (*self.keys.values(), *self.values.values()):
            buffer[:, :, start:].zero_()

    def clear_at(self, positions: torch.Tensor) -> None:
        """Zero the entries at `positions` (a device tensor): `clear` for positions known only on the device."""
        for buffer in (*self.keys.values(), *self.values.values()):
            buffer.index_fill_(2, positions, 0.0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # read only where position_ids are missing (ours never are) or for masks (ours are given)


def capture_graph(run, pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Record `run()` as a CUDA graph: (the graph, what the recorded call returned: tensors each replay
    overwrites). A warm-up runs it for real first, on a side stream with host synchronization
    forbidden: a layer that synchronizes (MoE routing by `nonzero`, say, or a `.item()`) cannot be
    captured, and the warm-up raises on it before a capture could fail halfway."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    debug_mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            run()
    finally:
        torch.cuda.set_sync_debug_mode(debug_mode)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class Graphs:
    """CUDA graphs of one computation, one per input shape (`key`), each replayed on input buffers of
    its own: the first call with a key captures `run(**inputs)` on copies of `inputs`; later calls
    copy their inputs into those and replay. Returns what the recorded call returned: tensors that the
    next replay of any key may overwrite (the graphs share one memory pool), so read or copy them
    first. `warm`: run eagerly once before capturing (a torch.compile'd function compiles a new shape
    there, and compiling synchronizes, which a capture forbids)."""

    def __init__(self, warm: bool = False):
        self.warm = warm
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs of one computation never run at once
        self.captured: dict[Any, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], Any]] = {}

    def __call__(self, key, run, **inputs: torch.Tensor):
        entry = self.captured.get(key)
        if entry is None:
            buffers = {name: tensor.clone() for name, tensor in inputs.items()}
            if self.warm:
                run(**buffers)
            graph, out = capture_graph(lambda: run(**buffers), self.pool)
            entry = self.captured[key] = (graph, buffers, out)
        else:
            for name, tensor in inputs.items():
                entry[1][name].copy_(tensor)
        entry[0].replay()
        return entry[2]


class StaticForward:
    """A full-attention verifier on fixed KV buffers of `max_len` positions: eager on CPU, and on
    CUDA (`graphs`) every pass after a sequence's first replays a CUDA graph of its length."""

    def __init__(self, model, capture: HiddenStateCapture | None, max_len: int, graphs: bool | None = None):
        self.model, self.capture = model, capture
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.cache = FixedCache(max_len)
        self.columns = torch.arange(max_len, device=self.device)
        self.dtype = next(model.parameters()).dtype
        self.attention_config = text_config(model.config)  # what its attention layers read their implementation from
        self.length = 0
        self._passes = Graphs() if self.graphs else None  # by tokens passed
        self._clears = Graphs() if self.graphs else None  # by positions zeroed
        self.stale = 0  # positions [length, stale) hold entries of forgotten tokens, not yet zeroed
        implementation = self.attention_config._attn_implementation
        if implementation == "sdpa":  # `grouped_attention` for passes of several tokens in float32
            attention = "grouped attention" if self.dtype == torch.float32 else "math attention"
        else:
            attention = f"{implementation} attention"
        self.kind = f"fixed KV buffers, CUDA graphs, {attention}, cuBLASLt" if self.graphs else f"fixed KV buffers, {attention}"

    def reset(self) -> None:
        """Start a new sequence."""
        self.cache.clear(0)
        self.length = self.stale = 0

    def _pass(self, ids: torch.Tensor, positions: torch.Tensor, decode: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`decode`: a pass after the prompt's, a few queries (`decode_attention`); the prompt's
        pass keeps PyTorch's choice of attention kernel. Products use cuBLASLt either way on CUDA."""
        self.cache.positions = positions
        mask = torch.full((len(positions), len(self.columns)), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        mask.masked_fill_(self.columns[None, :] <= positions[:, None], 0.0)  # [q, max_len], additive: causal over the buffers
        with decode_matmuls(self.device), decode_attention(self.attention_config) if decode else contextlib.nullcontext():
            out = self.model(
                input_ids=ids, position_ids=positions[None], attention_mask=mask[None, None], past_key_values=self.cache, use_cache=True
            )
        return out.logits[0].argmax(-1), aux_states(self.capture)

    def __call__(self, ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `ids` (host ids, or a device tensor: queued behind whatever produced it, unread); the
        verifier's argmax after each [len(ids)], and their aux states [len(ids), 3, H] (None without
        capture), on the device and not yet read. On CUDA the argmax is a graph's own output: read it
        (or copy it) before the next pass.

        Raises:
            ValueError: the sequence would outgrow the `max_len` positions.
        """
        q, start = len(ids), self.length
        if start + q > self.cache.max_len:
            raise ValueError(f"a sequence of {start + q} tokens outgrows the KV buffers of {self.cache.max_len} positions")
        tokens = torch.as_tensor(ids, device=self.device)[None]
        positions = self.columns[start : start + q]
        if self.stale > start + q:  # forgotten entries this pass will not overwrite
            self._zero(start + q, self.stale)
        self.stale = start + q  # what this pass writes: forgotten again if it fails halfway
        if self._passes is None or not start:  # a sequence's first pass (the prompt) has a length of its own: eager
            argmax, aux = self._pass(tokens, positions, decode=start > 0)
        else:  # the capture's warm-up writes the K/V the replay writes
            argmax, aux = self._passes(q, lambda ids, positions: self._pass(ids, positions, decode=True), ids=tokens, positions=positions)
            aux = None if aux is None else aux.clone()  # the next replay overwrites it
        self.length += q
        return argmax, aux

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens. Their entries must read as zeros to every later pass (see
        `FixedCache.clear`), but the next pass writes its tokens over them: it zeroes only those it
        will not overwrite, before it runs. Speculative decoding's next pass is the next round's
        k + 1 tokens, more than it can reject, so it zeroes nothing (zeroing costs a kernel per layer
        and buffer)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot forget {n} of {self.length} tokens")
        self.length -= n
        self.stale = max(self.stale, self.length + n)

    @torch.inference_mode()
    def record_graphs(self, max_tokens: int) -> None:
        """Capture every graph a decode of passes of up to `max_tokens` tokens replays (greedy: 1;
        drafts of k tokens: up to k + 1), and every zeroing those passes meet (a rollback of up to
        `max_tokens` - 1 tokens, then a pass of at least one), so that none is captured inside a timed
        decode; then start a new sequence. Nothing to record without graphs. Shapes that do not fit the
        buffers after a one-token prompt cannot come up in a decode either: they are left out."""
        if not self.graphs:
            return
        self.reset()
        self([0])  # the sequence's first pass: eager, as a prompt's
        room = self.cache.max_len - 1
        for q in range(1, min(max_tokens, room) + 1):
            self([0] * q)
            self.rollback(q)
        for zeroed in range(1, min(max_tokens - 1, room)):
            self([0] * (zeroed + 1))
            self.rollback(zeroed + 1)
            self([0])  # writes one of the forgotten positions, zeroes the others
            self.rollback(1)
        self.reset()

    def _zero(self, start: int, end: int) -> None:
        """Zero the entries at positions [start, end); on CUDA a captured graph per count."""
        positions = self.columns[start:end]
        if self._clears is None:
            self.cache.clear_at(positions)
        else:
            self._clears(end - start, self.cache.clear_at, positions=positions)


def full_attention_only(config) -> bool:
    """Whether every layer of the verifier attends to the whole context (what `StaticForward`'s mask says)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return not getattr(config, "sliding_window", None)
