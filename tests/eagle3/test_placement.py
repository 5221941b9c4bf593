"""Placement plans on meta-device models of real verifiers' configs (tests/fixtures/configs, no weights):
which layers go where for a given memory budget, and how a step uses its claimed devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.config import ConfigError, VerifierConfig
from eagle3.verifier.placement import (
    GIB,
    decoding_placement,
    device_map,
    gpus_needed,
    largest_unit,
    meta_model,
    offloaded,
    place_verifier,
    planned_device_map,
)

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
H100, H200 = 79.2, 139.8  # GiB, as torch reports the cards


def budget(gib: float, fraction: float = 0.9) -> int:
    return int(gib * GIB * fraction)


@pytest.fixture(scope="module")
def kimi():
    pytest.importorskip("transformers.models.kimi_k25", reason="this transformers has no Kimi-K2.5 model")
    return meta_model(CONFIGS / "kimi-k2.5", torch.bfloat16)


@pytest.fixture(scope="module")
def llama_70b():
    return meta_model(CONFIGS / "llama-3.1-70b-instruct", torch.bfloat16)


def _bytes_per_device(model, mapping) -> dict:
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    out: dict = {}
    for name, device in mapping.items():
        out[device] = out.get(device, 0) + sizes[name]
    return out


def test_llama_70b_splits_whole_layers_in_order_and_evenly_over_two_h100s(llama_70b):
    mapping = device_map(llama_70b, {0: budget(H100), 1: budget(H100)})

    layers = [mapping[f"model.layers.{i}"] for i in range(80)]
    assert layers == sorted(layers) and set(layers) == {0, 1}  # whole layers, the first ones on GPU 0
    assert 35 <= layers.count(0) <= 45  # balanced, as device_map="auto" balances
    assert (mapping["model.embed_tokens"], mapping["lm_head"]) == (0, 1)
    assert all(size <= budget(H100) for size in _bytes_per_device(llama_70b, mapping).values())


def test_llama_70b_needs_two_h100s_at_0_9_and_three_at_0_8(llama_70b):
    assert gpus_needed(llama_70b, budget(H100)) == 2
    assert gpus_needed(llama_70b, budget(H100, 0.8)) == 3


def test_llama_70b_does_not_fit_one_h200_at_0_9(llama_70b):
    assert gpus_needed(llama_70b, budget(H200)) == 2  # 131.4 GiB of weights, 125.8 GiB of budget


def test_kimi_k25_through_transformers_needs_21_h200s_since_its_int4_experts_load_as_bfloat16(kimi):
    assert gpus_needed(kimi, budget(H200)) == 21
    assert gpus_needed(kimi, budget(H100)) == 31


def test_kimi_k25_on_21_h200s_puts_each_decoder_layer_whole_on_one_gpu(kimi):
    mapping = device_map(kimi, dict.fromkeys(range(21), budget(H200)))

    assert not offloaded(mapping)
    layers = [mapping[f"model.language_model.layers.{i}"] for i in range(61)]
    assert layers == sorted(layers) and set(layers) == set(range(21))
    assert all(size <= budget(H200) for size in _bytes_per_device(kimi, mapping).values())


def test_kimi_k25_on_eight_h200s_leaves_layers_off_the_gpus(kimi):
    mapping = device_map(kimi, dict.fromkeys(range(8), budget(H200)))

    assert offloaded(mapping)  # accelerate would stream them from disk on every forward: refused by placement


def test_a_verifier_whose_layer_is_larger_than_a_gpu_fits_no_number_of_them(kimi):
    name, size = largest_unit(kimi)

    assert name == "model.language_model.layers.1" and 31 < size / GIB < 32  # an MoE layer: 384 experts in bfloat16
    assert gpus_needed(kimi, budget(32)) is None


def test_a_verifier_that_fits_one_gpu_runs_a_replica_on_each_claimed_gpu():
    cfg = VerifierConfig(gpu_memory_gib=H100)

    workers = place_verifier(CONFIGS / "llama-3.1-8b-instruct", ["2", "5"], cfg, torch.bfloat16)

    assert [(w.visible, w.device, w.max_memory) for w in workers] == [(["2"], "cuda", None), (["5"], "cuda", None)]


def test_a_verifier_larger_than_one_gpu_is_spread_over_every_claimed_gpu():
    cfg = VerifierConfig(gpu_memory_gib=H100)

    [worker] = place_verifier(CONFIGS / "llama-3.1-70b-instruct", ["2", "5"], cfg, torch.bfloat16)

    assert (worker.visible, worker.device) == (["2", "5"], "cuda")
    assert worker.max_memory == {0: budget(H100), 1: budget(H100)}  # indexed as the worker's process sees its GPUs


def test_a_verifier_larger_than_the_claimed_gpus_is_refused_before_loading(kimi):
    cfg = VerifierConfig(num_gpus=8, gpu_memory_gib=H200)

    with pytest.raises(ConfigError, match=r"does not fit 8 GPU\(s\) of 139\.8 GiB at verifier\.gpu_memory_fraction=0\.9: 21 are needed"):
        place_verifier(CONFIGS / "kimi-k2.5", [str(i) for i in range(8)], cfg, torch.bfloat16)


def test_a_decoding_step_on_one_gpu_refuses_a_verifier_too_large_for_it_before_loading():
    cfg = VerifierConfig(gpu_memory_gib=10)  # baselines and evaluation claim one GPU where num_gpus is 1: checked all the same

    with pytest.raises(ConfigError, match=r"does not fit 1 GPU\(s\) of 10\.0 GiB at verifier\.gpu_memory_fraction=0\.9: 2 are needed"):
        decoding_placement(CONFIGS / "llama-3.1-8b-instruct", ["0"], cfg, torch.bfloat16, "cuda")


def test_devices_named_cpu_are_cpu_worker_processes():
    workers = place_verifier(CONFIGS / "llama-3.1-70b-instruct", ["cpu", "cpu"], None, torch.bfloat16)

    assert [(w.visible, w.device) for w in workers] == [([], "cpu"), ([], "cpu")]


def test_a_planned_map_that_leaves_modules_off_the_devices_names_the_fix():
    with pytest.raises(ConfigError, match=r"do not fit the devices' budgets \(0: 1\.0 GiB\).*verifier\.num_gpus"):
        planned_device_map(CONFIGS / "llama-3.1-8b-instruct", torch.bfloat16, {0: GIB})
