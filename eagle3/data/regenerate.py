"""Regenerate: the verifier writes the assistant turns the draft will learn from.

Input records: `prompt` (one user turn), MT-bench `turns` (several user turns), or conversations
(`messages` / ShareGPT `conversations`) whose assistant turns are replaced. Turns are generated
in order, so each later user turn sees the regenerated earlier answers. Two backends:
`transformers`, batched `generate` (left padding; a static KV cache and grouped decode attention,
`eagle3.verifier.grouped_decode`: 2,000 prompts in 8.4 s on an H200, against 36.0 s on a dynamic
cache with sdpa's repeated KV heads, `bench/regenerate_attention.py`; conversations batched with others of
as many user turns, by first-turn length: `batch_order`) with the verifier loaded by the step, and
`openai`, chat requests to an OpenAI-compatible server such as `vllm serve` (records in parallel,
`endpoint.concurrency` at a time per server, spread over `more_base_urls` too:
`eagle3.serving.replicas`), which is how the verifier is used at scale. Greedy or sampled with a
fixed seed; thinking (`<think>...</think>`, or a server's separate reasoning field) can be stripped.

The transformers backend runs in attempts: one model load, then the remaining records batch by
batch. On the claimed GPUs each attempt is a child process (`eagle3.runtime.attempts.run_attempt`), so
its memory is gone when it exits; on CPU it runs in this process. Out of memory, an attempt stops
and the step halves `batch_size` (down to `min_batch_size`, then fails) and retries the records
not yet finished; each back-off is logged, listed in the manifest (`backoffs`) and kept in the work
dir, so a re-run resumes at the batch size it reached. Batch size is not part of the cache key:
greedy answers do not depend on it in exact arithmetic (left padding is masked), and on CPU in
float32 a backed-off run publishes the same artifact. On a GPU in bfloat16 two runs need not agree
to the token: two H100 regenerations of the same 27,463 records, batched alike, generated 4,810,730
and 4,812,402 tokens.

Output `conversations.parquet`: `id`, `messages` (list of {role, content}), `finish_reasons`
(`stop` | `length` per generated turn). Records that fail (a prompt longer than the context, a turn
the chat template refuses, an empty answer) are listed in the manifest with their reason, never
silently dropped. Finished records are appended to `done.jsonl` in the work dir as they complete
(by the attempt itself, in its child process), so a re-run after a crash, an unreachable server or
an out-of-memory failure regenerates only what is missing; a last line cut short by a kill is
dropped and its record redone. A prompt an earlier regeneration of the same settings answered takes
that answer (`eagle3.data.earlier_answers`): appending prompts to a file generates only for the new ones.
Cost: one decode per generated token.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jinja2 import TemplateError
from pydantic import BaseModel, Field
from tqdm import tqdm

from eagle3.config import RegenerateConfig, VerifierConfig
from eagle3.data.earlier_answers import CONVERSATIONS, earlier_answers, regenerate_provenance
from eagle3.data.prepare_dataset import Record, read_user_turns
from eagle3.runtime.attempts import (
    NO_GPU,
    Backoff,
    BatchBackoff,
    GpuClaim,
    OutOfMemory,
    Progress,
    read_backoffs,
    run_attempt,
    submit_in_context,
    worker_backoff_log,
)
from eagle3.runtime.devices import compute_dtype, free_device_memory, gpu_memory_used_mib, inference_mode, resolve_device
from eagle3.runtime.faults import simulate_oom_above
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.serving.endpoint import EndpointError, RequestRejected, chat
from eagle3.serving.replicas import Server, open_servers, spread
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.done_log import DONE_LOG, append_done, read_done
from eagle3.store.manifests import ArtifactManifest, Provenance
from eagle3.verifier.grouped_decode import use_grouped_decode
from eagle3.verifier.loading import chat_prompt_ids, eos_token_ids
from eagle3.verifier.placement import Worker, load_placed, place_verifier
from eagle3.verifier.resolve_verifier import VerifierManifest, verifier_tokenizer

__all__ = ["RegeneratedManifest", "regenerate", "regenerate_provenance", "regenerated_conversations"]

logger = logging.getLogger(__name__)


class RegeneratedManifest(ArtifactManifest):
    kind: str = "regenerated"
    num_records: int
    num_generated_tokens: int = Field(description="tokens generated for this artifact (reused answers not counted)")
    reused_records: int = Field(0, description="records answered by an earlier regeneration (`eagle3.data.earlier_answers`)")
    resumed_records: int = Field(
        0, description="records a killed or failed run of this step had finished: generated, but not in this run's `seconds`"
    )
    reused_from: list[str] = Field(default_factory=list, description="digests of the regenerations those answers come from")
    failed: dict[str, str]
    backoffs: list[Backoff] = Field(default_factory=list)
    gpu_memory_after_mib: dict[str, int] | None = Field(
        None, description="memory in use on each claimed GPU once the step's processes exited"
    )


def regenerated_conversations(manifest: RegeneratedManifest) -> Path:
    """The conversations file of a regeneration artifact: prepare_dataset's input."""
    return Path(manifest.path) / CONVERSATIONS


