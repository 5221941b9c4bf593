"""What can be checked before a run starts, in well under a second: its inputs exist and are what
their suffix says, the store is a writable directory with room, the verifier's config parses and
its default aux layers fit it, the dataset splits into training and validation records (or a given
draft's directory holds a config and whole weight files), and the eval prompts file holds
`evaluate.num_prompts` prompts.

Found inside the flow, each of these cost 20-35 s (a temporary server, the steps before) and
printed Prefect's tracebacks before the one line that matters. Only headers and counts are read:
a safetensors file's header against its size (a truncated copy), a GGUF file's magic, a parquet
file's footer, a JSONL file's line count. A record's content is the steps' to check.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

from eagle3.config import ConfigError, PipelineConfig, store_path
from eagle3.extraction.storage import MIN_FREE_BYTES
from eagle3.store.artifacts import ArtifactError

__all__ = ["REMOTE_CODE_ENV", "check_preflight", "preflight", "storage_problem", "verifier_problems"]

REMOTE_CODE_ENV = "EAGLE3_ALLOW_REMOTE_CODE"  # "false": a deployment pins verifier.trust_remote_code off (docs/security.md)
GGUF_MAGIC = b"GGUF"
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # EFBIG: a file-size limit (ulimit -f), met the same way
_NO_ACCESS = {errno.EACCES, errno.EPERM, errno.EROFS}

Problem = ConfigError | ArtifactError


def preflight(config: PipelineConfig) -> list[Problem]:
    """Every problem found, each naming its file or setting and the fix; empty when the run may
    start. Creates the store directory (as the run would)."""
    problems = _remote_code(config) + _store(store_path(config.store_dir))
    problems += verifier_problems(config)
    problems += _dataset(config) if config.draft_path is None else _given_draft(Path(config.draft_path).expanduser())
    problems += _prompts(config)
    return problems


def check_preflight(config: PipelineConfig) -> None:
    """`preflight`, for callers without a terminal (the flow, as a deployment runs it).

    Raises:
        ConfigError: every problem found, joined.
    """
    if problems := preflight(config):
        raise ConfigError("; ".join(map(str, problems)))


def _remote_code(config: PipelineConfig) -> list[Problem]:
    if config.verifier.trust_remote_code and os.environ.get(REMOTE_CODE_ENV, "").lower() in {"0", "false", "no"}:
        return [
            ConfigError(
                f"verifier.trust_remote_code=true, but {REMOTE_CODE_ENV}={os.environ[REMOTE_CODE_ENV]} here: whoever runs this "
                "deployment does not run code shipped with a verifier. Use a verifier that needs none, or run it elsewhere."
            )
        ]
    return []


def _store(store: Path) -> list[Problem]:
    if store.exists() and not store.is_dir():
        return [ArtifactError(store, "store_dir is a file, not a directory: set store_dir to a directory (it is created if missing)")]
    try:
        store.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=store, prefix=".preflight-"):
            pass
    except OSError as exc:
        return [
            ArtifactError(
                store,
                f"store_dir is not writable ({exc.strerror}): every step writes its artifacts "
                "there; set store_dir to a directory you may write",
            )
        ]
    free = shutil.disk_usage(store).free
    if free < MIN_FREE_BYTES:
        return [
            ArtifactError(
                store,
                f"only {free / 2**20:.0f} MiB free on store_dir's filesystem, below the "
                f"{MIN_FREE_BYTES / 2**20:.0f} MiB any run needs: free space or set store_dir elsewhere",
            )
        ]
    return []


def _readable(path: Path, setting: str) -> ArtifactError | None:
    if not path.exists():
        return ArtifactError(path, f"{setting} does not exist")
    try:
        if path.is_file():
            with open(path, "rb") as f:
                f.read(1)
        else:
            os.listdir(path)
    except OSError as exc:
        return ArtifactError(path, f"{setting} is not readable ({exc.strerror})")
    return None


def verifier_problems(config: PipelineConfig) -> list[Problem]:
    """What is wrong with the verifier's files, as far as their headers tell (`eagle3 plan` reads no more)."""
    from eagle3.verifier.resolve_verifier import verifier_source

    try:
        source = verifier_source(config.verifier)
    except ConfigError as exc:
        return [exc]
    if unreadable := _readable(source, "verifier.path"):
        return [unreadable]
    if source.is_file():
        return _gguf(source)
    truncated = [_truncated(f) for f in sorted(source.glob("*.safetensors"))]
    problems: list[Problem] = [p for p in truncated if p is not None]
    config_file = source / "config.json"
    try:
        verifier_config = json.loads(config_file.read_text())
    except FileNotFoundError:
        return [*problems, ArtifactError(source, "verifier.path has no config.json: not a Hugging Face model directory")]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [*problems, ArtifactError(config_file, f"not a readable JSON file ({exc}): copy the verifier again")]
    if not isinstance(verifier_config, dict):
        return [*problems, ArtifactError(config_file, "expected a JSON object")]
    return problems + ([] if config.draft_path is not None else _aux_layers(config, source, verifier_config))  # a given draft has its own


