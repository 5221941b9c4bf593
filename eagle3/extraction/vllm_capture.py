"""Hidden-state capture inside vLLM's workers: the worker extension of `extract.backend=vllm-engine`.

vLLM imports this module in every worker process (`LLM(worker_extension_cls=EXTENSION)`) and mixes
`HiddenStateCaptureExtension` into its worker class; its methods are called from the engine's
driver with `llm.collective_rpc(name)`. It runs in the vLLM environment, so it imports torch,
safetensors and (lazily) vllm, nothing else of the pipeline.

Why hooks: vLLM's own `extract_hidden_states` method refuses MLA verifiers and its CPU build's
connector needs CUDA; forward hooks need only the decoder's layer list and final norm, so they
work for whatever vLLM serves (dense, MoE, MLA, quantized) under tensor, expert and pipeline
parallelism.

What a slot holds (speculators' format): aux id k is the residual stream after k decoder layers
(0 = the embeddings), the last slot the final PRE-norm state. vLLM's decoder layers return
`(hidden_states, residual)` apart because the next RMSNorm fuses the add (Llama, Qwen3-MoE,
DeepSeek-V2/V3 in vLLM 0.32), so the stream after a layer is their sum, and the final norm is
called as `norm(hidden_states, residual)`. A layer that returns one tensor (vLLM's Transformers
backend) is taken as is.

How flattened rows map back to requests (vLLM 0.32 internals; a mismatch raises, never guesses):
- Each step runs one forward over `[num_tokens (+ padding), H]` rows. Request i of the step owns
  rows `query_start_loc[i]:query_start_loc[i+1]`, in the order of the runner's `req_ids`; rows past
  the last request are padding. Model runner V1 (`GPUModelRunner`, base of `CPUModelRunner`) keeps
  them in `input_batch.req_ids` and `query_start_loc.np`, written before the forward; runner V2
  returns them from `prepare_inputs` (stashed here; untested: the CPU build has no V2).
- The rows' offset in the prompt is the request's `num_computed_tokens` in the step's
  `SchedulerOutput`, so a prompt split over steps (chunked prefill) is put back together, and a
  recomputed chunk (preemption) overwrites the first. `execute_model` is wrapped so that forwards
  outside a real step (profiling, dummy runs) capture nothing.
- Checks per forward: rows per request equal the scheduler's count, 1-D positions equal
  `offset + arange`. The driver checks each request's captured token ids against its prompt.
- The batch pre-hook sits on the runner's top-level model, not on the decoder:
  `@support_torch_compile` replaces the decoder class's `__call__`, so hooks on the decoder itself
  never fire (hooks on its submodules do).

Requires `enforce_eager=True` (a torch.compile'd backbone or a CUDA graph runs no Python hooks)
and prefix caching off (a cached prefix is never recomputed, so never captured): `start` refuses
both. Tensor-parallel ranks hold the same states after the all-reduce, so only TP rank 0 keeps
them; each pipeline stage keeps the slots of its own layers, merged by the driver.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["EXTENSION", "HiddenStateCaptureExtension", "find_decoder", "unpack_states"]

EXTENSION = f"{__name__}.HiddenStateCaptureExtension"
ModuleKind = TypeVar("ModuleKind", bound=nn.Module)


def _submodule(module: nn.Module, name: str, kind: type[ModuleKind]) -> ModuleKind:
    """`module.<name>`, checked to be a `kind`: torch types any attribute of a module as Tensor | Module."""
    child = getattr(module, name)
    if not isinstance(child, kind):
        raise RuntimeError(f"{type(module).__name__}.{name} is a {type(child).__name__}, not a {kind.__name__}")
    return child


def find_decoder(model: nn.Module, num_layers: int) -> nn.Module:
    """The text decoder inside a vLLM model: the module with a `layers` ModuleList and a `norm`,
    preferring one of `num_layers` layers (a multimodal model's `language_model.model`, not its
    vision tower)."""
    candidates = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layers", None), nn.ModuleList) and isinstance(getattr(m, "norm", None), nn.Module)
    ]
    exact = [m for m in candidates if len(_submodule(m, "layers", nn.ModuleList)) == num_layers]
    if not (exact or candidates):
        raise RuntimeError(f"no decoder (a module with .layers and .norm) in {type(model).__name__}: cannot hook its layers")
    return (exact or candidates)[0]


def _residual_stream(output: Any) -> torch.Tensor:
    """A vLLM decoder layer's output -> the residual stream after it."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


