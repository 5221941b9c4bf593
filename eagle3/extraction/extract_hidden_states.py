"""Extract hidden states: run the verifier over every prepared sample and keep what the draft reads.

Samples are grouped `records_per_shard` to a shard, in dataset order. A shard is content-addressed:
its key hashes the verifier digest, the aux layer ids, the route's code version
(`eagle3.store.versions`; from a server, the served model name too) and the token ids of its samples,
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
8*H bytes per token (SmolLM2-135M: 4.6 KB/token; Llama-3.1-8B: 32 KB/token), half with
`extract.storage=fp8` (`eagle3.extraction.storage`); a run whose shards would not fit the store's
free space fails before it writes any, with the numbers.

Backend `vllm` asks vLLM servers for each sample's states instead, spread over `extract.endpoint`
and `extract.more_base_urls` (`eagle3.extraction.served`), backend `vllm-engine` runs vLLM's engine
in a child process that captures them inside its workers and writes the shard's files
(`eagle3.extraction.vllm_engine`); both are checked and published the same way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field
from tqdm import tqdm

from eagle3.config import ConfigError, EndpointConfig, EngineConfig, ExtractConfig, VerifierConfig
from eagle3.data.prepare_dataset import DatasetManifest, load_dataset_table
from eagle3.extraction.served import ServedStates
from eagle3.extraction.shards import HiddenStatesManifest, code_step, hs_path, shard_key, shard_lock, shard_lock_if_free, verify_shard
from eagle3.extraction.storage import room_problem
from eagle3.extraction.vllm_engine import EngineStates, engine_identity
from eagle3.extraction.writer import OverlappedWriter
from eagle3.runtime.attempts import (
    NO_GPU,
    BatchBackoff,
    GpuClaim,
    OutOfMemory,
    Progress,
    run_attempt,
    submit_in_context,
    worker_backoff_log,
)
from eagle3.runtime.devices import compute_dtype, free_device_memory, gpu_memory_used_mib, inference_mode, resolve_device
from eagle3.runtime.faults import pause_after_shards, simulate_oom_above
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import SERVED_STATES, ArtifactError, ArtifactStore, log_reuse, step_provenance
from eagle3.store.files import atomic_write_text, fsync, remove_tree
from eagle3.store.manifests import Provenance
from eagle3.store.verify import SHARD_DONE, recorded_digests
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.placement import Worker, load_placed, place_verifier
from eagle3.verifier.resolve_verifier import VerifierManifest

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch

__all__ = ["extract_hidden_states", "extraction_provenance", "prefill_batches", "resolve_aux_layer_ids"]

logger = logging.getLogger(__name__)


def resolve_aux_layer_ids(ids: list[int] | None, num_layers: int, verifier: Path) -> list[int]:
    """Aux ids, defaulting to speculators' [2, n//2, n-3]; each must lie in [0, n-1].

    Raises:
        ConfigError: an id is out of range for this verifier (the final layer n is always added),
            or the defaults do not fit it (from 4 to 6 layers they repeat one).
    """
    resolved = ids if ids is not None else [2, num_layers // 2, num_layers - 3]
    bad = [i for i in resolved if not 0 <= i < num_layers]
    if not bad and len(set(resolved)) == 3:
        return resolved
    example = f", e.g. {list(range(num_layers))[-3:]}" if num_layers >= 3 else " (none exist: use a verifier of 3 or more layers)"
    if ids is None:  # the user set nothing: say that the defaults do not fit, not what is wrong with them
        problem = "repeat a layer" if len(set(resolved)) != 3 else f"fall outside 0..{num_layers - 1}"
        raise ConfigError(
            f"verifier '{verifier}' has {num_layers} layers: the default extract.aux_layer_ids [2, n//2, n-3] = "
            f"{resolved} {problem}. Set extract.aux_layer_ids to 3 distinct ascending ids in 0..{num_layers - 1}{example}."
        )
    raise ConfigError(
        f"extract.aux_layer_ids = {resolved}: verifier '{verifier}' has {num_layers} layers, so ids must lie in "
        f"0..{num_layers - 1} (out of range: {bad}); {num_layers} (the final state) is always added. Set "
        f"extract.aux_layer_ids to 3 distinct ascending ids in that range{example}."
    )


def prefill_batches(indices: list[int], lengths: Mapping[int, int], budget: int) -> list[list[int]]:
    """Longest-first batches whose padded size (count x longest) stays within `budget` tokens."""
    order = sorted(indices, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@inference_mode
def _extract_shard(decoder, capture, writer, shard_dir, indices, input_ids, budget, device, progress) -> None:
    import torch

    lengths = {i: len(input_ids[i]) for i in indices}
    for batch in prefill_batches(indices, lengths, budget):
        width = lengths[batch[0]]
        simulate_oom_above(len(batch) * width, f"{len(batch) * width} padded tokens")
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(input_ids[i])
            mask[row, : lengths[i]] = 1
        decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        rows = [(hs_path(shard_dir, i - indices[0]), ids[row, : lengths[i]].clone()) for row, i in enumerate(batch)]
        writer.submit(capture.stacked().to(device), rows)  # the writer copies from the inputs' device; split layers end elsewhere
        capture.states.clear()
        progress.update(sum(lengths[i] for i in batch))
    writer.drain()


def _extract_served_shard(source, writer, shard_dir, indices, input_ids, record_ids, progress) -> None:
    import torch

    def write(i: int, states: torch.Tensor) -> None:  # in the order answers arrive: each file is named by its sample
        writer.submit(states.unsqueeze(0), [(hs_path(shard_dir, i - indices[0]), torch.tensor(input_ids[i]))])
        progress.update(len(input_ids[i]))

    source.extract([(i, record_ids[i], input_ids[i]) for i in indices], write)
    writer.drain()


def extraction_provenance(store: ArtifactStore, cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest) -> Provenance:
    """The step's provenance, of the route that computes the states (as each shard's key is)."""
    engine = {"engine": engine_identity(cfg.engine)} if cfg.backend == "vllm-engine" else {}
    return step_provenance(code_step(cfg), store, cfg=cfg, dataset=dataset, verifier=verifier, **engine)


class ShardWork(BaseModel):
    index: int  # position in the dataset's shard list
    key: str
    records: list[int]  # dataset record indices, in order


class ExtractAttempt(BaseModel):
    """One attempt: the shards to extract with one model load (or from the servers), what crosses
    into its child process."""

    dataset: DatasetManifest
    verifier: VerifierManifest
    aux: list[int]
    device: str
    shard_root: Path
    todo: list[ShardWork]
    budget: int = Field(description="padded tokens per prefill batch")
    served: list[EndpointConfig] = Field(default_factory=list, description="ask these servers for the states instead, spread over them")
    served_states: Path | None = Field(None, description="the only directory the servers' states files are read from")
    storage: str = Field("bf16", description="precision the files store the states in (extract.storage)")
    engine: EngineConfig | None = Field(None, description="run vLLM's engine for the states instead")
    max_memory: dict[int | str, int] | None = Field(
        None, description="spread the verifier's layers over the visible GPUs with these byte budgets (None: all on `device`)"
    )


class AttemptOutcome(BaseModel):
    busy: list[int] = Field(description="shards skipped because another run was extracting them")
    oom: OutOfMemory | None = None


class _Source:
    """Where an attempt's states come from: the verifier, loaded at the first shard this attempt
    takes (an attempt that finds every shard taken never loads it), vLLM servers, or vLLM's
    engine, started (like the verifier) at the first shard."""

    def __init__(self, spec: ExtractAttempt, input_ids: list[list[int]], record_ids: list[str]):
        import torch

        self.spec, self.input_ids, self.record_ids = spec, input_ids, record_ids
        self.device = torch.device(spec.device)
        self.decoder: torch.nn.Module | None = None
        self.capture: HiddenStateCapture | None = None
        self.server: ServedStates | None = None
        self.engine: EngineStates | None = None
        if spec.served:
            if spec.served_states is None:
                raise ValueError("an attempt that asks servers for the states needs served_states, where their files are read")
            self.server = ServedStates(spec.served, len(spec.aux) + 1, spec.verifier.hidden_size, spec.served_states)
            self.server.check_fit([(i, record_ids[i], input_ids[i]) for shard in spec.todo for i in shard.records])

    def extract(self, writer: OverlappedWriter, shard_dir: Path, shard: ShardWork, progress) -> None:
        if self.server is not None:
            _extract_served_shard(self.server, writer, shard_dir, shard.records, self.input_ids, self.record_ids, progress)
            return
        if self.spec.engine is not None:
            if self.engine is None:
                longest = max(len(self.input_ids[i]) for s in self.spec.todo for i in s.records)
                self.engine = EngineStates(
                    self.spec.engine, self.spec.verifier, self.spec.aux, longest, self.spec.shard_root.parent / "logs", self.spec.storage
                )
            files = [(hs_path(shard_dir, i - shard.records[0]), self.input_ids[i]) for i in shard.records]
            writer.digests.update(self.engine.extract_shard(shard_dir, files, progress.update))
            return
        if self.decoder is None:
            self.decoder = load_placed(self.spec.verifier.path, compute_dtype(self.device), self.device, self.spec.max_memory).get_decoder()
            self.capture = HiddenStateCapture(self.decoder, self.spec.aux)
        _extract_shard(
            self.decoder, self.capture, writer, shard_dir, shard.records, self.input_ids, self.spec.budget, self.device, progress
        )

    def stop_engine(self) -> None:
        """Kill the vLLM engine (if any) at once: mid-request it is still writing into the shard."""
        if self.engine is not None:
            self.engine.close(stop_s=0)
            self.engine = None

    def close(self) -> None:
        if self.capture is not None:
            self.capture.states.clear()
            self.capture.close()
        if self.engine is not None:
            self.engine.close()
        self.decoder = self.capture = self.server = self.engine = None
        free_device_memory(self.device)


def _finish_shard(spec: ExtractAttempt, writer: OverlappedWriter, partial: Path, shard: ShardWork, input_ids: list[list[int]]) -> None:
    """Check every file of an extracted shard, record their digests, and move it into place."""
    verify_shard(partial, [input_ids[i] for i in shard.records], len(spec.aux) + 1, spec.verifier.hidden_size, spec.storage)
    writer.sync(partial)
    digests = {p.name: writer.digests.pop(p) for p in sorted(writer.digests) if p.parent == partial}
    atomic_write_text(partial / SHARD_DONE, json.dumps({"sha256": digests}, indent=0))
    final = spec.shard_root / shard.key
    if final.exists():  # unfinished (no readable done.json): what a killed gc or a damaged record left; the lock is ours
        remove_tree(final, "unfinished")
    os.replace(partial, final)
    fsync(spec.shard_root)


def _extract_attempt(spec: ExtractAttempt, on_progress: Progress) -> AttemptOutcome:
    """Extract `spec.todo` in order, skipping the shards another run is extracting. At the first
    out-of-memory error the attempt stops; the caller retries the shards left with a smaller
    budget, in a fresh process on a GPU. `on_progress(shard index, extracted)` after each shard;
    `extracted` is False for a shard another run finished since the caller listed it."""
    import torch

    table = load_dataset_table(spec.dataset)
    input_ids: list[list[int]] = table.column("input_ids").to_pylist()
    source = _Source(spec, input_ids, table.column("record_id").to_pylist())
    writer = OverlappedWriter(source.device, spec.storage)
    busy: list[int] = []
    finished = 0
    try:
        with tqdm(total=sum(len(input_ids[i]) for s in spec.todo for i in s.records), desc="extract hidden states", unit="tok") as progress:
            for shard in spec.todo:
                tokens = sum(len(input_ids[i]) for i in shard.records)
                with shard_lock_if_free(spec.shard_root, shard.key) as mine:
                    if not mine:
                        busy.append(shard.index)
                        progress.total -= tokens
                        continue
                    if _finished(spec.shard_root / shard.key):  # another run finished it since it was listed
                        progress.update(tokens)
                        on_progress(shard.index, False)
                        continue
                    partial = spec.shard_root / f"{shard.key}.partial"
                    if partial.exists():
                        shutil.rmtree(partial)  # left by a killed run: the shard is the unit of resume
                    partial.mkdir()
                    try:
                        source.extract(writer, partial, shard, progress)
                    except BaseException as exc:
                        writer.discard()  # its queued writes land before the lock lets another run at the shard
                        source.stop_engine()  # and so do the engine's, which runs in its own processes
                        if not isinstance(exc, torch.OutOfMemoryError):
                            raise
                        oom = OutOfMemory(error=str(exc).splitlines()[0], where=f"in shard {shard.index}", at={"shard": shard.index})
                        return AttemptOutcome(busy=busy, oom=oom)
                    _finish_shard(spec, writer, partial, shard, input_ids)
                on_progress(shard.index, True)
                finished += 1
                pause_after_shards(finished)
    finally:
        writer.close()
        source.close()
    return AttemptOutcome(busy=busy)


def _finished(shard_dir: Path) -> bool:
    """Whether the shard's `done.json` reads: one that does not (a killed gc, damage) is extracted again."""
    return isinstance(recorded_digests(shard_dir), dict)


