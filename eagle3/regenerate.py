"""Regenerate: the verifier writes the assistant turns the draft will learn from.

Input records: `prompt` (one user turn), MT-bench `turns` (several user turns), or conversations
(`messages` / ShareGPT `conversations`) whose assistant turns are replaced. Turns are generated
in order, so each later user turn sees the regenerated earlier answers. Two backends:
`transformers`, batched `generate` in this process (KV cache on, left padding, prompts sorted by
length), and `openai`, chat requests to an OpenAI-compatible server such as `vllm serve` (records
in parallel, `endpoint.concurrency` at a time), which is how the verifier is used at scale. Greedy
or sampled with a fixed seed; thinking (`<think>...</think>`, or a server's separate reasoning
field) can be stripped.

Output `conversations.parquet`: `id`, `messages` (list of {role, content}), `finish_reasons`
(`stop` | `length` per generated turn). Records that fail (a prompt longer than the context, an
empty answer) are listed in the manifest with their reason, never silently dropped. Finished
records are appended to `done.jsonl` in the work dir as they complete, so a re-run after a crash
(or an unreachable server) regenerates only what is missing; a last line cut short by a kill is
dropped and its record redone. Cost: one decode per generated token.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from eagle3.config import RegenerateConfig
from eagle3.endpoint import EndpointError, RequestRejected, chat, open_client
from eagle3.extract_hidden_states import resolve_device
from eagle3.prepare_dataset import ROLE_ALIASES, read_records
from eagle3.store import ArtifactError, ArtifactManifest, ArtifactStore, Provenance, Stopwatch
from eagle3.verifier import VerifierManifest, load_text_model, load_tokenizer

__all__ = ["RegeneratedManifest", "read_user_turns", "regenerate", "regenerated_conversations"]

logger = logging.getLogger(__name__)

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)

Record = tuple[str, list[dict[str, str]], list[str]]  # (id, system messages, user turns)


class RegeneratedManifest(ArtifactManifest):
    kind: str = "regenerated"
    num_records: int
    num_generated_tokens: int
    failed: dict[str, str]


def read_user_turns(path: Path, limit: int | None) -> list[Record]:
    """(record id, system messages, user turns) per record, from any supported prompt shape."""
    out = []
    for index, record in read_records(path):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(record, dict):
            raise ArtifactError(path, f"record {index}: expected a JSON object")
        record_id = str(record.get("id", record.get("question_id", index)))
        if isinstance(record.get("prompt"), str):
            out.append((record_id, [], [record["prompt"]]))
        elif isinstance(record.get("turns"), list) and all(isinstance(t, str) for t in record["turns"]):
            out.append((record_id, [], list(record["turns"])))
        elif isinstance(record.get("messages") or record.get("conversations"), list):
            role_key, text_key = ("role", "content") if "messages" in record else ("from", "value")
            turns = record.get("messages") or record.get("conversations")
            roles = [ROLE_ALIASES.get(str(t.get(role_key)).lower()) for t in turns]
            system = [{"role": "system", "content": t[text_key]} for t, r in zip(turns, roles) if r == "system"]
            users = [t[text_key] for t, r in zip(turns, roles) if r == "user"]
            if not users:
                raise ArtifactError(path, f"record {index} (id {record_id!r}): field '{role_key}': no user turn to answer")
            out.append((record_id, system, users))
        else:
            raise ArtifactError(path, f"record {index}: no prompt field: expected 'prompt', 'turns', 'messages' or 'conversations'")
    return out


def regenerated_conversations(manifest: RegeneratedManifest) -> Path:
    """The conversations file of a regeneration artifact: prepare_dataset's input."""
    return Path(manifest.path) / "conversations.parquet"


@torch.inference_mode()
def _generate(model, tokenizer, conversations: list[list[dict]], cfg: RegenerateConfig, device) -> list[tuple[list[int], str]]:
    """Greedy/sampled continuations of each conversation: (new token ids, finish reason)."""
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for c in conversations]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    torch.manual_seed(cfg.seed)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.temperature > 0 else {"do_sample": False}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=cfg.max_new_tokens,
                         pad_token_id=pad, **sampling)[:, width:].tolist()
    eos = {tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])} - {None}
    results = []
    for tokens in out:
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        results.append((tokens[:stop], "stop") if stop is not None else (tokens, "length"))
    return results


def _answer_text(content: str, reasoning: str | None, strip_thinking: bool) -> str:
    if strip_thinking:
        return _THINK.sub("", content).strip()
    return (f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content).strip()


def _finished(record_id: str, messages: list[dict], reasons: list[str], tokens: int) -> dict:
    return {"id": record_id, "messages": messages, "finish_reasons": reasons, "tokens": tokens}


