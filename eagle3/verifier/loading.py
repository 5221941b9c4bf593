"""Loading a resolved verifier: its config, tokenizer (with the chat template every step renders
through) and text model, as transformers ships it, quantized checkpoints included."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.store.artifacts import ArtifactError

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch

__all__ = [
    "chat_prompt_ids",
    "eos_token_ids",
    "load_text_model",
    "load_tokenizer",
    "read_config",
    "text_config",
    "text_model_class",
]


def read_config(path: Path):
    """The verifier's config, or an ArtifactError naming config.json where transformers cannot read it."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as exc:
        raise ArtifactError(
            path / "config.json", f"transformers {transformers.__version__} cannot read it: {str(exc).splitlines()[0]}"
        ) from exc


def text_config(config):
    """The decoder config of a verifier: `text_config` for nested multimodal models, else itself."""
    return getattr(config, "text_config", None) or config


def text_model_class(config):
    """The transformers auto class that loads a verifier for text: `AutoModelForCausalLM`, or for a
    nested multimodal config `AutoModelForImageTextToText` (whose text part has no `*ForCausalLM` of its own)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if text_config(config) is config else AutoModelForImageTextToText


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        hint = (
            ""
            if trust_remote_code or "trust_remote_code" not in str(exc)
            else " (set verifier.trust_remote_code=true if you trust that code)"
        )
        raise ArtifactError(path, f"missing or unreadable tokenizer: {exc}{hint}") from exc


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids that prompt the verifier's next assistant turn after `messages`, by its chat template."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def eos_token_ids(tokenizer, model) -> set[int]:
    """Every token id that ends a turn: the tokenizer's EOS and those of the model's generation config."""
    configured = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id, *([configured] if isinstance(configured, int) else configured or [])} - {None}


def _decoder_name(model) -> str:
    """The text decoder's module name in `model` (`model.language_model` in a nested one)."""
    return next(name for name, module in model.named_modules() if module is model.get_decoder())


def _quantization_loading(auto, config) -> dict:
    """`from_pretrained`'s arguments for a quantized checkpoint (none for a plain one), `config`
    given its quantization_config where transformers reads it, at the top (Kimi-K2.5 nests it in
    `text_config`). compressed-tensors weights are dequantized once at load, so every forward (CUDA
    graphs, the decoder run alone) sees plain weights; of a nested checkpoint only the text
    decoder's and head's, the parts that run."""
    import torch
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
    import torch

    kept = set(model._keep_in_fp32_modules_strict or ()) if dtype in (torch.float16, torch.bfloat16) else set()
    kept |= set(model._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()
    in_float32 = re.compile("|".join(name.replace("*", ".*") for name in kept)) if kept else None
    for name, param in model.named_parameters():
        if param.dtype in (torch.float32, torch.float16, torch.bfloat16) and not (in_float32 and in_float32.search(name)):
            param.data = param.data.to(dtype)


def load_text_model(path: Path, dtype: torch.dtype, device: str | torch.device, device_map: dict[str, int | str] | None = None):
    """The verifier as transformers loads it for text: a `*ForCausalLM`, or for a nested multimodal
    checkpoint its `*ForConditionalGeneration` (text-only inputs never reach the vision tower, a small
    share of the weights). transformers' own loading applies every checkpoint conversion it knows (a
    Kimi-K2.5 checkpoint's per-expert tensors fused into its DeepSeek-V3 decoder's). `get_decoder()`
    is the text decoder either way.

    A quantized checkpoint loads through transformers' quantizer for its `quantization_config`;
    compressed-tensors ones (llm-compressor's) are dequantized to `dtype`.

    `device_map` (module name -> device, as `eagle3.verifier.placement` plans it) spreads the
    layers over several devices instead of putting the model on `device`: accelerate's hooks then
    move each layer's inputs to its device, and the model must not be moved afterwards.

    Raises:
        ArtifactError: transformers has no such model for the config, cannot load its quantization
            (a package missing), or the checkpoint lacks weights the model has (which transformers
            would leave randomly initialised).
    """
    config = read_config(path)
    auto = text_model_class(config)
    if type(config) not in auto._model_mapping:
        raise ArtifactError(path, f"field 'model_type' is '{config.model_type}': transformers has no {auto.__name__} for it")
    try:
        loading = _quantization_loading(auto, config)
        placed = {"device_map": device_map} if device_map is not None else {}
        with warnings.catch_warnings():  # that the checkpoint's quantization_config is kept, `dequantize` set
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model, info = auto.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True, **loading, **placed)
    except ImportError as exc:
        if (quantization := getattr(config, "quantization_config", None)) is None:
            raise
        method = quantization.get("quant_method")  # whose package is missing
        raise ArtifactError(path / "config.json", f"field 'quantization_config' ({method}): {exc}") from exc
    decoder = _decoder_name(model)
    # A nested checkpoint may leave out its vision tower (never run on text); not the decoder or head.
    if missing := sorted(k for k in info["missing_keys"] if k.startswith((decoder + ".", "lm_head."))):
        raise ArtifactError(
            path,
            f"weights {missing[:5]}{' ...' if len(missing) > 5 else ''} of {type(model).__name__} are not in the "
            "checkpoint: it is not a checkpoint of its config.json",
        )
    if loading:
        _cast_dequantized(model, dtype)
    return (model if device_map is not None else model.to(device)).eval()
