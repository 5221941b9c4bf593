"""Batched decoding's attention without copying a KV head per query head.

With a padding mask (batched regeneration's left padding always has one), transformers' sdpa path
gives every query head its own copy of its KV head (`repeat_kv`) before the kernel: for SmolLM2's 9
query heads over 3 KV heads that writes, then reads, three times the whole KV cache at every decode
step. A decode step's query is one token, so each KV head's group of query heads can pass as that
head's rows of queries instead: the same products, each KV head read once. Prompt passes (more than
one query token) and models without grouped heads go to transformers' own sdpa.

`use_grouped_decode(model)` switches a loaded sdpa model to it; the masks stay sdpa's. Regeneration
decodes with it (`eagle3.data.regenerate`). Evaluation's batch-1 passes over fixed KV buffers group
the heads their own way, in matrix products (`eagle3.verifier.forward.grouped_attention`); this one
hands a whole batch's step to the fused sdpa kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = ["NAME", "grouped_decode_attention", "use_grouped_decode"]

NAME = "grouped_decode_sdpa"


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (batch, heads, 1, dim) against key and value (batch,
    kv heads, length, dim); returns (batch, 1, heads, dim). Query head h belongs to KV head
    h // (heads / kv heads), as in `repeat_kv`. What only transformers' sdpa handles (a position
    bias, a paged cache, dropout) goes to it."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or kv_heads == heads or dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_grouped_decode(model: PreTrainedModel) -> bool:
    """Switch `model` from sdpa to `grouped_decode_attention` where it has grouped KV heads; whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config.get_text_config()
    kv_heads = getattr(config, "num_key_value_heads", None)  # GPT-2, OPT and the like have none: every head its own
    if config._attn_implementation != "sdpa" or kv_heads in (None, config.num_attention_heads):
        return False
    AttentionInterface.register(NAME, grouped_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