def batch_cache(model, length: int) -> dict:
    """`generate`'s cache argument for one batch: a static KV cache of `length` positions, written in
    place (a dynamic cache copies every layer's whole cache at each step). Made here rather than by
    `generate(cache_implementation="static")`, which sizes each call's cache to the longest any call
    on the model has asked for: a short batch after a long one would attend over the long one's
    length. A cache the checkpoint's generation config names gives way to it. Nothing for the models
    that keep state of their own (Mamba, RWKV, MiniMax, ...), as `generate` decides."""
    from transformers import StaticCache

    if not model._supports_default_dynamic_cache() or "mamba" in type(model).__name__.lower():
        return {}
    cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
    return {"past_key_values": cache, "cache_implementation": None}


def left_padded(prompts: list[list[int]], pad: int):
    """`prompts` as one batch for `generate`: (input ids, attention mask), each [prompts, longest],
    padded on the left so every row's answer starts at the same column."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def until_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], str]:
    """A generated row up to its first end-of-sequence token, and why it ended: `stop` or `length`."""
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return (tokens[:stop], "stop") if stop is not None else (tokens, "length")


@inference_mode
def _generate(model, tokenizer, prompts: list[list[int]], cfg: RegenerateConfig, device) -> list[tuple[list[int], str]]:
    """Greedy/sampled continuations of each chat-templated prompt: (new token ids, finish reason)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    simulate_oom_above(ids.numel(), f"{len(prompts)} x {width} padded prompt tokens")  # as extraction's prefill
    torch.manual_seed(cfg.seed)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.temperature > 0 else {"do_sample": False}
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=pad,
        **batch_cache(model, width + cfg.max_new_tokens),
        disable_compile=True,  # generate would compile the step for every batch's shape
        **sampling,
    )[:, width:].tolist()
    eos = eos_token_ids(tokenizer, model)
    return [until_eos(tokens, eos) for tokens in out]


def _answer_text(content: str, reasoning: str | None, strip_thinking: bool) -> str:
    """The answer to train on. Stripped, everything up to the last `</think>` is thinking (a template
    whose generation prompt opens the block leaves only its close in a server's content), and an
    answer whose thinking never closed (cut off by `max_new_tokens`) has none: ''."""
    if strip_thinking:
        if "</think>" in content:
            return content.rsplit("</think>", 1)[1].strip()
        return "" if "<think>" in content else content.strip()
    return (f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content).strip()


