from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import MistralConfig, Qwen2Config, Qwen3NextConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import eagle3.verifier.forward as forward_module
from eagle3.evaluation.forward_choice import decodes_like_dynamic, forward_for
from eagle3.evaluation.speculative import NgramProposer, greedy_decode, speculative_decode
from eagle3.verifier.capture import HiddenStateCapture
from eagle3.verifier.forward import DynamicForward, StaticForward, decode_attention, full_attention_only, grouped_attention
from eagle3.verifier.loading import load_text_model

AUX = [1, 2, 3]
PROMPT = [1, 200, 300, 400, 500, 600, 700, 200, 300]


@pytest.fixture(scope="module")
def model(tiny_verifier):
    return load_text_model(tiny_verifier, torch.float32, "cpu")


def _generate(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda m: StaticForward(m, None, 64), lambda m: DynamicForward(m, None)], ids=["static", "dynamic"])
def test_greedy_decoding_equals_transformers_generate_and_n_gram_drafting_changes_nothing(model, make):
    forward = make(model)
    expected = _generate(model, PROMPT, 40)

    assert greedy_decode(forward, PROMPT, 40, set()).tokens == expected
    for k in (1, 3, 5):
        assert speculative_decode(forward, NgramProposer(), PROMPT, 40, k, set()).tokens == expected


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_each_pass_after_a_rollback_returns_what_one_full_forward_of_the_kept_tokens_gives(model, kind):
    capture = HiddenStateCapture(model.get_decoder(), AUX)
    forward = StaticForward(model, capture, 32) if kind == "static" else DynamicForward(model, capture)
    forward([5, 6, 7, 8])  # a longer sequence first: its buffers' entries must not leak into the next one
    forward([9, 10, 11])
    forward.reset()

    argmax_prompt, _ = forward(PROMPT)
    forward([41, 42, 43])
    forward.rollback(2)  # keep 41, drop 42 and 43
    forward.rollback(0)
    argmax, aux = forward([44, 45])

    sequence = [*PROMPT, 41, 44, 45]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([sequence]), use_cache=False)
        full_aux = capture.stacked()[0, :, :-1]
    capture.close()
    assert argmax_prompt.tolist() == full.logits[0, : len(PROMPT)].argmax(-1).tolist()
    assert argmax.tolist() == full.logits[0, -2:].argmax(-1).tolist()
    torch.testing.assert_close(aux, full_aux[-2:], atol=1e-5, rtol=1e-5)


def test_entries_a_rollback_forgets_cannot_reach_later_passes_even_as_nan(model):
    forward = StaticForward(model, None, 32)
    forward(PROMPT)
    forward([41, 42, 43])
    buffers = (*forward.cache.keys.values(), *forward.cache.values.values())
    for buffer in buffers:
        buffer[:, :, len(PROMPT) + 1 : len(PROMPT) + 3] = float("nan")  # what an overflow in the two drafts rejected would leave

    forward.rollback(2)
    argmax, _ = forward([44])  # writes over the first forgotten entry; the second must read as zeros

    assert not any(buffer[:, :, len(PROMPT) + 2 :].any() for buffer in buffers)  # every position past the sequence is zero
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([[*PROMPT, 41, 44]]), use_cache=False)
    assert argmax.tolist() == full.logits[0, -1:].argmax(-1).tolist()


def test_a_pass_zeroes_only_the_forgotten_entries_it_will_not_overwrite(model, monkeypatch):
    forward = StaticForward(model, None, 32)
    forward(PROMPT)
    forward([41, 42, 43])
    zeroed = []
    monkeypatch.setattr(forward.cache, "clear_at", lambda positions: zeroed.append(positions.tolist()))

    forward.rollback(2)
    forward([44, 45, 46])  # as speculative decoding's next round: over both forgotten entries
    assert zeroed == []
    forward.rollback(3)
    forward([47])
    assert zeroed == [[len(PROMPT) + 2, len(PROMPT) + 3]]


def test_a_sequence_that_outgrows_the_buffers_is_refused(model):
    forward = StaticForward(model, None, 10)
    forward(PROMPT)

    with pytest.raises(ValueError, match="11 tokens outgrows the KV buffers of 10 positions"):
        forward([1, 2])


def test_fixed_buffers_decode_a_full_attention_verifier_as_its_dynamic_cache_does(model, monkeypatch):
    forward = StaticForward(model, None, 64)
    zeroed, grouped = [], []
    clear_at, attend = forward.cache.clear_at, forward_module.attend_grouped
    monkeypatch.setattr(forward.cache, "clear_at", lambda positions: zeroed.append(len(positions)) or clear_at(positions))
    monkeypatch.setattr(forward_module, "attend_grouped", lambda *args: grouped.append(args[0].shape[2]) or attend(*args))

    assert decodes_like_dynamic(forward, PROMPT)
    assert zeroed, "the probe decodes a pass that zeroes forgotten entries (a graph of its own on a GPU)"
    assert grouped and min(grouped) > 1, "passes of several tokens attend grouped; the probe's one-token passes do not"


