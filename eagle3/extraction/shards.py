"""Hidden-state shards: content-addressed groups of samples' states that any run can reuse.

A shard's key hashes the verifier, the aux layers, the extraction route's code version and its
samples' token ids; the shard lives in the store's `shards/<key>/` as `hs_{j}.safetensors` files
(j: position in the shard, speculators' format: `hidden_states` [seq, 4, H] bf16 and `token_ids`
[seq] int64; with `extract.storage=fp8`, hs-connectors' FP8 format instead, `eagle3.extraction.storage`)
and a `done.json` with each file's sha256, written once every file checked out. The
hidden-states artifact (`HiddenStatesManifest`, `shards.json`) lists the shards of a dataset.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import Field
from safetensors import safe_open

from eagle3.config import ExtractConfig
from eagle3.extraction.storage import SCALES_KEY
from eagle3.extraction.vllm_engine import engine_identity
from eagle3.runtime.attempts import Backoff
from eagle3.runtime.locks import exclusive, exclusive_if_free
from eagle3.store.artifacts import ArtifactError
from eagle3.store.manifests import ArtifactManifest
from eagle3.store.versions import code_version, route
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = [
    "HiddenStatesManifest",
    "code_step",
    "hidden_state_files",
    "hs_path",
    "shard_key",
    "shard_lock",
    "shard_lock_if_free",
    "verify_shard",
]


class HiddenStatesManifest(ArtifactManifest):
    kind: str = "hidden_states"
    aux_layer_ids: list[int]
    hidden_size: int
    num_records: int
    num_tokens: int
    shards: list[dict] = Field(description="per shard: key, first_record, num_records")
    extracted_shards: int
    reused_shards: int
    storage: str = Field("bf16", description="precision of the stored states: bf16, or fp8 (hs-connectors' format)")
    backoffs: list[Backoff] = Field(default_factory=list)
    gpu_memory_after_mib: dict[str, int] | None = Field(
        None, description="memory in use on each claimed GPU once the step's processes exited"
    )


def hs_path(shard_dir: Path, index: int) -> Path:
    return shard_dir / f"hs_{index}.safetensors"


_FIELDS = {  # storage -> each field's safetensors dtype
    "bf16": {"hidden_states": "BF16", "token_ids": "I64"},
    "fp8": {"hidden_states": "F8_E4M3", SCALES_KEY: "F32", "token_ids": "I64"},
}


def verify_shard(shard_dir: Path, expected: list[list[int]], num_slots: int, hidden_size: int, storage: str = "bf16") -> None:
    """Check every file of a shard as written: fields, their dtypes for `storage`, shapes and token
    ids (values were checked finite before writing); raise ArtifactError naming the file and field
    on any defect."""
    fields = _FIELDS[storage]
    for index, token_ids in enumerate(expected):
        path = hs_path(shard_dir, index)
        if not path.exists():
            raise ArtifactError(path, "missing")
        with safe_open(path, "pt") as f:
            if set(f.keys()) != set(fields):
                raise ArtifactError(path, f"fields {sorted(fields)} expected ({storage} storage), found {sorted(f.keys())}")
            found = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in fields}
            ids = f.get_tensor("token_ids")
        shapes = {
            "hidden_states": (len(token_ids), num_slots, hidden_size),
            SCALES_KEY: (len(token_ids), 1, 1),
            "token_ids": (len(token_ids),),
        }
        for name, dtype in fields.items():
            if found[name] != (dtype, shapes[name]):
                raise ArtifactError(
                    path, f"field '{name}': {found[name][0]} {found[name][1]}, expected {dtype} {shapes[name]} ({storage} storage)"
                )
        if ids.tolist() != token_ids:
            raise ArtifactError(path, "field 'token_ids' does not match the prepared dataset record")


def code_step(cfg: ExtractConfig) -> str:
    """The `eagle3.store.versions` entry of the route that computes the states."""
    return route("hidden_states", cfg.backend, local="transformers")


def shard_key(cfg: ExtractConfig, verifier: VerifierManifest, aux: list[int], samples: list[list[int]]) -> str:
    """A shard's key: the verifier, the aux layers, the route's code version (so a version bump of
    one route leaves the other's shards cached; a server's kernels and dtype round differently from
    the step's, so its served model name stands for it, and vLLM's engine's environment, dtype and
    arguments for the engine), the storage precision where it is fp8 (bf16 shards keep the keys they
    had before FP8 existed) and its samples' token ids."""
    extracted_by: list[str | dict | None] = [code_version(code_step(cfg))]
    if cfg.backend == "vllm":
        extracted_by.append(cfg.endpoint.model)
    if cfg.backend == "vllm-engine":
        extracted_by.append(engine_identity(cfg.engine))
    if cfg.storage != "bf16":
        extracted_by.append({"storage": cfg.storage})
    h = hashlib.sha256(json.dumps([verifier.digest, aux, *extracted_by]).encode())
    for token_ids in samples:
        h.update(json.dumps(token_ids).encode())
    return h.hexdigest()


def shard_lock_path(shard_root: Path, key: str) -> Path:
    return shard_root.parent / "locks" / f"shard-{key[:24]}.lock"


def shard_lock(shard_root: Path, key: str):
    """Held while a shard is extracted, so two runs that need the same shard extract it once;
    waited for (without a GPU) by a run that needs a shard another run is extracting."""
    return exclusive(shard_lock_path(shard_root, key), f"another run extracting shard {key[:12]}")


def shard_lock_if_free(shard_root: Path, key: str):
    """`_shard_lock` if no other run holds it: extraction skips such shards and waits for them last."""
    return exclusive_if_free(shard_lock_path(shard_root, key))


def hidden_state_files(manifest: HiddenStatesManifest) -> dict[int, Path]:
    """Sample index -> its hidden-state file, across the shared shard directories."""
    shard_root = Path(manifest.path).parent.parent / "shards"  # <store>/artifacts/<digest> -> <store>/shards
    files = {}
    for shard in manifest.shards:
        for j in range(shard["num_records"]):
            files[shard["first_record"] + j] = hs_path(shard_root / shard["key"], j)
    return files