def _digests(shard_dir: Path) -> dict[str, str]:
    """The file digests of a finished shard.

    Raises:
        ArtifactError: its `done.json` went or was damaged since the shard was found finished.
    """
    recorded = recorded_digests(shard_dir)
    if isinstance(recorded, str):
        raise ArtifactError(shard_dir, f"{recorded}; run the step again to extract the shard again")
    return recorded


class _ShardPlan:
    """The dataset's shards, their keys, and which of them are finished; counts what this run
    extracted and what it reused (finished by an earlier or concurrent run)."""

    def __init__(self, cfg: ExtractConfig, dataset: DatasetManifest, verifier: VerifierManifest, aux: list[int], root: Path, on_progress):
        self.input_ids: list[list[int]] = load_dataset_table(dataset).column("input_ids").to_pylist()
        size = cfg.records_per_shard
        self.shards = [list(range(s, min(s + size, len(self.input_ids)))) for s in range(0, len(self.input_ids), size)]
        self.keys = [shard_key(cfg, verifier, aux, [self.input_ids[i] for i in shard]) for shard in self.shards]
        self.root = root
        self.on_progress = on_progress
        self.todo = [k for k in range(len(self.shards)) if not self.finished(k)]
        self.total_tokens = sum(self.tokens(k) for k in self.todo)
        self.done_tokens = 0
        self.reported: dict[int, bool] = {}  # finished shard -> whether this run extracted it
        self.lock = threading.Lock()  # data-parallel workers report from a thread each

    def tokens(self, k: int) -> int:
        return sum(len(self.input_ids[i]) for i in self.shards[k])

    def finished(self, k: int) -> bool:
        return _finished(self.root / self.keys[k])

    def free(self, k: int) -> bool:
        with shard_lock_if_free(self.root, self.keys[k]) as mine:
            return mine

    def work(self, ks: list[int]) -> list[ShardWork]:
        return [ShardWork(index=k, key=self.keys[k], records=self.shards[k]) for k in ks]

    @property
    def extracted(self) -> int:
        return sum(self.reported.values())

    def shard_done(self, k: int, by_this_run: bool) -> None:
        # A worker may see a shard finished (as reused) before the worker that extracted it reports it.
        with self.lock:
            first = k not in self.reported
            self.reported[k] = self.reported.get(k, False) or by_this_run
            self.done_tokens += self.tokens(k) if first else 0
            done = self.done_tokens
        if first and self.on_progress is not None:
            self.on_progress(done, self.total_tokens)

    def unfinished(self, ks: list[int]) -> list[int]:
        """`ks` less the finished shards; those another run finished count as reused."""
        left = []
        for k in ks:
            if not self.finished(k):
                left.append(k)
            elif k not in self.reported:
                self.shard_done(k, False)
        return left


