from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eagle3.verifier.grouped_decode import NAME, grouped_decode_attention, use_grouped_decode
from eagle3.verifier.loading import load_text_model


class Heads(torch.nn.Module):
    """What transformers' sdpa reads of an attention module: its KV groups."""

    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("biased", [False, True])  # a relative position bias: only transformers' sdpa adds it
def test_a_decode_step_attends_as_sdpa_with_its_kv_heads_repeated(padded, biased):
    torch.manual_seed(0)
    query, key, value = torch.randn(4, 9, 1, 16), torch.randn(4, 3, 20, 16), torch.randn(4, 3, 20, 16)
    mask = torch.ones(4, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., :7] = mask[2, ..., :1] = False  # left padding
    mask = mask if padded else None
    bias = {"position_bias": torch.randn(1, 9, 1, 20)} if biased else {}

    grouped, _ = grouped_decode_attention(Heads(), query, key, value, mask, scaling=0.25, **bias)
    repeated, _ = sdpa_attention_forward(Heads(), query, key, value, mask, scaling=0.25, **bias)

    assert grouped.shape == repeated.shape == (4, 1, 9, 16)
    torch.testing.assert_close(grouped, repeated, rtol=1e-5, atol=1e-6)


def test_batched_generate_with_left_padding_writes_the_tokens_sdpa_writes(tmp_path):
    model = load_text_model(tiny_llama(tmp_path / "gqa"), torch.float32, "cpu")
    prompts = [[5, 9, 11, 3, 8, 21], [7, 2], [30, 31, 32, 33]]
    ids = torch.zeros(len(prompts), 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, 6 - len(p) :], mask[row, 6 - len(p) :] = torch.tensor(p), 1

    def generate():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0).tolist()

    expected = generate()
    assert use_grouped_decode(model)
    assert model.config._attn_implementation == NAME
    assert generate() == expected


def test_a_model_without_grouped_kv_heads_keeps_sdpa(tmp_path):
    path = tiny_llama(tmp_path / "gqa")
    model = load_text_model(path, torch.float32, "cpu")
    model.config.num_key_value_heads = model.config.num_attention_heads
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, attn_implementation="sdpa"))  # no KV-head count

    assert not use_grouped_decode(model) and not use_grouped_decode(gpt2)
    assert model.config._attn_implementation == gpt2.config._attn_implementation == "sdpa"