class _Chunk:
    """One request's rows of one forward: where they start in its prompt, their token ids, and
    each captured slot's rows [rows, H] (bf16, on the host)."""

    def __init__(self, offset: int, token_ids: torch.Tensor | None):
        self.offset, self.token_ids = offset, token_ids
        self.slots: dict[int, torch.Tensor] = {}

    def rows(self) -> int:
        return next(iter(self.slots.values())).shape[0] if self.slots else len(self.token_ids) if self.token_ids is not None else 0


class _Capture:
    """The hooks of one worker and what they captured since the last fetch, per request."""

    def __init__(self, worker, aux_layer_ids: list[int]):
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        runner = worker.model_runner
        config = runner.vllm_config
        if not config.model_config.enforce_eager:
            raise RuntimeError("hidden-state hooks need enforce_eager=True: a compiled backbone or CUDA graph runs no Python hooks")
        if config.cache_config.enable_prefix_caching:
            raise RuntimeError("hidden-state capture needs enable_prefix_caching=False: a cached prefix is never recomputed")
        text = config.model_config.hf_text_config
        n = text.num_hidden_layers
        if (
            config.model_config.dtype == torch.float16
            and "deepseek" in text.model_type
            and getattr(text, "routed_scaling_factor", 1.0) != 1.0
        ):
            # vLLM's DeepSeek layers scale the residual stream by 1/routed_scaling_factor in fp16 (overflow guard)
            raise RuntimeError("a DeepSeek verifier in float16 carries a rescaled residual stream in vLLM: use bfloat16")
        if any(not 0 <= k < n for k in aux_layer_ids):
            raise RuntimeError(f"aux layer ids {aux_layer_ids} must lie in [0, {n - 1}]")

        self.runner = runner
        self.model = runner.get_model()
        self.decoder = find_decoder(self.model, n)
        self.layers = _submodule(self.decoder, "layers", nn.ModuleList)
        self.rank = (get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        self.keep = self.rank[0] == 0  # states are replicated over tensor-parallel ranks
        self.requests: dict[str, list[_Chunk]] = {}  # internal request id -> chunks in capture order
        self.gaps: dict[str, int] = {}  # request first seen past its prompt's start (a prefix-cache hit)
        self.step = None  # the running step's SchedulerOutput; None outside execute_model
        self.v2_batch = None  # model runner V2: the step's InputBatch
        self.layout: tuple[list[tuple[str, int, int]], int | None] | None = None  # this forward's (req, start row, end row), row count
        self.stats = {"forwards": 0, "forwards_skipped": 0, "max_requests_per_forward": 0, "split_requests": 0}
        self.handles = [self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        start, end = getattr(self.decoder, "start_layer", 0), getattr(self.decoder, "end_layer", len(self.layers))
        for slot, k in enumerate(aux_layer_ids):
            if k == 0 and start == 0:
                self.handles.append(
                    _submodule(self.decoder, "embed_tokens", nn.Module).register_forward_hook(self._output_hook(slot, layer=False))
                )
            elif k > 0 and start <= k - 1 < end:  # this pipeline stage holds layer k-1
                self.handles.append(self.layers[k - 1].register_forward_hook(self._output_hook(slot, layer=True)))
        if end == len(self.layers):  # the last pipeline stage holds the final norm
            self.handles.append(_submodule(self.decoder, "norm", nn.Module).register_forward_pre_hook(self._norm_hook(len(aux_layer_ids))))
        self._wrap_runner()

    def describe(self) -> dict:
        return {
            "rank": list(self.rank),
            "keeps_states": self.keep,
            "decoder": type(self.decoder).__name__,
            "runner": type(self.runner).__name__,
            "layers": len(self.layers),
        }

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for name in ("execute_model", "prepare_inputs"):
            self.runner.__dict__.pop(name, None)  # back to the class's method

    def _wrap_runner(self) -> None:
        """Instance-level wrappers that tell a real step (its SchedulerOutput known) from dummy runs."""
        execute = self.runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self.step, self.v2_batch, self.layout = scheduler_output, None, None
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                self.step, self.v2_batch, self.layout = None, None, None

        self.runner.__dict__["execute_model"] = execute_model
        if any(c.__module__ == "vllm.v1.worker.gpu.model_runner" for c in type(self.runner).__mro__):  # model runner V2
            prepare = self.runner.prepare_inputs

            def prepare_inputs(*args, **kwargs):
                self.v2_batch = prepare(*args, **kwargs)
                return self.v2_batch

            self.runner.__dict__["prepare_inputs"] = prepare_inputs

    def _rows_of_requests(self) -> list[tuple[str, int, int]]:
        if self.v2_batch is not None:
            batch = self.v2_batch
            num, req_ids, starts = batch.num_reqs, list(batch.req_ids), batch.query_start_loc_np
        elif hasattr(self.runner, "input_batch") and hasattr(self.runner, "query_start_loc"):
            num = self.runner.input_batch.num_reqs
            req_ids, starts = self.runner.input_batch.req_ids[:num], self.runner.query_start_loc.np
        else:
            raise RuntimeError(f"model runner {type(self.runner).__name__}: unknown layout, cannot map rows to requests")
        return [(req_ids[i], int(starts[i]), int(starts[i + 1])) for i in range(num)]

    def _on_forward(self, _module, args, kwargs) -> None:
        """Once per forward, before it: which rows belong to which request at which prompt offset,
        checked against the scheduler; opens a chunk for each request of the step."""
        self.layout = None
        if self.step is None:
            self.stats["forwards_skipped"] += 1
            return
        rows = self._rows_of_requests()
        self.stats["forwards"] += 1
        self.stats["max_requests_per_forward"] = max(self.stats["max_requests_per_forward"], len(rows))
        offsets = {r.req_id: r.num_computed_tokens for r in self.step.scheduled_new_reqs}
        cached = self.step.scheduled_cached_reqs
        offsets.update(zip(cached.req_ids, cached.num_computed_tokens))
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        for req_id, a, b in rows:
            scheduled = self.step.num_scheduled_tokens.get(req_id)
            if scheduled != b - a:
                raise RuntimeError(f"request {req_id}: {b - a} rows in the forward, {scheduled} scheduled: cannot map rows to requests")
            offset = offsets[req_id]
            if positions is not None and positions.dim() == 1:
                expected = torch.arange(offset, offset + b - a, device=positions.device)
                if not torch.equal(positions[a:b].to(expected.dtype), expected):
                    raise RuntimeError(f"request {req_id}: positions of its rows are not {offset}..{offset + b - a - 1}")
            if not self.keep:
                continue
            chunks = self.requests.setdefault(req_id, [])
            if offset > 0 and not chunks:
                self.gaps[req_id] = offset
            ids = input_ids[a:b].detach().to("cpu", torch.int64, copy=True) if input_ids is not None else None
            chunks.append(_Chunk(offset, ids))
        self.layout = (rows, positions.shape[-1] if positions is not None else None)

    def _put(self, slot: int, x: torch.Tensor) -> None:
        if self.layout is None and self.step is not None:
            self._on_forward(None, (), {})  # the top-level pre-hook did not fire: rows without positions
        if self.layout is None:
            return
        rows, n_rows = self.layout
        if n_rows is not None and x.shape[0] != n_rows:  # a sequence-parallel MoE output, sharded over TP ranks (every rank gathers)
            from vllm.distributed import tensor_model_parallel_all_gather

            x = tensor_model_parallel_all_gather(x.contiguous(), 0)[:n_rows]
        if not self.keep:
            return
        host = x.detach().to("cpu", torch.bfloat16)  # one device-to-host copy per slot and forward; requests' rows are views
        for req_id, a, b in rows:
            self.requests[req_id][-1].slots[slot] = host[a:b]

    def _output_hook(self, slot: int, layer: bool):
        def hook(_module, _args, output):
            self._put(slot, _residual_stream(output) if layer else output)

        return hook

    def _norm_hook(self, slot: int):
        def hook(_module, args):
            hidden, residual = args[0], args[1] if len(args) > 1 else None
            self._put(slot, hidden if residual is None else hidden + residual)

        return hook

    def fetch(self) -> bytes:
        """Every request captured since the last fetch, packed (see `unpack_states`), then forgotten."""
        from safetensors.torch import save

        flat: dict[str, torch.Tensor] = {}
        for req_id, chunks in self.requests.items():
            if req_id in self.gaps:
                raise RuntimeError(f"request {req_id}: first computed at prompt position {self.gaps[req_id]} (a prefix-cache hit?)")
            self.stats["split_requests"] += len(chunks) > 1
            length = max(c.offset + c.rows() for c in chunks)
            covered = torch.zeros(length, dtype=torch.bool)
            ids = torch.full((length,), -1, dtype=torch.int64)
            slots: dict[int, torch.Tensor] = {}
            for chunk in chunks:  # in capture order: a recomputed chunk overwrites the first
                end = chunk.offset + chunk.rows()
                covered[chunk.offset : end] = True
                if chunk.token_ids is not None:
                    ids[chunk.offset : end] = chunk.token_ids
                for slot, rows in chunk.slots.items():
                    slots.setdefault(slot, torch.zeros(length, rows.shape[-1], dtype=rows.dtype))[chunk.offset : end] = rows
            if not bool(covered.all()):
                raise RuntimeError(f"request {req_id}: prompt positions {(~covered).nonzero().flatten()[:8].tolist()} never captured")
            if any(c.token_ids is not None for c in chunks):
                flat[f"{req_id}|token_ids"] = ids
            flat.update({f"{req_id}|slot{slot}": rows for slot, rows in slots.items()})
        self.requests, self.gaps = {}, {}
        return save(flat)


def unpack_states(payload: bytes) -> dict[str, dict]:
    """A worker's `eagle3_fetch_states` answer -> {internal request id: {"token_ids": [L] int64 or
    None (a later pipeline stage), "slots": {slot: [L, H] bf16}}}."""
    from safetensors.torch import load

    out: dict[str, dict] = {}
    for key, tensor in load(payload).items():
        req_id, field = key.rsplit("|", 1)
        entry = out.setdefault(req_id, {"token_ids": None, "slots": {}})
        if field == "token_ids":
            entry["token_ids"] = tensor
        else:
            entry["slots"][int(field.removeprefix("slot"))] = tensor
    return out


class HiddenStateCaptureExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); each method is an RPC of
    `llm.collective_rpc`. vLLM refuses an extension attribute that the worker class also has, so
    every name here carries the `eagle3_` prefix.

    A fetch answers bytes: collective_rpc results cross vLLM's msgpack serializer, which turns a
    tensor in an untyped result into nested lists."""

    def eagle3_start_capture(self, aux_layer_ids: list[int]) -> dict:
        """Hook the aux layers (then the final pre-norm state); replaces an earlier capture."""
        self.eagle3_stop_capture()
        self.eagle3_capture = _Capture(self, list(aux_layer_ids))
        return self.eagle3_capture.describe()

    def eagle3_fetch_states(self) -> bytes:
        return self.eagle3_capture.fetch()

    def eagle3_capture_stats(self) -> dict:
        """Since the last call: forwards captured and skipped (dummy runs), the most requests in one
        forward, and the prompts split over several steps (counted as they are fetched)."""
        stats, capture = self.eagle3_capture.stats, self.eagle3_capture
        capture.stats = dict.fromkeys(stats, 0)
        return stats

    def eagle3_stop_capture(self) -> None:
        capture = getattr(self, "eagle3_capture", None)
        if capture is not None:
            capture.close()
            del self.eagle3_capture