def _extract_free_shards(plan: _ShardPlan, todo: list[int], base: ExtractAttempt, gpus: list[str] | None, backoff: BatchBackoff) -> None:
    """Attempts until every shard of `todo` is finished or being extracted by another run, the
    budget halved after each out-of-memory stop."""
    busy: list[int] = []
    while (todo := plan.unfinished(todo)) and not set(todo) <= set(busy):
        spec = base.model_copy(update={"todo": plan.work(todo), "budget": backoff.value})
        outcome = run_attempt(_extract_attempt, spec, gpus, plan.shard_done)
        busy = outcome.busy
        if outcome.oom is not None:
            backoff.after(outcome.oom)
        elif not set(plan.unfinished(todo)) <= set(busy):
            raise RuntimeError("an extraction attempt ended without an error but left free shards unfinished")


def _extract_on_workers(
    plan: _ShardPlan, todo: list[int], base: ExtractAttempt, workers: list[Worker], backoffs: list[BatchBackoff]
) -> None:
    """`_extract_free_shards` on every worker at once, one thread driving each worker's child
    processes (`backoffs[w]`: worker w's). Each worker starts at its own share of `todo`, then goes on
    to the others' shards, skipping those another worker holds (their locks), so the workers split
    the shards without a scheduler, and shard for shard extract what one worker would. A worker that
    fails lets the others finish their attempts (what they finish is kept), then its error is raised."""
    with ThreadPoolExecutor(len(workers), thread_name_prefix="extract-worker") as pool:
        futures = [
            submit_in_context(
                pool,
                _extract_free_shards,
                plan,
                todo[start:] + todo[:start],
                base.model_copy(update={"device": worker.device, "max_memory": worker.max_memory}),
                worker.visible,
                backoff,
            )
            for worker, backoff, start in zip(workers, backoffs, (w * len(todo) // len(workers) for w in range(len(workers))))
        ]
    for future in futures:
        future.result()


def _backoff(cfg: ExtractConfig, work: Path, worker: int) -> BatchBackoff:
    """Worker `worker`'s back-off, listed in `work`."""
    return BatchBackoff(
        "extract.prefill_batch_tokens",
        cfg.prefill_batch_tokens,
        "extract.min_prefill_batch_tokens",
        cfg.min_prefill_batch_tokens,
        kept="Finished shards are kept. Lower dataset.max_seq_len or extract.min_prefill_batch_tokens, or use a device with more memory.",
        log=worker_backoff_log(work, worker),
    )


def _publish(
    store: ArtifactStore, provenance: Provenance, plan: _ShardPlan, aux: list[int], verifier: VerifierManifest, **numbers
) -> HiddenStatesManifest:
    listing = [
        {
            "key": key,
            "first_record": shard[0],
            "num_records": len(shard),
            "sha256": _digests(plan.root / key),
        }
        for key, shard in zip(plan.keys, plan.shards)
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
                num_records=len(plan.input_ids),
                num_tokens=sum(map(len, plan.input_ids)),
                shards=[{k: v for k, v in entry.items() if k != "sha256"} for entry in listing],
                extracted_shards=plan.extracted,
                reused_shards=len(plan.keys) - plan.extracted,
                **numbers,
            ),
        )


def _published_whole(store: ArtifactStore, provenance: Provenance, shard_root: Path) -> HiddenStatesManifest | None:
    """The shard list the store published for `provenance`, if every shard it lists is still there
    with the files it listed (as `ArtifactStore.step_work_dir` hands the other steps theirs); else
    None: the step runs, and extracts what went."""
    published = store.published(HiddenStatesManifest, provenance, check_files=True)
    if published is None:
        return None
    for entry in json.loads((published.path / "shards.json").read_text()):
        if recorded_digests(shard_root / entry["key"]) != entry["sha256"]:
            logger.warning(
                "hidden_states: shard %s of the published list %s is gone, damaged or extracted again; extracting",
                entry["key"][:12],
                published.digest[:12],
            )
            return None
    log_reuse(published)
    return published


def extract_hidden_states(
    cfg: ExtractConfig,
    dataset: DatasetManifest,
    verifier: VerifierManifest,
    store: ArtifactStore,
    provenance: Provenance,
    on_progress=None,
    claim: GpuClaim = NO_GPU,
    placement: VerifierConfig | None = None,
) -> HiddenStatesManifest:
    """Extract every shard of `dataset` not already in the store, then publish the shard list (the
    list the store has published for `provenance`, if it holds one whose shards are all there:
    nothing is extracted).

    `claim`: the CUDA devices to extract on, claimed only if a shard is left to extract; each
    attempt then runs in a child process seeing only them (none claimed: in this process on
    `cfg.device`); backend `vllm` claims nothing (the server has its GPUs) and runs here; backend
    `vllm-engine` starts its engine on the claimed devices. Of several claimed GPUs (`placement`:
    `verifier.num_gpus` and its memory settings) each takes whole shards with a replica of the
    verifier where it fits one GPU, else the verifier's layers are spread over all of them
    (`eagle3.verifier.placement`); devices named "cpu" are CPU worker processes. Shards,
    not the step, are locked: a run skips the shards another run is extracting, then releases its
    claim and waits for them, claiming again for any whose run died.
    `on_progress(tokens_done, tokens_total)` is called after each finished shard.

    Raises:
        ConfigError: aux layer ids out of range for the verifier; the verifier does not fit the
            claimed GPUs; (backend `vllm`) a record longer than a server's context, named before
            any request (or when the server refuses it);
            (backend `vllm-engine`) no vLLM environment, or fewer GPUs claimed than the engine needs.
        ArtifactError: a written file fails verification.
        RuntimeError: out of memory even at `cfg.min_prefill_batch_tokens`.
        EndpointError: (backend `vllm`) every server is unreachable, not set up to extract, or
            wrote states of other layers or where this host cannot read them (each one that does
            is dropped with a warning while another is left).
    Whatever stops the step, finished shards are kept for the re-run.
    """
    import torch

    clock = Stopwatch()
    served = cfg.endpoints() if cfg.backend == "vllm" else []
    served_states = Path(cfg.served_states_dir or store.root / SERVED_STATES).expanduser()
    if served:
        claim = NO_GPU
    aux = resolve_aux_layer_ids(cfg.aux_layer_ids, verifier.num_hidden_layers, verifier.path)
    shard_root = store.root / "shards"
    shard_root.mkdir(exist_ok=True)
    backoff_logs = store.work_path("hidden_states-backoffs", provenance.key)  # not held: concurrent runs share shards
    if (published := _published_whole(store, provenance, shard_root)) is not None:
        shutil.rmtree(backoff_logs, ignore_errors=True)  # a run killed after publishing left them
        return published
    plan = _ShardPlan(cfg, dataset, verifier, aux, shard_root, on_progress)
    if problem := room_problem(plan.total_tokens, verifier.hidden_size, cfg.storage, shutil.disk_usage(shard_root).free):
        raise ArtifactError(shard_root, f"not extracting: {problem}")
    backoffs = [_backoff(cfg, backoff_logs, 0)]  # one per worker, kept across claims
    gpu_memory_after = None
    todo = plan.todo
    while todo := plan.unfinished(todo):
        if any(plan.free(k) for k in todo):  # else other runs are extracting every shard left: no claim
            with clock.excluding_wait(claim()) as gpus:
                in_step = cfg.backend == "transformers"  # else the states come from another process; this one only checks files
                device = "cpu" if not in_step else "cuda" if gpus else str(resolve_device(cfg.device))
                engine = cfg.engine if cfg.backend == "vllm-engine" else None
                base = ExtractAttempt(
                    dataset=dataset,
                    verifier=verifier,
                    aux=aux,
                    device=device,
                    shard_root=shard_root,
                    todo=[],
                    budget=backoffs[0].value,
                    served=served,
                    served_states=served_states,
                    engine=engine,
                    storage=cfg.storage,
                )
                if in_step and gpus:
                    workers = place_verifier(verifier.path, gpus, placement, torch.bfloat16)
                    backoffs += [_backoff(cfg, backoff_logs, w) for w in range(len(backoffs), len(workers))]
                    _extract_on_workers(plan, todo, base, workers, backoffs)
                else:
                    _extract_free_shards(plan, todo, base, gpus, backoffs[0])
                gpu_memory_after = gpu_memory_used_mib(gpus) if gpus else None
        for k in plan.unfinished(todo):  # shards other runs are extracting: waited for without a GPU, not counted as this step's time
            with clock.excluding_wait(shard_lock(shard_root, plan.keys[k])):
                pass
            if not plan.finished(k):
                break  # its run died: claim again for it
    manifest = _publish(
        store,
        provenance,
        plan,
        aux,
        verifier,
        backoffs=[taken for backoff in backoffs for taken in backoff.taken],
        gpu_memory_after_mib=gpu_memory_after,
        seconds=clock(),
        storage=cfg.storage,
    )
    shutil.rmtree(backoff_logs, ignore_errors=True)
    return manifest
