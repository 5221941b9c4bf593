"""FP8 hidden-state shards (`extract.storage=fp8`): hs-connectors' format bit for bit, half the bytes,
read back through speculators' own `FP8Transfer`, and a draft that trains to bf16's validation figures.

Tolerance of the training comparison, on a tiny random verifier (4 layers, H 64), 24 records, one
epoch: validation loss within 0.2% and simulated acceptance length within 0.02 of bf16's. Measured
here: loss 0.057137 against 0.057154 (3e-4 apart), tau_sim equal; e4m3 keeps about 2.7% RMS error
per value, and speculators' PR 491 measured Qwen3-8B acceptance within 0.03. The same run read
through plain `FileTransfer` (FP8 codes unscaled) lands 4e-4 from bf16: the loss cannot tell, so
the test also checks what training read.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.config import DatasetConfig, ExtractConfig, TrainConfig, VerifierConfig, VocabConfig
from eagle3.data.prepare_dataset import prepare_dataset
from eagle3.extraction.extract_hidden_states import extract_hidden_states
from eagle3.extraction.shards import hidden_state_files, verify_shard
from eagle3.extraction.storage import SCALES_KEY, bytes_per_token, decode, encode
from eagle3.extraction.writer import OverlappedWriter
from eagle3.store.artifacts import ArtifactError, ArtifactStore
from eagle3.store.manifests import Provenance
from eagle3.training.train import train_draft
from eagle3.training.vocab_mapping import build_vocab_mapping
from eagle3.verifier.loading import load_tokenizer
from eagle3.verifier.resolve_verifier import resolve_verifier

pytestmark = pytest.mark.slow  # extraction of both precisions and two trainings

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def extracted(tiny_verifier, tmp_path_factory):
    """24 sample conversations extracted in both precisions into one store."""
    from conftest import SAMPLE

    store = ArtifactStore(tmp_path_factory.mktemp("fp8") / "store")
    verifier = resolve_verifier(VerifierConfig(path=str(tiny_verifier)), store)
    dataset = prepare_dataset(DatasetConfig(max_seq_len=256, max_records=24), SAMPLE, load_tokenizer(verifier.path), store, Provenance())
    states = {
        storage: extract_hidden_states(
            ExtractConfig(aux_layer_ids=AUX, records_per_shard=12, storage=storage),
            dataset,
            verifier,
            store,
            Provenance(config={"storage": storage}),
        )
        for storage in ("bf16", "fp8")
    }
    return store, verifier, dataset, states


def test_fp8_encoding_is_hs_connectors_quantization_bit_for_bit():
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    torch.manual_seed(0)
    states = torch.randn(37, 4, 96) * torch.logspace(-3, 3, 37)[:, None, None]  # [seq, slots, H], tokens of every magnitude
    states[5] = 0.0  # a token of zeros: the scale's floor

    ours = encode(states, "fp8")
    fp8, scale = quantize_tensor_to_fp8(states.to(torch.bfloat16))  # what the connector receives from vLLM

    assert torch.equal(ours["hidden_states"].view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(ours[SCALES_KEY], scale) and scale.shape == (37, 1, 1) and scale.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(decode(ours, dtype), dequantize_fp8_tensor(fp8, scale, dtype=dtype))


def test_fp8_shards_hold_half_the_bytes_in_the_connectors_fields(extracted):
    _, verifier, dataset, states = extracted
    sizes = {storage: sum(p.stat().st_size for p in hidden_state_files(m).values()) for storage, m in states.items()}

    path = hidden_state_files(states["fp8"])[0]
    with safe_open(path, "pt") as f:
        names = f.keys()  # a safetensors file is not iterable
        fields = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()[1:]) for name in names}

    assert fields == {"hidden_states": ("F8_E4M3", [4, 64]), SCALES_KEY: ("F32", [1, 1]), "token_ids": ("I64", [])}
    assert states["fp8"].storage == "fp8" and states["bf16"].storage == "bf16"
    assert {s["key"] for s in states["fp8"].shards}.isdisjoint(s["key"] for s in states["bf16"].shards)
    payload = {storage: dataset.num_tokens * (bytes_per_token(verifier.hidden_size, storage) + 8) for storage in sizes}  # + token ids
    for storage, size in sizes.items():  # the rest: one safetensors header a file
        assert payload[storage] < size < payload[storage] + 300 * dataset.num_records
    assert 0.5 < sizes["fp8"] / sizes["bf16"] < 0.55  # 2,316 vs 4,616 B a token at H 64 with headers


def test_fp8_files_read_through_fp8transfer_are_the_bf16_states_within_e4m3_error(extracted):
    from hs_connectors import FileTransfer, FP8Transfer

    _, _, _, states = extracted
    bf16_file, fp8_file = hidden_state_files(states["bf16"])[3], hidden_state_files(states["fp8"])[3]  # hs_3 of the first shard
    reference = load_file(bf16_file)["hidden_states"].float()

    read = FP8Transfer(fp8_file.parent, dequantize_dtype=torch.float32).get_cached(3)
    plain = FileTransfer(fp8_file.parent).get_cached(3)

    assert set(read) == {"hidden_states", "token_ids"} and read["hidden_states"].dtype == torch.float32
    assert (read["hidden_states"] - reference).norm() / reference.norm() < 0.04  # e4m3: ~2.7% RMS a value
    # What FileTransfer would hand to training, silently: the codes, unscaled. Hence FP8Transfer everywhere.
    assert plain["hidden_states"].dtype == torch.float8_e4m3fn
    assert (plain["hidden_states"].float() - reference).norm() / reference.norm() > 1


def test_verify_shard_names_the_field_a_bf16_file_lacks_in_an_fp8_shard(extracted, tmp_path):
    _, verifier, _, states = extracted
    data = load_file(hidden_state_files(states["bf16"])[0])
    save_file(data, tmp_path / "hs_0.safetensors")

    with pytest.raises(
        ArtifactError, match=r"hs_0\.safetensors: fields \['hidden_states', 'hidden_states_scales', 'token_ids'\] expected \(fp8"
    ):
        verify_shard(tmp_path, [data["token_ids"].tolist()], 4, verifier.hidden_size, "fp8")


def test_verify_shard_names_a_scale_of_the_wrong_shape(extracted, tmp_path):
    _, verifier, _, states = extracted
    data = load_file(hidden_state_files(states["fp8"])[0])
    save_file({**data, SCALES_KEY: data[SCALES_KEY][:, 0]}, tmp_path / "hs_0.safetensors")

    with pytest.raises(ArtifactError, match=r"field 'hidden_states_scales': F32 \(\d+, 1\), expected F32 \(\d+, 1, 1\)"):
        verify_shard(tmp_path, [data["token_ids"].tolist()], 4, verifier.hidden_size, "fp8")


def test_non_finite_states_are_refused_before_they_are_quantized(tmp_path):
    states = torch.zeros(1, 5, 4, 8)  # [batch, seq, slots, H]
    states[0, 2, 3, 1] = float("inf")  # quantized, the token's scale would be inf and its values NaN or 0
    writer = OverlappedWriter(torch.device("cpu"), "fp8")

    writer.submit(states, [(tmp_path / "hs_0.safetensors", torch.arange(5))])

    with pytest.raises(ArtifactError, match=r"hs_0\.safetensors: field 'hidden_states': non-finite values per layer slot \[0, 0, 0, 1\]"):
        writer.drain()
    writer.close()


def test_fp8_shards_train_to_the_validation_figures_of_bf16(extracted, monkeypatch):
    import speculators.train.dataloader as dataloader

    store, verifier, dataset, states = extracted
    vocab = build_vocab_mapping(VocabConfig(draft_vocab_size=512), dataset, verifier.vocab_size, store, Provenance())
    cfg = TrainConfig(epochs=1, total_seq_len=512)
    first_sample, build_loaders = {}, dataloader.create_train_val_loaders

    def loaders_recording_the_first_sample(**kwargs):  # what training reads, seen through its own transfer
        first_sample[len(first_sample)] = kwargs["transfer"].get_cached(0)
        return build_loaders(**kwargs)

    monkeypatch.setattr(dataloader, "create_train_val_loaders", loaders_recording_the_first_sample)

    drafts = {
        storage: train_draft(cfg, dataset, hidden, vocab, verifier, store, Provenance(config={"storage": storage}))
        for storage, hidden in states.items()
    }

    bf16, fp8 = drafts["bf16"].epochs[-1], drafts["fp8"].epochs[-1]
    assert drafts["fp8"].digest != drafts["bf16"].digest  # the states differ: so do the weights
    assert fp8["val_loss"] == pytest.approx(bf16["val_loss"], rel=2e-3)  # measured 3e-4 apart
    assert fp8["tau_sim"] == pytest.approx(bf16["tau_sim"], abs=0.02)
    # Loss alone cannot tell unscaled FP8 codes from states (the draft's first ops are per-token norms):
    # training must have read the states, dequantized to its dtype.
    read_bf16, read_fp8 = first_sample[0]["hidden_states"], first_sample[1]["hidden_states"]
    assert read_fp8.dtype == torch.float32
    assert (read_fp8 - read_bf16.float()).norm() / read_bf16.float().norm() < 0.04


def test_the_room_a_dataset_s_states_need_is_checked_with_its_margin_and_floor():
    from eagle3.extraction.storage import MIN_FREE_BYTES, room_problem

    tokens, hidden = 1_000_000, 4096  # bf16: 4 x 4096 x 2 = 32,768 B a token, 32.8 GB
    need = tokens * 4 * hidden * 2
    enough = int(need * 1.05) + MIN_FREE_BYTES

    assert room_problem(tokens, hidden, "bf16", enough) is None
    short = room_problem(tokens, hidden, "bf16", enough - 1)
    assert short is not None and short.startswith("1,000,000 tokens of hidden states take 32.77 GB at 32,768 B a token")
    assert "extract.storage=fp8 stores them in 16.39 GB" in short and "train.hidden_states=online" in short
    fp8_enough = int(tokens * (4 * hidden + 4) * 1.05) + MIN_FREE_BYTES  # 1 B values and a 4 B scale a token
    assert room_problem(tokens, hidden, "fp8", fp8_enough) is None and room_problem(tokens, hidden, "fp8", fp8_enough - 1) is not None