def _answers_by_transformers(todo: list[Record], cfg: RegenerateConfig, verifier: VerifierManifest) -> Iterator[dict]:
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(verifier.path)
    model = load_text_model(verifier.path, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    todo = sorted(todo, key=lambda r: len(r[2][0]))
    for start in range(0, len(todo), cfg.batch_size):
        batch = todo[start : start + cfg.batch_size]
        conversations = [list(system) for _, system, _ in batch]
        reasons: list[list[str]] = [[] for _ in batch]
        tokens = [0] * len(batch)
        failed: dict[int, str] = {}
        for turn in range(max(len(users) for _, _, users in batch)):
            active = [b for b, (_, _, users) in enumerate(batch) if turn < len(users) and b not in failed]
            for b in active:
                conversations[b].append({"role": "user", "content": batch[b][2][turn]})
            for b, (new, reason) in zip(active, _generate(model, tokenizer, [conversations[b] for b in active], cfg, device)):
                text = _answer_text(tokenizer.decode(new, skip_special_tokens=True), None, cfg.strip_thinking)
                if not text:
                    failed[b] = f"empty answer at turn {turn}"
                    continue
                conversations[b].append({"role": "assistant", "content": text})
                reasons[b].append(reason)
                tokens[b] += len(new)
        for b, (record_id, _, _) in enumerate(batch):
            yield {"id": record_id, "failed": failed[b]} if b in failed else _finished(record_id, conversations[b], reasons[b], tokens[b])


def _append_done(log, entry: dict) -> None:
    log.write(json.dumps(entry) + "\n")  # one write per line: a kill leaves at most the last one torn
    log.flush()


def _read_done(done_log: Path) -> dict[str, dict]:
    """Finished entries by record id. A last line without its newline is a write cut short by a
    kill: it is cut from the file (so appends start on a fresh line) and its record is redone."""
    if not done_log.exists():
        return {}
    data = done_log.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        logger.warning("%s: dropping an incomplete last line (%d bytes, a write cut short); its record is regenerated",
                       done_log, len(data) - len(complete))
        os.truncate(done_log, len(complete))
    done = {}
    for number, line in enumerate(complete.decode().splitlines(), 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ArtifactError(done_log, f"line {number} is not JSON ({exc}); delete that line (its record is "
                                          "regenerated) or the file (all are)") from exc
        done[entry["id"]] = entry
    return done


def _answers_by_server(todo: list[Record], cfg: RegenerateConfig) -> Iterator[dict]:
    client = open_client(cfg.endpoint)
    sampling = {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}

    def answer(record: Record) -> dict:
        record_id, system, users = record
        messages, reasons, tokens = list(system), [], 0
        for turn, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            try:
                served = chat(client, cfg.endpoint, messages, sampling)
            except RequestRejected as exc:
                return {"id": record_id, "failed": f"server rejected turn {turn}: {exc}"}
            text = _answer_text(served.content, served.reasoning, cfg.strip_thinking)
            if not text:
                return {"id": record_id, "failed": f"empty answer at turn {turn}"}
            messages.append({"role": "assistant", "content": text})
            reasons.append(served.finish_reason)
            tokens += served.completion_tokens
        return _finished(record_id, messages, reasons, tokens)

    with ThreadPoolExecutor(cfg.endpoint.concurrency) as pool:
        futures = [pool.submit(answer, record) for record in todo]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def regenerate(
    cfg: RegenerateConfig, source: Path, verifier: VerifierManifest, store: ArtifactStore, provenance: Provenance
) -> RegeneratedManifest:
    """Have the verifier answer every user turn of `source`; publish the conversations.

    Raises:
        ArtifactError: a record of `source` has no user turn to answer, or `done.jsonl` is corrupt.
        EndpointError: (backend 'openai') the server is unreachable or does not serve
            `endpoint.model`; the records finished so far are kept for the re-run.
    """
    clock = Stopwatch()
    records = read_user_turns(source, cfg.max_records)
    work = store.work_dir("regenerated", provenance.key)
    done_log = work / "done.jsonl"
    done = _read_done(done_log)
    todo = [r for r in records if r[0] not in done]
    if todo:
        answers = _answers_by_server(todo, cfg) if cfg.backend == "openai" else _answers_by_transformers(todo, cfg, verifier)
        with tqdm(total=len(todo), desc="regenerate", unit="rec") as progress, open(done_log, "a") as log:
            try:
                for entry in answers:
                    _append_done(log, entry)
                    done[entry["id"]] = entry
                    progress.update()
            except EndpointError as exc:
                raise EndpointError(f"{exc} Finished records are kept in {done_log}: a re-run resumes there.") from exc

    ok = [done[r[0]] for r in records if "failed" not in done[r[0]]]
    out = work / "artifact"
    out.mkdir(exist_ok=True)
    pq.write_table(
        pa.table({"id": [r["id"] for r in ok], "messages": [r["messages"] for r in ok],
                  "finish_reasons": [r["finish_reasons"] for r in ok]}),
        out / "conversations.parquet",
    )
    manifest = store.publish(
        out,
        RegeneratedManifest(
            **provenance.model_dump(),
            path=out,
            num_records=len(ok),
            num_generated_tokens=sum(r["tokens"] for r in ok),
            failed={r[0]: done[r[0]]["failed"] for r in records if "failed" in done[r[0]]},
            seconds=clock(),
        ),
    )
    shutil.rmtree(work)
    return manifest
