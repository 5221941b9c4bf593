"""Extract hidden states: run the verifier over every prepared sample and keep what the draft reads.

Samples are grouped `records_per_shard` to a shard, in dataset order. A shard is content-addressed:
its key hashes the verifier digest, the aux layer ids, the route's code version
(`eagle3.versions`; from a server, the served model name too) and the token ids of its samples,
and it lives in the store's `shards/<key>/` where any run can reuse it. So appending records to
a dataset extracts only the new (and the last, now longer) shards, and a killed run resumes at
the first unfinished shard. Shard files `hs_{j}.safetensors` (j: position in the shard) hold
speculators' format: `hidden_states` [seq, 4, H] bf16 (3 aux layers, then the final pre-norm
state) and `token_ids` [seq] int64. A shard is written under `<key>.partial/` and
renamed into place only once every file has been checked (values finite before writing; fields,
shape and token ids as written). The artifact itself is `shards.json`: each shard's key, first
record and file digests.

Samples are sorted by length and padded into prefill batches of at most `prefill_batch_tokens`
(padded) tokens; right padding under a causal mask leaves the real tokens' states unchanged,
so results match batch size 1 within bf16 rounding. Host copies and file writes run on worker
threads while the device computes the next batch. Cost: one verifier forward per token; storage
8*H bytes per token (SmolLM2-135M: 4.6 KB/token; Llama-3.1-8B: 32 KB/token).

Backend `vllm` asks a vLLM server for each sample's states instead (`eagle3/served_extraction.py`)
and writes, checks and publishes them the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import save
from tqdm import tqdm

from eagle3 import served_extraction
from eagle3.config import ConfigError, EndpointConfig, ExtractConfig
from eagle3.isolation import NO_GPU, GpuClaim, free_device_memory, gpu_memory_used_mib, halve_after_oom, run_attempt
from eagle3.prepare_dataset import DatasetManifest, load_dataset_table
from eagle3.store import (
    ArtifactError, ArtifactManifest, ArtifactStore, Provenance, Stopwatch, atomic_write_bytes, atomic_write_text, exclusive, exclusive_if_free,
    step_provenance,
)
from eagle3.verifier import VerifierManifest, compute_dtype, load_text_model
from eagle3.versions import code_version, route

__all__ = [
    "HiddenStateCapture",
    "HiddenStatesManifest",
    "extract_hidden_states",
    "extraction_provenance",
    "hidden_state_files",
    "resolve_aux_layer_ids",
    "resolve_device",
    "shard_key",
    "verify_shard",
]



# Test hook: raise the real torch.OutOfMemoryError for any prefill (or training, or regeneration)
# batch above this many tokens, so the back-off paths run deterministically without a GPU.
FAULT_OOM_ENV = "EAGLE3_FAULT_OOM_ABOVE_TOKENS"


class HiddenStatesManifest(ArtifactManifest):
    kind: str = "hidden_states"
    aux_layer_ids: list[int]
    hidden_size: int
    num_records: int
    num_tokens: int
    shards: list[dict] = Field(description="per shard: key, first_record, num_records")
    extracted_shards: int
    reused_shards: int
    backoffs: list[dict] = []
    gpu_memory_after_mib: dict[str, int] | None = Field(
        None, description="memory in use on each claimed GPU once the step's processes exited"
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_aux_layer_ids(ids: list[int] | None, num_layers: int, verifier: Path) -> list[int]:
    """Aux ids, defaulting to speculators' [2, n//2, n-3]; each must lie in [0, n-1].

    Raises:
        ConfigError: an id is out of range for this verifier (the final layer n is always added).
    """
    resolved = ids if ids is not None else [2, num_layers // 2, num_layers - 3]
    bad = [i for i in resolved if not 0 <= i < num_layers]
    if bad or len(set(resolved)) != 3:
        raise ConfigError(
            f"extract.aux_layer_ids = {resolved}: verifier '{verifier}' has {num_layers} layers, so ids "
            f"must be 3 distinct values in 0..{num_layers - 1} (out of range: {bad}); "
            f"{num_layers} (the final state) is always added. Set extract.aux_layer_ids explicitly."
        )
    return resolved


class HiddenStateCapture:
    """Forward hooks collecting the residual stream at the aux layers and before the final norm."""

    def __init__(self, decoder, aux_layer_ids: list[int]):
        self.states: dict[int, torch.Tensor] = {}
        self.handles = []
        n = len(decoder.layers)
        for slot, layer_id in enumerate(aux_layer_ids):
            module = decoder.embed_tokens if layer_id == 0 else decoder.layers[layer_id - 1]
            self.handles.append(module.register_forward_hook(self._output_hook(slot)))
        # The last slot is the final PRE-norm state: the input of the final norm, not HF's
        # last output_hidden_states entry (which is post-norm).
        self.handles.append(decoder.norm.register_forward_pre_hook(self._input_hook(len(aux_layer_ids))))
        assert n >= max(aux_layer_ids) + 1

    def _output_hook(self, slot):
        def hook(_module, _args, output):
            self.states[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    def _input_hook(self, slot):
        def hook(_module, args):
            self.states[slot] = args[0]

        return hook

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.states[s] for s in sorted(self.states)], dim=2)  # [batch, seq, 4, H]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batches(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Longest-first batches whose padded size (count x longest) stays within `budget` tokens."""
    order = sorted(indices, key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _hs_path(shard_dir: Path, index: int) -> Path:
    return shard_dir / f"hs_{index}.safetensors"


def _non_finite_per_slot(states: torch.Tensor) -> torch.Tensor:
    """[batch, seq, slots, H] -> [batch, slots] counts of NaN/Inf, computed where the states are."""
    return (~torch.isfinite(states)).sum(dim=(1, 3))


def _check_finite(path: Path, non_finite: torch.Tensor) -> None:
    if non_finite.any():
        raise ArtifactError(path, f"field 'hidden_states': non-finite values per layer slot {non_finite.tolist()}")


def verify_shard(shard_dir: Path, expected: list[list[int]], num_slots: int, hidden_size: int) -> None:
    """Check every file of a shard as written: fields, shape and token ids (values were checked
    finite before writing); raise ArtifactError naming the file and field on any defect."""
    for index, token_ids in enumerate(expected):
        path = _hs_path(shard_dir, index)
        if not path.exists():
            raise ArtifactError(path, "missing")
        with safe_open(path, "pt") as f:
            if set(f.keys()) != {"hidden_states", "token_ids"}:
                raise ArtifactError(path, f"fields 'hidden_states' and 'token_ids' expected, found {sorted(f.keys())}")
            shape = tuple(f.get_slice("hidden_states").get_shape())
            ids = f.get_tensor("token_ids")
        if shape != (len(token_ids), num_slots, hidden_size):
            raise ArtifactError(path, f"field 'hidden_states': shape {shape}, expected {(len(token_ids), num_slots, hidden_size)}")
        if ids.tolist() != token_ids:
            raise ArtifactError(path, "field 'token_ids' does not match the prepared dataset record")


class _OverlappedWriter:
    """Copies each batch's states to the host and writes its files on worker threads, so the
    device computes the next batch meanwhile. On CUDA the copy runs on its own stream; at most
    `max_pending` batches are in flight (each holds its states in device memory until copied)."""

    def __init__(self, device: torch.device, workers: int = 4, max_pending: int = 2):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hs-writer")
        self.pending: deque[Future] = deque()
        self.max_pending = max_pending
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.digests: dict[Path, str] = {}  # sha256 of each file, hashed from memory as written

    def submit(self, states: torch.Tensor, rows: list[tuple[Path, torch.Tensor]]) -> None:
        """`states` [batch, seq, 4, H] on the device; `rows`: (path, token ids) per batch row."""
        non_finite = _non_finite_per_slot(states)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()
            states.record_stream(self.stream)
            non_finite.record_stream(self.stream)
        self.pending.append(self.pool.submit(self._write, states, non_finite, event, rows))
        while len(self.pending) > self.max_pending:
            self.pending.popleft().result()

    def _write(self, states: torch.Tensor, non_finite: torch.Tensor, event, rows) -> None:
        if self.stream is not None:
            # Pinned destination: a copy to pageable memory cannot overlap the next batch's
            # kernels. torch's pinned allocator caches the blocks, so this is allocated once.
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(event)
                host = torch.empty(states.shape, dtype=torch.bfloat16, pin_memory=True)
                host.copy_(states, non_blocking=True)
                non_finite = non_finite.cpu()
            self.stream.synchronize()
        else:
            host = states.to(torch.bfloat16)
        for row, (path, token_ids) in enumerate(rows):
            _check_finite(path, non_finite[row])
            payload = save({"hidden_states": host[row, : len(token_ids)].contiguous(), "token_ids": token_ids})
            atomic_write_bytes(path, payload)  # on disk before the shard's done.json says so
            self.digests[path] = hashlib.sha256(payload).hexdigest()

    def drain(self) -> None:
        """Wait for every pending write; re-raise the first failure."""
        errors = []
        while self.pending:
            try:
                self.pending.popleft().result()
            except Exception as exc:  # noqa: BLE001  (collected, the first is re-raised)
                errors.append(exc)
        if errors:
            raise errors[0]

    def discard(self) -> None:
        """Let every pending write finish, and forget them and their failures: they belong to a
        shard that failed and is redone from its start."""
        while self.pending:
            self.pending.popleft().exception()  # waits; never raises

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@torch.inference_mode()
def _extract_shard(decoder, capture, writer, shard_dir, indices, input_ids, budget, device, progress) -> None:
    lengths = {i: len(input_ids[i]) for i in indices}
    for batch in _batches(indices, lengths, budget):
        width = lengths[batch[0]]
        limit = os.environ.get(FAULT_OOM_ENV)
        if limit and len(batch) * width > int(limit):
            raise torch.OutOfMemoryError(f"simulated out of memory: {len(batch) * width} padded tokens > {FAULT_OOM_ENV}={limit}")
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(input_ids[i])
            mask[row, : lengths[i]] = 1
        decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        rows = [(_hs_path(shard_dir, i - indices[0]), ids[row, : lengths[i]].clone()) for row, i in enumerate(batch)]
        writer.submit(capture.stacked(), rows)
        capture.states.clear()
        progress.update(sum(lengths[i] for i in batch))
    writer.drain()


def _extract_served_shard(source, writer, shard_dir, indices, input_ids, record_ids, progress) -> None:
    def write(i: int, states: torch.Tensor) -> None:
        writer.submit(states.unsqueeze(0), [(_hs_path(shard_dir, i - indices[0]), torch.tensor(input_ids[i]))])
        progress.update(len(input_ids[i]))

    source.extract([(i, record_ids[i], input_ids[i]) for i in indices], write)
    writer.drain()


def code_step(cfg: ExtractConfig) -> str:
    """The `eagle3.versions` entry of the route that computes the states."""
    return route("hidden_states", cfg.backend, local="transformers")


def extraction_provenance(store: ArtifactStore, cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest) -> Provenance:
    """The step's provenance, of the route that computes the states (as each shard's key is)."""
    return step_provenance(code_step(cfg), store, cfg=cfg, dataset=dataset, verifier=verifier)


def shard_key(cfg: ExtractConfig, verifier: VerifierManifest, aux: list[int], samples: list[list[int]]) -> str:
    """A shard's key: the verifier, the aux layers, the route's code version (so a version bump of
    one route leaves the other's shards cached; a server's kernels and dtype round differently from
    the step's, so its served model name stands for it) and its samples' token ids."""
    extracted_by = [code_version(code_step(cfg))] + ([cfg.endpoint.model] if cfg.backend == "vllm" else [])
    h = hashlib.sha256(json.dumps([verifier.digest, aux, *extracted_by]).encode())
    for token_ids in samples:
        h.update(json.dumps(token_ids).encode())
    return h.hexdigest()


def _shard_lock_path(shard_root: Path, key: str) -> Path:
    return shard_root.parent / "locks" / f"shard-{key[:24]}.lock"


def _shard_lock(shard_root: Path, key: str):
    """Held while a shard is extracted, so two runs that need the same shard extract it once;
    waited for (without a GPU) by a run that needs a shard another run is extracting."""
    return exclusive(_shard_lock_path(shard_root, key), f"another run extracting shard {key[:12]}")


def _shard_lock_if_free(shard_root: Path, key: str):
    """`_shard_lock` if no other run holds it: extraction skips such shards and waits for them last."""
    return exclusive_if_free(_shard_lock_path(shard_root, key))


def _extract_attempt(
    dataset: DatasetManifest,
    verifier: VerifierManifest,
    aux: list[int],
    device: str,
    shard_root: Path,
    todo: list[tuple[int, str, list[int]]],
    budget: int,
    served: EndpointConfig | None,
    on_progress,
) -> dict:
    """Extract the `todo` shards (index, key, record indices) in order with one model load,
    skipping those another run is extracting (the model loads at the first shard this run takes,
    so an attempt that finds every shard taken never loads it).

    Returns {"busy": indices skipped, "oom": None or {"shard", "error"}}: at the first out-of-memory
    error the attempt stops and the caller retries the shards left with a smaller budget, in a
    fresh process on a GPU. `served`: ask that server for the states instead (nothing runs out of
    memory here).
    `on_progress(shard index, extracted)` after each shard; `extracted` is False for a shard
    another run finished since the caller listed it.
    """
    device = torch.device(device)
    table = load_dataset_table(dataset)
    input_ids: list[list[int]] = table.column("input_ids").to_pylist()
    record_ids: list[str] = table.column("record_id").to_pylist()
    decoder = capture = source = None
    if served is not None:
        source = served_extraction.ServedStates(served, len(aux) + 1, verifier.hidden_size)
        source.check_fit([(i, record_ids[i], input_ids[i]) for _, _, shard in todo for i in shard])
    writer = _OverlappedWriter(device)
    busy, oom = [], None
    try:
        with tqdm(total=sum(len(input_ids[i]) for _, _, shard in todo for i in shard), desc="extract hidden states", unit="tok") as progress:
            for k, key, shard in todo:
                tokens = sum(len(input_ids[i]) for i in shard)
                with _shard_lock_if_free(shard_root, key) as mine:
                    if not mine:
                        busy.append(k)
                        progress.total -= tokens
                        continue
                    if (shard_root / key / "done.json").exists():  # another run finished it since it was listed
                        progress.update(tokens)
                        on_progress(k, False)
                        continue
                    partial = shard_root / f"{key}.partial"
                    if partial.exists():
                        shutil.rmtree(partial)  # left by a killed run: the shard is the unit of resume
                    partial.mkdir()
                    if source is None and decoder is None:
                        decoder = load_text_model(verifier.path, compute_dtype(device), device).get_decoder()
                        capture = HiddenStateCapture(decoder, aux)
                    try:
                        if source is not None:
                            _extract_served_shard(source, writer, partial, shard, input_ids, record_ids, progress)
                        else:
                            _extract_shard(decoder, capture, writer, partial, shard, input_ids, budget, device, progress)
                    except BaseException as exc:
                        writer.discard()  # its queued writes land before the lock lets another run at the shard
                        if not isinstance(exc, torch.OutOfMemoryError):
                            raise
                        oom = {"shard": k, "error": str(exc).splitlines()[0]}
                        break
                    verify_shard(partial, [input_ids[i] for i in shard], len(aux) + 1, verifier.hidden_size)
                    digests = {p.name: writer.digests.pop(p) for p in sorted(writer.digests) if p.parent == partial}
                    atomic_write_text(partial / "done.json", json.dumps({"sha256": digests}, indent=0))
                    os.replace(partial, shard_root / key)
                on_progress(k, True)
    finally:
        writer.close()
        if capture is not None:
            capture.states.clear()
            capture.close()
        del decoder, capture, writer, source
        free_device_memory(device)
    return {"busy": busy, "oom": oom}


def extract_hidden_states(
    cfg: ExtractConfig,
    dataset: DatasetManifest,
    verifier: VerifierManifest,
    store: ArtifactStore,
    provenance: Provenance,
    on_progress=None,
    claim: GpuClaim = NO_GPU,
) -> HiddenStatesManifest:
    """Extract every shard of `dataset` not already in the store, then publish the shard list.

    `claim`: the CUDA devices to extract on, claimed only if a shard is left to extract; each
    attempt then runs in a child process seeing only them (none claimed: in this process on
    `cfg.device`); backend `vllm` claims nothing (the server has its GPUs) and runs here. Shards,
    not the step, are locked: a run skips the shards another run is extracting, then releases its
    claim and waits for them, claiming again for any whose run died.
    `on_progress(tokens_done, tokens_total)` is called after each finished shard.

    Raises:
        ConfigError: aux layer ids out of range for the verifier; (backend `vllm`) a record longer
            than the server's context, named before any request (or when the server refuses it).
        ArtifactError: a written file fails verification.
        RuntimeError: out of memory even at `cfg.min_prefill_batch_tokens`.
        EndpointError: (backend `vllm`) the server is unreachable, not set up to extract, or
            wrote states of other layers or where this host cannot read them.
    Whatever stops the step, finished shards are kept for the re-run.
    """
    clock = Stopwatch()
    served = cfg.endpoint if cfg.backend == "vllm" else None
    if served is not None:
        claim = NO_GPU
    aux = resolve_aux_layer_ids(cfg.aux_layer_ids, verifier.num_hidden_layers, verifier.path)
    input_ids: list[list[int]] = load_dataset_table(dataset).column("input_ids").to_pylist()
    size = cfg.records_per_shard
    shards = [list(range(s, min(s + size, len(input_ids)))) for s in range(0, len(input_ids), size)]
    keys = [shard_key(cfg, verifier, aux, [input_ids[i] for i in shard]) for shard in shards]
    shard_root = store.root / "shards"
    shard_root.mkdir(exist_ok=True)

    def finished(k: int) -> bool:
        return (shard_root / keys[k] / "done.json").exists()

    todo = [k for k in range(len(shards)) if not finished(k)]
    total = sum(len(input_ids[i]) for k in todo for i in shards[k])
    done = extracted = 0
    reported: set[int] = set()

    def shard_done(k: int, by_this_run: bool) -> None:
        nonlocal done, extracted
        reported.add(k)
        done += sum(len(input_ids[i]) for i in shards[k])
        extracted += by_this_run
        if on_progress is not None:
            on_progress(done, total)

    def unfinished(ks: list[int]) -> list[int]:
        """`ks` less the finished shards; those another run finished count as reused."""
        left = []
        for k in ks:
            if not finished(k):
                left.append(k)
            elif k not in reported:
                shard_done(k, False)
        return left

    backoffs: list[dict] = []
    gpu_memory_after = None
    budget = cfg.prefill_batch_tokens

    def free(k: int) -> bool:
        with _shard_lock_if_free(shard_root, keys[k]) as mine:
            return mine

    while todo := unfinished(todo):
        if any(free(k) for k in todo):  # else other runs are extracting every shard left: no claim
            with clock.excluding_wait(claim()) as gpus:
                device = "cuda" if gpus else "cpu" if served else str(resolve_device(cfg.device))
                busy: list[int] = []
                while (todo := unfinished(todo)) and not set(todo) <= set(busy):
                    attempt = {"dataset": dataset, "verifier": verifier, "aux": aux, "device": device, "shard_root": shard_root,
                               "todo": [(k, keys[k], shards[k]) for k in todo], "budget": budget, "served": served}
                    outcome = run_attempt(_extract_attempt, attempt, gpus, shard_done)
                    busy = outcome["busy"]
                    if (oom := outcome["oom"]) is not None:
                        budget = halve_after_oom(
                            "extract.prefill_batch_tokens", budget, cfg.min_prefill_batch_tokens, backoffs, oom["error"],
                            f"in shard {oom['shard']}", "Finished shards are kept. Lower dataset.max_seq_len or "
                            "extract.min_prefill_batch_tokens, or use a device with more memory.", shard=oom["shard"],
                        )
                    elif not set(unfinished(todo)) <= set(busy):
                        raise RuntimeError("an extraction attempt ended without an error but left free shards unfinished")
                gpu_memory_after = gpu_memory_used_mib(gpus) if gpus else None
        for k in unfinished(todo):  # shards other runs are extracting: waited for without a GPU, not counted as this step's time
            with clock.excluding_wait(_shard_lock(shard_root, keys[k])):
                pass
            if not finished(k):
                break  # its run died: claim again for it

    listing = [
        {"key": key, "first_record": shard[0], "num_records": len(shard),
         "sha256": json.loads((shard_root / key / "done.json").read_text())["sha256"]}
        for key, shard in zip(keys, shards)
    ]
    with store.work_dir("hidden_states", provenance.key) as work:
        atomic_write_text(work / "shards.json", json.dumps(listing, indent=0))
        return store.publish(
            work,
            HiddenStatesManifest(
                **provenance.model_dump(),
                path=work,
                aux_layer_ids=aux,
                hidden_size=verifier.hidden_size,
                num_records=len(input_ids),
                num_tokens=sum(map(len, input_ids)),
                shards=[{k: v for k, v in entry.items() if k != "sha256"} for entry in listing],
                extracted_shards=extracted,
                reused_shards=len(keys) - extracted,
                backoffs=backoffs,
                gpu_memory_after_mib=gpu_memory_after,
                seconds=clock(),
            ),
        )


def hidden_state_files(manifest: HiddenStatesManifest) -> dict[int, Path]:
    """Sample index -> its hidden-state file, across the shared shard directories."""
    shard_root = Path(manifest.path).parent.parent / "shards"  # <store>/artifacts/<digest> -> <store>/shards
    files = {}
    for shard in manifest.shards:
        for j in range(shard["num_records"]):
            files[shard["first_record"] + j] = _hs_path(shard_root / shard["key"], j)
    return files