def _opens_thinking(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a generation prompt ends in an open `<think>` (DeepSeek-R1's template): the answer then
    starts inside the block, and is read with the opening put back."""
    return tokenizer.decode(prompt_ids[-8:]).rstrip().endswith("<think>")


def _finished(record_id: str, messages: list[dict], reasons: list[str], tokens: int) -> dict:
    return {"id": record_id, "messages": messages, "finish_reasons": reasons, "tokens": tokens}


def _answer_batch(model, tokenizer, batch: list[Record], cfg: RegenerateConfig, device) -> list[dict]:
    """One finished (or failed) entry per record of `batch`, generated together turn by turn."""
    conversations = [list(system) for _, system, _ in batch]
    reasons: list[list[str]] = [[] for _ in batch]
    tokens = [0] * len(batch)
    failed: dict[int, str] = {}
    for turn in range(max(len(users) for _, _, users in batch)):
        active = [b for b, (_, _, users) in enumerate(batch) if turn < len(users) and b not in failed]
        if not active:  # every record with a later turn failed at an earlier one
            break
        prompts = {}
        for b in active:
            conversations[b].append({"role": "user", "content": batch[b][2][turn]})
            try:
                prompts[b] = chat_prompt_ids(tokenizer, conversations[b])
            except (ValueError, TemplateError) as exc:  # e.g. a template without a system role
                failed[b] = f"chat template refused turn {turn}: {exc}"
        if not prompts:
            continue
        for b, (new, reason) in zip(prompts, _generate(model, tokenizer, list(prompts.values()), cfg, device)):
            opened = "<think>\n" if _opens_thinking(tokenizer, prompts[b]) else ""
            text = _answer_text(opened + tokenizer.decode(new, skip_special_tokens=True), None, cfg.strip_thinking)
            if not text:
                failed[b] = f"empty answer at turn {turn}"
                continue
            conversations[b].append({"role": "assistant", "content": text})
            reasons[b].append(reason)
            tokens[b] += len(new)
    return [
        {"id": record_id, "failed": failed[b]} if b in failed else _finished(record_id, conversations[b], reasons[b], tokens[b])
        for b, (record_id, _, _) in enumerate(batch)
    ]


def batch_order(records: list[Record]) -> list[Record]:
    """`records` in the order the transformers backend batches them: by number of user turns, then by
    first-turn length. A batch generates turn after turn for the records that have one, so a batch of
    one-turn prompts with a few three-turn chats among them would run two more whole decodes for those
    few rows: on one H100, a mix with a fifth of ShareGPT chats ran at a third of the single-turn rate
    so. Batched with chats of their own turn count, every turn runs at the full batch."""
    return sorted(records, key=lambda r: (len(r[2]), len(r[2][0])))


def records_named(records: list[str], shown: int = 5) -> str:
    """Records for a message: a short list whole, a batch of thousands by its count and first ids
    (the back-off's `at` keeps every id; a warning line of 2,000 ids helps nobody)."""
    if len(records) <= shown:
        return f"records {records}"
    return f"{len(records)} records ({', '.join(map(repr, records[:shown]))}, ...)"


class RegenerateAttempt(BaseModel):
    """One attempt of the transformers backend: what crosses into its child process."""

    todo: list[Record]
    cfg: RegenerateConfig
    verifier: VerifierManifest
    device: str
    batch_size: int
    done_log: Path
    max_memory: dict[int | str, int] | None = Field(
        None, description="spread the verifier's layers over the visible GPUs with these byte budgets (None: all on `device`)"
    )


def _transformers_attempt(spec: RegenerateAttempt, on_progress: Progress) -> OutOfMemory | None:
    """Answer `spec.todo` batch by batch with one model load, appending each finished record to
    `spec.done_log`; `on_progress(records)` after each batch.

    Returns None when all are done, or where memory ran out: that batch and the later ones are
    left to the caller, to retry with a smaller batch size (in a fresh process on a GPU).
    """
    import torch

    device = torch.device(spec.device)
    tokenizer = verifier_tokenizer(spec.verifier)
    model = load_placed(spec.verifier.path, compute_dtype(device), device, spec.max_memory)
    use_grouped_decode(model)
    todo = batch_order(spec.todo)
    try:
        with open(spec.done_log, "a") as log:
            for start in range(0, len(todo), spec.batch_size):
                batch = todo[start : start + spec.batch_size]
                try:
                    answers = _answer_batch(model, tokenizer, batch, spec.cfg, device)
                except torch.OutOfMemoryError as exc:
                    records = [record_id for record_id, _, _ in batch]
                    return OutOfMemory(error=str(exc).splitlines()[0], where=f"on {records_named(records)}", at={"records": records})
                for entry in answers:
                    append_done(log, entry)
                on_progress(len(batch))
    finally:
        del model
        free_device_memory(device)
    return None


ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")  # torch reads any


def expandable_segments_env() -> dict[str, str]:
    """The allocator setting of a regeneration attempt's child: each batch's KV cache is sized by its
    own longest prompt, so batches allocate and free blocks of many sizes, and the caching
    allocator's fixed segments fragment under blocks of changing sizes (the H100 regenerations that
    ran out of memory at batch 2000, on the dynamic cache that grew by `torch.cat` at every step,
    held 20-25 GiB reserved but unallocated: `bench/results/quality_h100_sharegpt_27k`'s manifest).
    Expandable segments grow in place instead. None where the user set the allocator under any of
    its names: the older name would override theirs."""
    if any(name in os.environ for name in ALLOCATOR_SETTINGS):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _regenerate_on(
    todo: list[Record],
    cfg: RegenerateConfig,
    verifier: VerifierManifest,
    done_log: Path,
    backoff_log: Path,
    worker: Worker | None,
    records_done,
) -> list[Backoff]:
    """Run attempts on one worker (None: in this process, on `cfg.device`) until every record of
    `todo` is in `done_log`; the back-offs taken (listed in `backoff_log` as they are)."""
    backoff = BatchBackoff(
        "regenerate.batch_size",
        cfg.batch_size,
        "regenerate.min_batch_size",
        cfg.min_batch_size,
        kept=f"Finished records are kept in {done_log.parent}: a re-run resumes there. Lower regenerate.min_batch_size "
        "or max_new_tokens, shorten those prompts, or use a device with more memory.",
        log=backoff_log,
    )
    device = worker.device if worker else str(resolve_device(cfg.device))
    spec = RegenerateAttempt(
        todo=todo,
        cfg=cfg,
        verifier=verifier,
        device=device,
        batch_size=backoff.value,
        done_log=done_log,
        max_memory=worker.max_memory if worker else None,
    )
    while spec.todo:
        oom = run_attempt(_transformers_attempt, spec, worker.visible if worker else None, records_done, expandable_segments_env())
        finished = read_done(done_log, "record")
        left = [r for r in spec.todo if r[0] not in finished]
        assert oom is not None or not left, "an attempt without an out-of-memory error left records unfinished"
        spec = spec.model_copy(update={"todo": left, "batch_size": backoff.after(oom) if oom is not None else spec.batch_size})
    return backoff.taken


def _shares(todo: list[Record], batch_size: int, workers: int) -> list[list[Record]]:
    """`todo` dealt to `workers` a batch at a time, in the order one attempt sorts it (`batch_order`):
    each worker's attempt then forms the very batches one worker would, so greedy answers are those
    of a one-device run."""
    ordered = batch_order(todo)
    batches = [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]
    return [[r for batch in batches[w::workers] for r in batch] for w in range(workers)]


def _read_done_logs(work: Path) -> dict:
    """Finished records of every log in `work`: one per data-parallel worker (worker 0's is `DONE_LOG`)."""
    return {
        record: entry for log in [work / DONE_LOG, *sorted(work.glob("done.*.jsonl"))] for record, entry in read_done(log, "record").items()
    }


def _regenerate_by_transformers(
    todo: list[Record],
    cfg: RegenerateConfig,
    verifier: VerifierManifest,
    work: Path,
    gpus: list[str] | None,
    placement: VerifierConfig | None,
    records_done,
) -> list[Backoff]:
    """Every record of `todo` answered on the claimed `gpus` (None: in this process): one worker per
    GPU where the verifier fits one, each with a share of the records and a log of its own, else one
    worker with the layers spread over all of them. The back-offs taken, by every worker."""
    import torch

    if gpus is None:
        return _regenerate_on(todo, cfg, verifier, work / DONE_LOG, worker_backoff_log(work, 0), None, records_done)
    workers = place_verifier(verifier.path, gpus, placement, torch.bfloat16)
    logs = [work / DONE_LOG] + [work / f"done.{w}.jsonl" for w in range(1, len(workers))]
    with ThreadPoolExecutor(len(workers), thread_name_prefix="regenerate-worker") as pool:
        futures = [
            submit_in_context(pool, _regenerate_on, share, cfg, verifier, log, worker_backoff_log(work, w), worker, records_done)
            for w, (share, log, worker) in enumerate(zip(_shares(todo, cfg.batch_size, len(workers)), logs, workers))
        ]
    return [taken for future in futures for taken in future.result()]


def _answers_by_server(todo: list[Record], cfg: RegenerateConfig) -> Iterator[dict]:
    sampling = {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}

    def answer(record: Record, server: Server) -> dict:
        record_id, system, users = record
        messages, reasons, tokens = list(system), [], 0
        for turn, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            try:
                served = chat(server.client, server.endpoint, messages, sampling)
            except RequestRejected as exc:
                return {"id": record_id, "failed": f"server rejected turn {turn}: {exc}"}
            text = _answer_text(served.content, served.reasoning, cfg.strip_thinking)
            if not text:
                return {"id": record_id, "failed": f"empty answer at turn {turn}"}
            messages.append({"role": "assistant", "content": text})
            reasons.append(served.finish_reason)
            tokens += served.completion_tokens
        return _finished(record_id, messages, reasons, tokens)

    yield from spread(todo, open_servers(cfg.endpoints()), answer)


def _regenerate_by_server(todo: list[Record], cfg: RegenerateConfig, done_log: Path, records_done) -> None:
    with open(done_log, "a") as log:
        try:
            for entry in _answers_by_server(todo, cfg):
                append_done(log, entry)
                records_done(1)
        except EndpointError as exc:
            raise EndpointError(f"{exc} Finished records are kept in {done_log}: a re-run resumes there.") from exc


def regenerate(
    cfg: RegenerateConfig,
    source: Path,
    verifier: VerifierManifest,
    store: ArtifactStore,
    provenance: Provenance,
    on_progress=None,
    claim: GpuClaim = NO_GPU,
    placement: VerifierConfig | None = None,
) -> RegeneratedManifest:
    """Have the verifier answer every user turn of `source`; publish the conversations.

    `claim`: the CUDA devices to generate on (transformers backend), claimed only if records are
    left to generate. Of several, each answers a share of the records with a replica of the verifier
    where it fits one GPU, else the verifier's layers are spread over all of them (`placement`:
    `verifier.num_gpus` and its memory settings; devices named "cpu" are CPU worker processes).
    Each attempt runs in a child process seeing only its devices (none claimed: in
    this process on `cfg.device`). `on_progress(records_done, records_total)` is called as records finish.

    Raises:
        ArtifactError: a record of `source` has no user turn to answer, every record failed, or
            `done.jsonl` is corrupt.
        ConfigError: (backend 'transformers') the verifier does not fit the claimed GPUs.
        EndpointError: (backend 'openai') the server is unreachable or does not serve
            `endpoint.model`; the records finished so far are kept for the re-run.
        RuntimeError: (backend 'transformers') out of memory even at `cfg.min_batch_size`; the
            records finished so far are kept for the re-run.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = read_user_turns(source, cfg.max_records)
    with store.step_work_dir(RegeneratedManifest, provenance) as (work, published):
        if published is not None:
            return published
        clock = Stopwatch()  # not counting a wait for another run of this step, or for a GPU
        done_log = work / DONE_LOG
        done = _read_done_logs(work)
        resumed = set(done)
        earlier = earlier_answers(store, provenance, [r for r in records if r[0] not in done])
        if earlier.entries:
            logger.info(
                "regenerate: %d of %d records answered by earlier regenerations %s", len(earlier.entries), len(records), earlier.donors
            )
        done |= earlier.entries
        todo = [r for r in records if r[0] not in done]
        # a killed run that finished every record took its back-offs with it but listed them here
        backoffs, gpu_memory_after = [b for log in sorted(work.glob("backoffs*.jsonl")) for b in read_backoffs(log)], None
        if todo:
            with tqdm(total=len(todo), desc="regenerate", unit="rec") as progress:
                counting = threading.Lock()  # data-parallel workers report from a thread each

                def records_done(count: int) -> None:
                    with counting:
                        progress.update(count)
                        if on_progress is not None:
                            on_progress(progress.n, len(todo))

                if cfg.backend == "openai":
                    _regenerate_by_server(todo, cfg, done_log, records_done)
                else:
                    with clock.excluding_wait(claim()) as gpus:
                        backoffs = _regenerate_by_transformers(todo, cfg, verifier, work, gpus, placement, records_done)
                        gpu_memory_after = gpu_memory_used_mib(gpus) if gpus else None
            done = earlier.entries | _read_done_logs(work)

        ok = [done[r[0]] for r in records if "failed" not in done[r[0]]]
        if records and not ok:
            first_id = records[0][0]
            raise ArtifactError(
                source,
                f"every record failed, record id {first_id!r} with: {done[first_id]['failed']}. Nothing is published; "
                f"the failures are kept in {done_log} (delete it to try them again).",
            )
        out = work / "artifact"
        out.mkdir(exist_ok=True)
        pq.write_table(
            pa.table(
                {"id": [r["id"] for r in ok], "messages": [r["messages"] for r in ok], "finish_reasons": [r["finish_reasons"] for r in ok]}
            ),
            out / CONVERSATIONS,
        )
        manifest = store.publish(
            out,
            RegeneratedManifest(
                **provenance.model_dump(),
                path=out,
                num_records=len(ok),
                num_generated_tokens=sum(r["tokens"] for r in ok),
                reused_records=sum(r["id"] in earlier.entries for r in ok),
                resumed_records=sum(r["id"] in resumed for r in ok),
                reused_from=earlier.donors,
                failed={r[0]: done[r[0]]["failed"] for r in records if "failed" in done[r[0]]},
                backoffs=backoffs,
                gpu_memory_after_mib=gpu_memory_after,
                seconds=clock(),
            ),
        )
        shutil.rmtree(work)
        return manifest
