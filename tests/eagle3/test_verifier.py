from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import KIMI_INT4_IGNORE, KIMI_INT4_WEIGHTS, compressed_checkpoint, tiny_llama, with_repository_tokenizer

from eagle3.config import VerifierConfig
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.verifier.loading import load_text_model, load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier, verifier_tokenizer


def test_missing_tokenizer_names_the_directory(tiny_verifier, tmp_path):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_verifier, broken)
    (broken / "tokenizer.json").unlink()

    with pytest.raises(ArtifactError, match=r"no-tokenizer: missing tokenizer"):
        resolve_verifier(VerifierConfig(path=str(broken)), ArtifactStore(tmp_path / "s"))


def test_a_tokenizer_without_chat_template_is_refused_naming_the_directory(tmp_path):
    base = tiny_llama(tmp_path / "base-model", template=None)

    with pytest.raises(ArtifactError, match=r"base-model: the tokenizer has no chat template"):
        resolve_verifier(VerifierConfig(path=str(base)), ArtifactStore(tmp_path / "s"))


def test_a_config_transformers_cannot_read_is_named(tiny_verifier, tmp_path):
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_verifier, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))

    with pytest.raises(ArtifactError, match=r"unknown/config\.json: transformers \S+ cannot read it: .*model type `frobnicator`"):
        resolve_verifier(VerifierConfig(path=str(unknown)), ArtifactStore(tmp_path / "s"))


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ArtifactError, match=r"nowhere: verifier.path does not exist"):
        resolve_verifier(VerifierConfig(path=str(tmp_path / "nowhere")), ArtifactStore(tmp_path / "s"))


def test_hf_directory_is_used_in_place_and_described(tiny_verifier, tmp_path):
    manifest = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), ArtifactStore(tmp_path / "s"))

    assert manifest.path == tiny_verifier
    assert (manifest.num_hidden_layers, manifest.hidden_size, manifest.vocab_size, manifest.nested) == (4, 64, 1024, False)