def test_a_pass_that_fails_leaves_what_it_wrote_to_be_zeroed(model, monkeypatch):
    forward = StaticForward(model, None, 32)
    forward(PROMPT)
    forward([41, 42, 43])
    forward.rollback(3)
    honest = StaticForward._pass

    def writes_nan_then_fails(self, ids, positions, decode):
        for buffer in (*self.cache.keys.values(), *self.cache.values.values()):
            buffer[:, :, positions] = float("nan")
        raise RuntimeError("out of memory halfway")

    monkeypatch.setattr(StaticForward, "_pass", writes_nan_then_fails)
    with pytest.raises(RuntimeError, match="halfway"):
        forward([44, 45, 46, 47])
    monkeypatch.setattr(StaticForward, "_pass", honest)
    argmax, _ = forward([44])

    with torch.inference_mode():
        full = model(input_ids=torch.tensor([[*PROMPT, 44]]), use_cache=False)
    assert argmax.tolist() == full.logits[0, -1:].argmax(-1).tolist()


def test_fixed_buffers_that_misplace_positions_are_found_out(model, monkeypatch, caplog):
    def one_position_late(self, ids, positions, decode):  # a fault injected where an architecture could misread our positions
        return honest(self, ids, positions + 1, decode)

    honest = StaticForward._pass
    monkeypatch.setattr(StaticForward, "_pass", one_position_late)

    assert not decodes_like_dynamic(StaticForward(model, None, 64), PROMPT)
    assert "failed" not in caplog.text  # it decoded, differently


def test_fixed_buffers_that_fail_to_decode_are_refused_with_the_reason_logged(model, caplog):
    assert not decodes_like_dynamic(StaticForward(model, None, len(PROMPT) + 4), PROMPT)
    assert "decoding on fixed KV buffers failed on the first prompt" in caplog.text and "outgrows the KV buffers" in caplog.text


def test_on_a_cpu_every_verifier_decodes_on_transformers_own_cache(model):
    assert isinstance(forward_for(model, None, 64, PROMPT), DynamicForward)


def test_windowed_and_linear_attention_layers_are_told_from_full_attention(model):
    assert full_attention_only(model.config)
    assert full_attention_only(Qwen2Config(use_sliding_window=False))
    assert not full_attention_only(Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=0))
    assert not full_attention_only(MistralConfig(sliding_window=4))
    assert not full_attention_only(Qwen3NextConfig(num_hidden_layers=4))  # linear attention in three layers of four


GQA = SimpleNamespace(num_key_value_groups=3, is_causal=True)  # what transformers' sdpa attention reads of a layer


def _attention_inputs(q: int, dtype=torch.float32, value_dim: int = 16):
    torch.manual_seed(0)
    query, key = torch.randn(1, 6, q, 16, dtype=dtype), torch.randn(1, 2, 20, 16, dtype=dtype)
    value = torch.randn(1, 2, 20, value_dim, dtype=dtype)
    mask = torch.zeros(1, 1, q, 20, dtype=dtype)
    mask[..., 12:] = torch.finfo(dtype).min  # the buffer past the sequence
    return query, key, value, mask


@pytest.mark.parametrize("value_dim", [16, 8], ids=["llama", "mla"])  # MLA's value heads are narrower than its keys
def test_grouped_attention_computes_transformers_sdpa_attention(value_dim):
    query, key, value, mask = _attention_inputs(4, value_dim=value_dim)

    ours, _ = grouped_attention(GQA, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(GQA, query, key, value, mask, scaling=0.3)

    assert ours.shape == theirs.shape == (1, 4, 6, value_dim)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["one query", "bfloat16", "no mask", "boolean mask", "position bias"])
def test_grouped_attention_hands_what_it_does_not_run_to_transformers(case):
    query, key, value, mask = _attention_inputs(1 if case == "one query" else 4, torch.bfloat16 if case == "bfloat16" else torch.float32)
    mask = {"no mask": None, "boolean mask": mask == 0}.get(case, mask)
    extra = {"position_bias": torch.randn(1, 6, 4, 20)} if case == "position bias" else {}

    ours, _ = grouped_attention(GQA, query, key, value, mask, scaling=0.3, **extra)
    theirs, _ = sdpa_attention_forward(GQA, query, key, value, mask, scaling=0.3, **extra)

    assert torch.equal(ours, theirs)


def test_decode_attention_swaps_sdpa_for_the_pass_and_restores_it_on_error(model):
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pytest.raises(RuntimeError, match="inside the pass"), decode_attention(model.config):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is grouped_attention and model.config._attn_implementation == "sdpa"
        raise RuntimeError("inside the pass")

    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping  # none left behind
    with decode_attention(SimpleNamespace(_attn_implementation="eager")):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before  # another implementation: nothing swapped