def _gguf(source: Path) -> list[Problem]:
    if source.suffix != ".gguf":
        return [
            ArtifactError(source, "verifier.path is a file but not a .gguf file: set it to a Hugging Face model directory or a .gguf file")
        ]
    with open(source, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        return [ArtifactError(source, f"not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}; download it again")]
    return []


def _truncated(path: Path, what: str = "the verifier") -> ArtifactError | None:
    """A safetensors file shorter than its header says (a copy cut short), or no safetensors file at
    all; the fix offered is to copy `what` again."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return ArtifactError(path, f"truncated: {size} bytes, not even a safetensors header; copy {what} again")
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_len)) if 8 + header_len <= size else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        return ArtifactError(path, f"not a safetensors file, or truncated in its header ({size} bytes); copy {what} again")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        return ArtifactError(
            path, f"truncated: its header lists {8 + header_len + end} bytes of tensors, the file holds {size}; copy {what} again"
        )
    return None


def _aux_layers(config: PipelineConfig, source: Path, verifier_config: dict) -> list[Problem]:
    from eagle3.extraction.extract_hidden_states import resolve_aux_layer_ids

    text = verifier_config.get("text_config") or verifier_config
    layers = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if not isinstance(layers, int):
        return [ArtifactError(source / "config.json", "field 'num_hidden_layers' is missing (also under 'text_config')")]
    try:
        resolve_aux_layer_ids(config.extract.aux_layer_ids, layers, source)
    except ConfigError as exc:
        return [exc]
    return []


def _count_records(path: Path, setting: str) -> tuple[int | None, list[Problem]]:
    """Records in a JSONL file (its non-empty lines) or a parquet file (its footer's row count)."""
    if unreadable := _readable(path, setting):
        return None, [unreadable]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows, []
        except (pa.ArrowException, OSError) as exc:
            return None, [ArtifactError(path, f"{setting} is not a parquet file ({exc}); write it again, or give a JSONL file")]
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip()), []


def _dataset(config: PipelineConfig) -> list[Problem]:
    from eagle3.data.prepare_dataset import dataset_source

    try:
        source = dataset_source(config.dataset)
    except ArtifactError as exc:
        return [exc]
    count, problems = _count_records(source, "dataset.path")
    if count is None:
        return problems
    limits = [config.dataset.max_records, config.regenerate.max_records if config.regenerate.enabled else None]
    records = min([count, *(n for n in limits if n is not None)])
    ratio = config.train.train_data_ratio
    trained = int(records * ratio)
    if 1 <= trained < records:
        return []
    needed = max(2, math.ceil(1 / ratio))  # the fewest records that keep one for training (and, ratio < 1, one to validate)
    while int(needed * ratio) < 1:  # 1 / ratio rounded down in floating point
        needed += 1
    cut = f" (of {count}: dataset.max_records or regenerate.max_records)" if records < count else ""
    return [
        ArtifactError(
            source,
            (
                f"{records} record(s) to use{cut}: train.train_data_ratio={ratio:g} splits them {trained} for training and "
                f"{records - trained} for validation, and each needs at least one. Give at least {needed} records, or change "
                "train.train_data_ratio"
            ),
        )
    ]


def _given_draft(path: Path) -> list[Problem]:
    if unreadable := _readable(path, "draft_path"):
        return [unreadable]
    if not (path / "config.json").is_file():
        return [ArtifactError(path, "draft_path has no config.json: not an exported speculators checkpoint directory")]
    return [p for p in (_truncated(f, "the draft") for f in sorted(path.glob("*.safetensors"))) if p is not None]


def _prompts(config: PipelineConfig) -> list[Problem]:
    from eagle3.evaluation.evaluate import eval_prompts_source

    try:
        source = eval_prompts_source(config.evaluate)
    except ArtifactError as exc:
        return [exc]
    count, problems = _count_records(source, "evaluate.prompts_path")
    if count is not None and count < config.evaluate.num_prompts:
        return [
            ArtifactError(
                source,
                f"holds {count} prompts, but evaluate.num_prompts is {config.evaluate.num_prompts}: "
                f"set evaluate.num_prompts to at most {count}, or add prompts",
            )
        ]
    return problems


def storage_problem(exc: BaseException | None, store: Path) -> ArtifactError | None:
    """The disk-full or permission error behind `exc` (itself or what it was raised from), as one
    line naming the file (else the store) and the fix; None for anything else. A disk that fills
    midway cannot be seen before the run: what finished stays cached, so freeing space and running
    again continues where the run stopped."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    if exc is None or exc.errno not in _NO_ROOM | _NO_ACCESS:
        return None
    where = Path(exc.filename) if exc.filename else store
    if exc.errno in _NO_ROOM:
        return ArtifactError(
            where,
            f"cannot write: {exc.strerror}. Free space on store_dir's filesystem (or set store_dir "
            "elsewhere) and run again: finished steps stay cached",
        )
    return ArtifactError(
        where,
        f"{exc.strerror}: this user may not write there; fix its permissions or set store_dir to a directory you may write, and run again",
    )