def test_a_nested_moe_checkpoint_loads_its_per_expert_tensors_into_the_decoders_fused_experts(tiny_kimi_verifier, tmp_path):
    """Kimi-K2.5's checkpoint keeps one tensor per expert under `language_model.model.*`, where
    transformers' DeepSeek-V3 decoder holds them fused: [experts, gate rows + up rows, H]."""
    manifest = resolve_verifier(VerifierConfig(path=str(tiny_kimi_verifier)), ArtifactStore(tmp_path / "s"))
    checkpoint = load_file(tiny_kimi_verifier / "model.safetensors")

    decoder = load_text_model(manifest.path, torch.float32, "cpu").get_decoder()

    assert (manifest.nested, manifest.num_hidden_layers, manifest.hidden_size) == (True, 4, 64)
    experts = decoder.layers[2].mlp.experts
    for e in range(4):
        prefix = f"language_model.model.layers.2.mlp.experts.{e}"
        gate_up = torch.cat([checkpoint[f"{prefix}.gate_proj.weight"], checkpoint[f"{prefix}.up_proj.weight"]])
        torch.testing.assert_close(experts.gate_up_proj[e], gate_up, rtol=0, atol=0)
        torch.testing.assert_close(experts.down_proj[e], checkpoint[f"{prefix}.down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        decoder.layers[0].mlp.up_proj.weight, checkpoint["language_model.model.layers.0.mlp.up_proj.weight"], rtol=0, atol=0
    )


KIMI_EXPERTS_AND_HEAD = rf"{KIMI_INT4_WEIGHTS}|lm_head\.weight$", [p for p in KIMI_INT4_IGNORE if "lm_head" not in p]


@pytest.mark.parametrize(
    "source, scheme, quantize, ignore",
    [
        ("tiny_verifier", "int4", r"_proj\.weight$", ["lm_head"]),
        ("tiny_verifier", "fp8", r"_proj\.weight$", ["lm_head"]),
        ("tiny_kimi_verifier", "int4", KIMI_INT4_WEIGHTS, KIMI_INT4_IGNORE),
        ("tiny_kimi_verifier", "int4", *KIMI_EXPERTS_AND_HEAD),
    ],
    ids=["llama-int4", "llama-fp8", "kimi-int4-experts", "kimi-int4-experts-and-head"],
)
def test_a_compressed_tensors_checkpoint_computes_with_its_dequantized_weights(source, scheme, quantize, ignore, request, tmp_path):
    """llm-compressor's INT4 and FP8 formats on every Linear of a Llama, and INT4 on a Kimi-K2.5's
    routed experts (and head) with the config nested as Kimi's is (its vision tower, never run on
    text, left unquantized)."""
    nested = source == "tiny_kimi_verifier"
    source = request.getfixturevalue(source)
    quantized, dequantized = compressed_checkpoint(source, tmp_path / scheme, quantize, ignore, scheme, nested)
    ids = torch.tensor([[5, 9, 33, 7, 2, 3]])

    def run(path, dtype):  # the decoder alone, as extraction runs it, then the head
        model = load_text_model(path, dtype, "cpu")
        hidden = model.get_decoder()(ids).last_hidden_state
        return model, hidden, model.get_output_embeddings()(hidden)

    with torch.no_grad():
        (_, *got), (_, *want), (_, *unquantized) = (run(path, torch.float32) for path in (quantized, dequantized, source))
    model, plain = (load_text_model(path, torch.bfloat16, "cpu") for path in (quantized, dequantized))

    torch.testing.assert_close(got, want)
    assert (got[0] - unquantized[0]).abs().max() > 1e-3  # the quantized weights, not the source's
    # in bf16, each tensor a plain checkpoint has in the dtype it has there (rotary frequencies stay float32)
    tensors = dict(plain.named_parameters()) | dict(plain.named_buffers())
    assert {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if n in tensors} == {
        n: t.dtype for n, t in tensors.items()
    }


def test_a_verifier_whose_head_is_quantized_is_refused_naming_the_tensor(tiny_verifier, tmp_path):
    quantized, _ = compressed_checkpoint(tiny_verifier, tmp_path / "int4", r"(_proj|lm_head)\.weight$", [])

    with pytest.raises(ArtifactError, match=r"int4/model\.safetensors: tensor 'lm_head\.weight_packed': .* head are quantized"):
        resolve_verifier(VerifierConfig(path=str(quantized)), ArtifactStore(tmp_path / "s"))


def test_a_quantization_whose_package_is_missing_is_named(tiny_verifier, tmp_path):
    if importlib.util.find_spec("bitsandbytes"):
        pytest.skip("bitsandbytes is installed here")
    verifier = tmp_path / "bnb"
    shutil.copytree(tiny_verifier, verifier)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(
        json.dumps(config | {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    )

    with pytest.raises(ArtifactError, match=r"bnb/config\.json: field 'quantization_config' \(bitsandbytes\): .*requires bitsandbytes"):
        load_text_model(verifier, torch.float32, "cpu")


def test_a_nested_checkpoint_missing_decoder_weights_is_refused_naming_them(tiny_kimi_verifier, tmp_path):
    broken = tmp_path / "no-layer-2"
    shutil.copytree(tiny_kimi_verifier, broken)
    weights = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.2." not in k}, broken / "model.safetensors")

    with pytest.raises(ArtifactError, match=r"no-layer-2: weights \['model\.language_model\.layers\.2\..*not in the checkpoint"):
        load_text_model(broken, torch.float32, "cpu")


def test_a_tiktoken_tokenizer_without_tokenizer_json_is_refused_naming_why(tiny_kimi_verifier, tmp_path):
    """Kimi ships `tiktoken.model`; transformers would read it with cl100k's splitting rule, not Kimi's."""
    kimi = tmp_path / "kimi"
    shutil.copytree(tiny_kimi_verifier, kimi)
    (kimi / "tokenizer.json").unlink()
    (kimi / "tiktoken.model").write_bytes(b"YQ== 0\n")

    with pytest.raises(ArtifactError, match=r"kimi/tiktoken\.model: a tiktoken tokenizer .* Set verifier\.trust_remote_code=true"):
        resolve_verifier(VerifierConfig(path=str(kimi)), ArtifactStore(tmp_path / "s"))


def test_a_nested_checkpoint_without_its_vision_tower_loads_its_decoder(tiny_nested_verifier, tmp_path):
    """Text-only copies of multimodal models may keep the nested config and drop the vision weights."""
    text_only = tmp_path / "text-only"
    shutil.copytree(tiny_nested_verifier, text_only)
    weights = load_file(text_only / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "vision" not in k and "projector" not in k}, text_only / "model.safetensors")
    [key] = [k for k in weights if k.endswith("layers.1.mlp.up_proj.weight")]

    decoder = load_text_model(text_only, torch.float32, "cpu").get_decoder()

    torch.testing.assert_close(decoder.layers[1].mlp.up_proj.weight, weights[key], rtol=0, atol=0)


@pytest.fixture
def repository_tokenizer_verifier(tiny_verifier, tmp_path) -> Path:
    return with_repository_tokenizer(tiny_verifier, tmp_path / "own-tokenizer")


def test_a_tokenizer_only_its_repository_code_loads_is_refused_naming_the_flag(repository_tokenizer_verifier, tmp_path):
    with pytest.raises(ArtifactError, match=r"own-tokenizer: missing tokenizer: .* set verifier\.trust_remote_code=true"):
        resolve_verifier(VerifierConfig(path=str(repository_tokenizer_verifier)), ArtifactStore(tmp_path / "s"))


def test_trust_remote_code_loads_the_repository_tokenizer_under_a_verifier_digest_of_its_own(
    repository_tokenizer_verifier, tiny_verifier, tmp_path
):
    store = ArtifactStore(tmp_path / "s")

    manifest = resolve_verifier(VerifierConfig(path=str(repository_tokenizer_verifier), trust_remote_code=True), store)
    tokenizer = verifier_tokenizer(manifest)

    assert manifest.trust_remote_code and type(tokenizer).__name__ == "LabelledTokenizer"
    assert tokenizer("Count to five.").input_ids == load_tokenizer(tiny_verifier)("Count to five.").input_ids
    assert manifest.digest != store.input_digest(repository_tokenizer_verifier)  # datasets and shards keyed apart
