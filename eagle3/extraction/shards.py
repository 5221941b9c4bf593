"""Hidden-state shards: content-addressed groups of samples' states that any run can reuse.

A shard's key hashes the verifier, the aux layers, the extraction route's code version and its
samples' token ids; the shard lives in the store's `shards/<key>/` as `hs_{j}.safetensors` files
(j: position in the shard, speculators' format: `hidden_states` [seq, 4, H] bf16 and `token_ids`
[seq] int64) and a `done.json` with each file's sha256, written once every file checked out. The
hidden-states artifact (`HiddenStatesManifest`, `shards.json`) lists the shards of a dataset.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import Field
from safetensors import safe_open

from eagle3.config import ExtractConfig
from eagle3.runtime.attempts import Backoff
from eagle3.runtime.locks import exclusive, exclusive_if_free
from eagle3.store.artifacts import ArtifactError
from eagle3.store.manifests import ArtifactManifest
from eagle3.store.versions import code_version, route
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = [
    "HiddenStatesManifest", "code_step", "hidden_state_files", "hs_path", "shard_key", "shard_lock", "shard_lock_if_free", "verify_shard",
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
    backoffs: list[Backoff] = []
    gpu_memory_after_mib: dict[str, int] | None = Field(
        None, description="memory in use on each claimed GPU once the step's processes exited"
    )


def hs_path(shard_dir: Path, index: int) -> Path:
    return shard_dir / f"hs_{index}.safetensors"


def verify_shard(shard_dir: Path, expected: list[list[int]], num_slots: int, hidden_size: int) -> None:
    """Check every file of a shard as written: fields, shape and token ids (values were checked
    finite before writing); raise ArtifactError naming the file and field on any defect."""
    for index, token_ids in enumerate(expected):
        path = hs_path(shard_dir, index)
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


def code_step(cfg: ExtractConfig) -> str:
    """The `eagle3.store.versions` entry of the route that computes the states."""
    return route("hidden_states", cfg.backend, local="transformers")



def shard_key(cfg: ExtractConfig, verifier: VerifierManifest, aux: list[int], samples: list[list[int]]) -> str:
    """A shard's key: the verifier, the aux layers, the route's code version (so a version bump of
    one route leaves the other's shards cached; a server's kernels and dtype round differently from
    the step's, so its served model name stands for it) and its samples' token ids."""
    extracted_by = [code_version(code_step(cfg))] + ([cfg.endpoint.model] if cfg.backend == "vllm" else [])
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

