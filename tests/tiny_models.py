"""Tiny real verifiers for tests: random-weight Llama decoders with a trained byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
THINKING = CHATML.replace(  # DeepSeek-R1's way: the generation prompt opens a thinking block rendered answers lack
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
)
GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


SAMPLE = Path(__file__).resolve().parent / "fixtures" / "conversations.jsonl"  # the tests' conversations


def sample_texts() -> list[str]:
    texts = []
    for line in SAMPLE.read_text().splitlines():
        texts.extend(m["content"] for m in json.loads(line)["messages"])
    return texts


def tiny_tokenizer(template: str | None = CHATML, vocab_size: int = 1024, ascii_only: bool = False):
    """`ascii_only`: no token holds part of a multi-byte character, so any token sequence a random
    model emits decodes to whole characters (a server's streaming detokenizer holds partial ones back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet, limits = pre_tokenizers.ByteLevel.alphabet(), {}
    if ascii_only:  # the 128 byte-level symbols of ASCII, and nothing the sample text adds
        pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str("".join(map(chr, range(128))))
        alphabet = sorted(set("".join(piece for piece, _ in pieces)))
        limits = {"limit_alphabet": len(alphabet)}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet, **limits)
    tok.train_from_iterator(sample_texts() * 2, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )


def _llama_config(vocab_size: int, num_layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def tiny_llama(out: Path, num_layers: int = 4, hidden: int = 64, template: str | None = CHATML, ascii_only: bool = False) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer(template, ascii_only=ascii_only)
    model = LlamaForCausalLM(_llama_config(len(tokenizer), num_layers, hidden))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_llava(out: Path, num_layers: int = 4, hidden: int = 64) -> Path:
    """A Llava-style verifier: `text_config` nested in the config, decoder weights under a prefix."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16
    )
    config = LlavaConfig(
        vision_config=vision, text_config=_llama_config(len(tokenizer), num_layers, hidden), image_token_index=len(tokenizer) - 1
    )
    LlavaForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)
    return out


REPOSITORY_TOKENIZER = """from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


class LabelledTokenizer(PreTrainedTokenizerFast):
    \"\"\"Reads its vocabulary from labelled.json, which transformers alone does not look for.\"\"\"

    vocab_files_names = {"labelled_file": "labelled.json"}

    def __init__(self, labelled_file=None, **kwargs):
        super().__init__(tokenizer_object=Tokenizer.from_file(labelled_file), **kwargs)
"""


def with_repository_tokenizer(verifier: Path, out: Path) -> Path:
    """A copy of `verifier` whose tokenizer only the Python code in its own directory can load
    (its `auto_map`), as Kimi's tiktoken tokenizer."""
    import shutil

    shutil.copytree(verifier, out)
    (out / "tokenizer.json").rename(out / "labelled.json")
    (out / "tokenization_labelled.py").write_text(REPOSITORY_TOKENIZER)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="LabelledTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_labelled.LabelledTokenizer"]})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def tiny_kimi_k25(out: Path, num_layers: int = 4, hidden: int = 64) -> Path:
    """A Kimi-K2.5-style verifier: a DeepSeek-V3 decoder (MLA attention, routed and shared experts
    after one dense layer) nested beside a vision tower, saved with the original checkpoint's keys
    (`language_model.model.layers.N.mlp.experts.M.gate_proj.weight`, one tensor per expert)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25VisionConfig

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    n = len(tokenizer)
    text = DeepseekV3Config(
        vocab_size=n,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    vision = Kimi_K25VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=32,
        tie_word_embeddings=False,
        image_token_id=n - 1,
        video_token_id=n - 2,
        vision_start_token_id=n - 3,
        vision_end_token_id=n - 4,
    )
    Kimi_K25ForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights = out / "model.safetensors"  # transformers 5.19 saves the decoder's layers as `blocks`
    state = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in load_file(weights).items()}
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in state, sorted(state)[:8]
    save_file(state, weights, metadata={"format": "pt"})
    return out


def tiny_qwen3_vl_moe(out: Path, num_layers: int = 4, hidden: int = 64) -> Path:
    """A Qwen3-VL-MoE-style verifier: a nested MoE decoder with multimodal rotary positions, whose
    text config has no `*ForCausalLM` of its own in transformers."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    n = len(tokenizer)
    text = dict(
        vocab_size=n,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, deepstack_visual_indexes=[0])
    config = Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=n - 1,
        video_token_id=n - 2,
        vision_start_token_id=n - 3,
        vision_end_token_id=n - 4,
    )
    Qwen3VLMoeForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_qwen3_moe(out: Path, num_layers: int = 4, hidden: int = 256, ascii_only: bool = False) -> Path:
    """A Qwen3-MoE verifier: every decoder layer routes each token to 2 of 4 experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer(ascii_only=ascii_only)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# Kimi-K2.5's own quantization: INT4 routed experts; attention, shared experts, dense MLPs, head and vision tower as they were.
KIMI_INT4_WEIGHTS = r"\.experts\.\d+\.(gate|up|down)_proj\.weight$"
KIMI_INT4_IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:vision_tower.*",
    "re:mm_projector.*",
]


def compressed_checkpoint(
    source: Path, out: Path, quantize: str, ignore: list[str], scheme: str = "int4", nested: bool = False
) -> tuple[Path, Path]:
    """`source` as llm-compressor saves it quantized, in compressed-tensors' formats: `int4`
    ("pack-quantized", symmetric, one scale per 32 inputs) or `fp8` ("float-quantized" e4m3, one scale
    per output channel), on the weights whose keys match `quantize` (which must be the Linear layers
    `ignore`, in compressed-tensors' own patterns, leaves quantized). `nested` puts the
    `quantization_config` in `text_config`, where Kimi-K2.5's checkpoint has it. Returns the quantized
    directory and a plain copy of `source` holding the dequantized weights: what loading must compute."""
    import re
    import shutil

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    dense = out.with_name(out.name + "-dequantized")
    for target in (out, dense):
        shutil.copytree(source, target)
    state, quantized, dequantized = load_file(source / "model.safetensors"), {}, {}
    for key, weight in state.items():
        if not re.search(quantize, key):
            quantized[key] = dequantized[key] = weight
            continue
        module = key.removesuffix(".weight")
        if scheme == "int4":
            groups = weight.reshape(weight.shape[0], -1, 32)
            scale = groups.abs().amax(-1) / 7
            q = torch.round(groups / scale[..., None]).clamp(-8, 7).to(torch.int8)
            dequantized[key] = (q * scale[..., None]).reshape(weight.shape)
            quantized |= {
                f"{module}.weight_packed": pack_to_int32(q.reshape(weight.shape), 4),
                f"{module}.weight_scale": scale,
                f"{module}.weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
            }
        else:
            scale = weight.abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
            q = (weight / scale).to(torch.float8_e4m3fn)
            dequantized[key] = q.to(weight.dtype) * scale
            quantized |= {key: q, f"{module}.weight_scale": scale}
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, dense / "model.safetensors", metadata={"format": "pt"})
    weights, form = {
        "int4": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}, "pack-quantized"),
        "fp8": ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, "float-quantized"),
    }[scheme]
    quantization = {
        "quant_method": "compressed-tensors",
        "format": form,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ignore,
    }
    config = json.loads((out / "config.json").read_text())
    (config["text_config"] if nested else config)["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, dense
