"""The program the vLLM environment's python runs for `extract.backend=vllm-engine`: it holds one
`vllm.LLM` with the capture extension (`eagle3.extraction.vllm_capture`) and writes the hidden-state
files of the shards it is handed. Started and fed by `eagle3.extraction.vllm_engine`.

    python -m eagle3.extraction.vllm_engine_driver SPEC_JSON REPLY_FD

Protocol: one JSON request per line on stdin, `{"shard_dir": ..., "files": [[name, token_ids], ...]}`;
one JSON reply per line on REPLY_FD: `{"ready": {...}}` once the engine is up, `{"progress": tokens}`
while a request runs, `{"written": {name: sha256}, "stats": {...}}` when its files are on disk, or
`{"error": {"type", "message", "path"}}` (then it exits). stdin closed: the engine shuts down.
vLLM logs to stdout and stderr, hence the separate reply pipe.

Each request's prompts go to the engine `batch_tokens` at a time as prefill-only requests
(`max_tokens=1`, one `generate` call: vLLM batches and chunks them as it schedules), then every
worker's captured rows are fetched, merged per request (pipeline stages hold different slots),
checked against the prompt's token ids and written in speculators' format, `hidden_states`
[seq, 4, H] bf16 and `token_ids` [seq] int64, atomically (spec `storage` fp8: quantized as the
in-process route does, `eagle3.extraction.storage`). A batch's states wait in host memory
until written (about three copies of 8*H bytes a token: the worker's, the fetched bytes, the file).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

from eagle3.extraction.storage import encode
from eagle3.extraction.vllm_capture import EXTENSION, unpack_states
from eagle3.store.files import atomic_write_bytes

__all__ = ["capture_states", "main"]


class _FileError(Exception):
    """A file that must not be written (non-finite values): the parent raises it as ArtifactError."""

    def __init__(self, path: Path, message: str):
        super().__init__(message)
        self.path = path


def _external_id(internal: str, known: set[str]) -> str:
    """The id `LLM.generate` gave a request, from the one its workers see: vLLM appends a dash and
    8 random characters (`InputProcessor.assign_request_id`) unless told not to."""
    if internal in known:
        return internal
    head, _, tail = internal.rpartition("-")
    if head in known and len(tail) == 8:
        return head
    raise RuntimeError(f"a worker captured request {internal!r}, which this batch did not send")


def capture_states(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill every prompt once with the capture hooks on (one `generate` call); each prompt's
    states [seq, slots, H] bf16, in input order.

    Raises:
        RuntimeError: a request's rows, slots or token ids do not add up (a mapping bug, never guessed around).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
        use_tqdm=False,
    )
    ids = [o.request_id for o in outputs]  # in input order
    known = set(ids)
    merged: dict[str, dict] = {}
    for payload in llm.collective_rpc("eagle3_fetch_states"):  # one per worker
        for internal, fetched in unpack_states(payload).items():
            into = merged.setdefault(_external_id(internal, known), {"token_ids": None, "slots": {}})
            if fetched["token_ids"] is not None:
                into["token_ids"] = fetched["token_ids"]
            into["slots"].update(fetched["slots"])
    states = []
    for prompt, request in zip(prompts, ids):
        entry = merged.get(request)
        if entry is None or not entry["slots"]:
            raise RuntimeError(
                f"request {request}: no states captured (a compiled backbone runs no hooks: the engine needs enforce_eager=True)"
            )
        slots = sorted(entry["slots"])
        if slots != list(range(len(slots))):
            raise RuntimeError(f"request {request}: slots {slots} captured, not 0..{len(slots) - 1}")
        stacked = torch.stack([entry["slots"][s] for s in slots], dim=1)  # [seq, slots, H]
        if stacked.shape[0] < len(prompt):
            raise RuntimeError(f"request {request}: {stacked.shape[0]} rows captured for a {len(prompt)}-token prompt")
        if entry["token_ids"] is not None and entry["token_ids"][: len(prompt)].tolist() != prompt:
            raise RuntimeError(f"request {request}: the captured token ids are not its prompt's (rows mapped to the wrong request)")
        states.append(stacked[: len(prompt)])
    return states


def _write(path: Path, states: torch.Tensor, token_ids: list[int], storage: str) -> str:
    """The file in speculators' format, as the in-process route writes it; its sha256."""
    from safetensors.torch import save

    non_finite = (~torch.isfinite(states)).sum(dim=(0, 2))  # before encoding: FP8 has no inf
    if non_finite.any():
        raise _FileError(path, f"field 'hidden_states': non-finite values per layer slot {non_finite.tolist()}")
    fields = {name: tensor.contiguous() for name, tensor in encode(states, storage).items()}
    payload = save({**fields, "token_ids": torch.tensor(token_ids, dtype=torch.int64)})
    atomic_write_bytes(path, payload)
    return hashlib.sha256(payload).hexdigest()


def _batches(files: list[list], budget: int) -> list[list]:
    """Consecutive groups of at most `budget` prompt tokens (a longer prompt alone)."""
    batches: list[list] = []
    current: list = []
    tokens = 0
    for entry in files:
        if current and tokens + len(entry[1]) > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(entry)
        tokens += len(entry[1])
    return batches + ([current] if current else [])


def _serve(llm, spec: dict, send) -> None:
    for line in sys.stdin:
        request = json.loads(line)
        shard_dir, written = Path(request["shard_dir"]), {}
        for batch in _batches(request["files"], spec["batch_tokens"]):
            for (name, token_ids), states in zip(batch, capture_states(llm, [ids for _, ids in batch])):
                written[name] = _write(shard_dir / name, states, token_ids, spec["storage"])
            send({"progress": sum(len(ids) for _, ids in batch)})
        send({"written": written, "stats": llm.collective_rpc("eagle3_capture_stats")[0]})


def _stop_with_the_engine(*_) -> None:
    """SIGTERM (this process's parent dying): take vLLM's engine core and workers along, now. They are
    in this session's process group. Python's default would end this process alone, and the engine
    would stop only if its version watches its client (vLLM 0.32's core does, within ~0.5 s); ignored,
    the engine would finish the shard it has before anything stopped it."""
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop_with_the_engine)  # started as its session's leader: group 0 is the engine's
    spec, reply_fd = json.loads(argv[1]), int(argv[2])
    os.set_inheritable(reply_fd, False)  # vLLM's own processes must not hold the reply pipe open
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def send(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")

    try:
        from vllm import LLM, __version__

        llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            trust_remote_code=spec["trust_remote_code"],
            max_model_len=spec["max_model_len"],
            worker_extension_cls=EXTENSION,
            enforce_eager=True,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            **spec["llm_args"],
        )
        workers = llm.collective_rpc("eagle3_start_capture", args=(spec["aux_layer_ids"],))
        send({"ready": {"vllm": __version__, "workers": workers}})
        _serve(llm, spec, send)
    except Exception as exc:
        import traceback

        traceback.print_exc()  # into the engine's log
        send({"error": {"type": type(exc).__name__, "message": str(exc), "path": str(getattr(exc, "path", "")) or None}})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
