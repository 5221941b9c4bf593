"""A random-weight Llama verifier for the benchmarks: Llama-3.1-8B's shape by default, any shape for a
CPU smoke run, saved in bf16 as a real checkpoint is. Random weights measure throughput, not quality."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.verifier.resolve_verifier import VerifierManifest

VOCAB = 128256  # Llama-3's: the benchmarks' random token ids come from below 128000


def save_random_llama(
    root: Path,
    layers: int,
    device: str = "cpu",
    hidden: int = 4096,
    intermediate: int = 14336,
    heads: int = 32,
    kv_heads: int = 8,
    max_positions: int = 8192,
) -> tuple[VerifierManifest, int, int]:
    """Save the verifier under `root` (built on `device`, seeded); returns its manifest, its parameter
    count and the count of its decoder's matmul weights (what a token's FLOPs are counted from)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=max(8192, max_positions),
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root)
    params = sum(p.numel() for p in model.parameters())
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("model.embed_tokens.", "lm_head.")))
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return VerifierManifest(path=root, num_hidden_layers=layers, hidden_size=hidden, vocab_size=VOCAB, nested=False), params, matmul_params
