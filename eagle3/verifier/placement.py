"""Where the verifier's weights go on the devices a step claims, planned before any weight is read.

The plan is made on the verifier's meta-device model (its module tree, sizes, no weights: Kimi-K2.5
builds in ~0.6 s) with accelerate's planner, as `from_pretrained(device_map="auto")` would make it:
`get_balanced_memory` then `infer_auto_device_map`, whole decoder layers per device. Sizes are every
parameter and buffer in the compute dtype, as transformers holds the model once loaded:
compressed-tensors MoE experts are dequantized at load whatever the checkpoint stores (Kimi-K2.5's
INT4 experts take 2.05 TB in bf16), so a size on disk would understate them.

A step's claimed devices are used one of two ways (`place_verifier`):
- the verifier fits one GPU at `verifier.gpu_memory_fraction` of its memory: a whole replica per GPU,
  one child process each (regeneration and extraction split their records or shards among them);
- it does not: one child process sees every claimed GPU and the layers are spread over all of them by
  the planned map, passed to `from_pretrained` as an explicit map. The GPUs then run one after the
  other, as a pipeline.
The steps that decode in their own process (baselines, evaluation) claim one GPU where the verifier
fits one, else all of them, its layers spread (`gpus_to_decode`, `decoding_placement`).
A map that leaves any module on "cpu" or "disk" does not fit: accelerate would stream those weights
into the first GPU on every forward, hopeless at this scale, so such a placement is refused (only a
caller that gives "cpu" a budget, as the GPU tests do to split one GPU's model, gets one).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from eagle3.config import ConfigError, VerifierConfig
from eagle3.runtime.devices import gpu_memory_bytes, host_gpu_ids, in_process_device
from eagle3.verifier.loading import load_text_model, read_config, text_model_class

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch
    from transformers import PreTrainedModel

__all__ = [
    "GIB",
    "Worker",
    "decoding_placement",
    "device_map",
    "gpus_needed",
    "gpus_to_decode",
    "largest_unit",
    "load_placed",
    "meta_model",
    "model_bytes",
    "offloaded",
    "place_verifier",
    "planned_device_map",
]

GIB = 2**30
logger = logging.getLogger(__name__)


def meta_model(path_or_config, dtype: torch.dtype) -> PreTrainedModel:
    """The verifier's module tree on the meta device, in `dtype` (of its directory, or of its config
    as transformers reads it): what loading it would hold, no weights read."""
    import torch

    config = read_config(path_or_config) if isinstance(path_or_config, Path) else path_or_config
    with torch.device("meta"):
        return text_model_class(config).from_config(config, dtype=dtype)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer."""
    from accelerate.utils import compute_module_sizes

    return compute_module_sizes(model)[""]


def _no_split(model: torch.nn.Module) -> set[str]:
    return set(getattr(model, "_no_split_modules", None) or ())


def largest_unit(model: torch.nn.Module) -> tuple[str, int]:
    """The largest piece a device map cannot split (a decoder layer, or one parameter such as the
    embedding): no device smaller than it can hold the model, whatever their number."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    no_split = _no_split(model)
    units = [(name, sizes[name]) for name, module in model.named_modules() if type(module).__name__ in no_split]
    units += [(name, p.numel() * p.element_size()) for name, p in model.named_parameters()]
    return max(units, key=lambda unit: unit[1])


def device_map(model: PreTrainedModel, max_memory: dict[int | str, int]) -> dict[str, int | str]:
    """accelerate's balanced map of `model` over the devices of `max_memory` (device -> bytes its
    weights may take; "cpu" and "disk" get nothing unless named): module name -> device. What fits
    nowhere maps to "disk"."""
    from accelerate import infer_auto_device_map
    from transformers.integrations.accelerate import get_balanced_memory

    budgets: dict[int | str, int | str] = {"cpu": 0, "disk": 0, **max_memory}
    quiet = logging.getLogger("accelerate.utils.modeling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Device 0 is not available": planning for GPUs this host lacks is the point
    try:
        balanced = get_balanced_memory(model, max_memory=budgets, no_split_module_classes=_no_split(model))
        return infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=sorted(_no_split(model)))
    finally:
        quiet.setLevel(level)


def offloaded(mapping: dict[str, int | str], allowed: tuple[str, ...] = ()) -> list[str]:
    """Modules `mapping` leaves off the GPUs (on "cpu" or "disk"), but for the devices `allowed`."""
    return [name for name, device in mapping.items() if device in ("cpu", "disk") and device not in allowed]


def gpus_needed(model: PreTrainedModel, budget: int) -> int | None:
    """The fewest GPUs of `budget` bytes each whose planned map holds `model` whole (None: none
    does, a layer is larger than one GPU's budget)."""
    if largest_unit(model)[1] > budget:
        return None
    count = max(1, math.ceil(model_bytes(model) / budget))
    while offloaded(device_map(model, dict.fromkeys(range(count), budget))):
        count += 1  # balancing leaves room for the largest layer: the closed-form lower bound can be one short
    return count


def planned_device_map(path: Path, dtype: torch.dtype, max_memory: dict[int | str, int]) -> dict[str, int | str]:
    """The verifier's map over the devices of `max_memory`, for `load_text_model`.

    Raises:
        ConfigError: a module would be left off the given devices.
    """
    model = meta_model(path, dtype)
    mapping = device_map(model, max_memory)
    if left := offloaded(mapping, allowed=tuple(d for d in ("cpu", "disk") if max_memory.get(d))):
        budgets = ", ".join(f"{device}: {size / GIB:.1f} GiB" for device, size in max_memory.items())
        raise ConfigError(
            f"verifier '{path}': {len(left)} module(s) ({left[0]}, ...) do not fit the devices' budgets ({budgets}): claim "
            "more GPUs (verifier.num_gpus) or raise verifier.gpu_memory_fraction; `eagle3 plan` shows what fits."
        )
    return mapping


def load_placed(path: Path, dtype: torch.dtype, device: str | torch.device, max_memory: dict[int | str, int] | None = None):
    """The verifier whole on `device`, or, given `max_memory` (device -> bytes), its layers spread over
    those devices by the planned map (inputs still go to `device`, the first of them)."""
    if max_memory is None:
        return load_text_model(path, dtype, device)
    return load_text_model(path, dtype, device, device_map=planned_device_map(path, dtype, max_memory))


class Worker(BaseModel):
    """One child process of a step: the devices it sees, and how the verifier sits on them."""

    visible: list[str] = Field(description="its CUDA_VISIBLE_DEVICES ([]: none, a CPU worker)")
    device: str = Field(description="where its inputs go: 'cuda' (its first visible GPU) or 'cpu'")
    max_memory: dict[int | str, int] | None = Field(
        None,
        description="bytes each visible device's share of the layers may take, when they are spread over several; None: the whole model on `device`",
    )


def place_verifier(path: Path, devices: list[str], cfg: VerifierConfig | None, dtype: torch.dtype) -> list[Worker]:
    """How a step runs the verifier on its claimed `devices` (CUDA_VISIBLE_DEVICES names; "cpu" for
    a CPU worker process): a replica per device where it fits one, else its layers over all of them.
    `cfg`: the memory settings (None: the defaults).

    Raises:
        ConfigError: the verifier does not fit the claimed GPUs at `cfg.gpu_memory_fraction`.
    """
    if all(device == "cpu" for device in devices):
        return [Worker(visible=[], device="cpu") for _ in devices]
    cfg = cfg or VerifierConfig()
    memory = [int(cfg.gpu_memory_gib * GIB)] * len(devices) if cfg.gpu_memory_gib else gpu_memory_bytes(devices)
    if memory is None:
        logger.warning("cannot read the GPUs' memory (no nvidia-smi): a replica of the verifier on each of %s, unchecked", devices)
        return [Worker(visible=[device], device="cuda") for device in devices]
    budget = int(min(memory) * cfg.gpu_memory_fraction)
    model = meta_model(path, dtype)
    needed = gpus_needed(model, budget)
    if needed is None or needed > len(devices):
        name, unit = largest_unit(model)
        why = f"{needed} are needed" if needed else f"no number of them is: its {name} alone takes {unit / GIB:.1f} GiB"
        raise ConfigError(
            f"verifier '{path}' ({model_bytes(model) / GIB:.1f} GiB in {str(dtype).removeprefix('torch.')}) does not fit "
            f"{len(devices)} GPU(s) of {min(memory) / GIB:.1f} GiB at verifier.gpu_memory_fraction={cfg.gpu_memory_fraction}: "
            f"{why}. Raise verifier.num_gpus, or run its steps on a vLLM server (regenerate.backend=openai, "
            "extract.backend=vllm, evaluate.backend=vllm); `eagle3 plan` shows the whole plan."
        )
    if needed == 1:
        return [Worker(visible=[device], device="cuda") for device in devices]
    return [Worker(visible=list(devices), device="cuda", max_memory=dict.fromkeys(range(len(devices)), budget))]


def gpus_to_decode(path: Path, cfg: VerifierConfig | None, dtype: torch.dtype) -> int:
    """GPUs a step that decodes with the verifier in its own process (baselines, evaluation) claims:
    one where the verifier fits one GPU of this host, else all `cfg.num_gpus` (its layers spread)."""
    cfg = cfg or VerifierConfig()
    if cfg.num_gpus == 1:
        return 1
    memory = [int(cfg.gpu_memory_gib * GIB)] if cfg.gpu_memory_gib else gpu_memory_bytes(host_gpu_ids()[:1])
    if not memory:
        return 1
    return 1 if gpus_needed(meta_model(path, dtype), int(memory[0] * cfg.gpu_memory_fraction)) == 1 else cfg.num_gpus


def decoding_placement(
    path: Path, gpus: list[str] | None, cfg: VerifierConfig | None, dtype: torch.dtype, fallback: str
) -> tuple[str, dict | None]:
    """Where a decoding step puts the verifier in its own process, on its claimed `gpus` (None: on
    `fallback`): the device its inputs go to, and the byte budgets of the host's GPUs its layers are
    spread over (None: the whole model on that device).

    Raises:
        ConfigError: the verifier does not fit the claimed GPUs.
    """
    if not gpus:
        return fallback, None
    [worker, *replicas] = place_verifier(path, gpus, cfg, dtype)  # refuses a verifier too large for them, one GPU or several
    device = in_process_device(gpus, fallback)
    if replicas or len(gpus) == 1:  # it fits one: decode there
        return device, None
    if worker.max_memory is None:  # place_verifier sets it on the one worker that spans several GPUs
        raise RuntimeError(f"verifier '{path}' is spread over GPUs {gpus} without a memory budget per GPU")
    indices = [host_gpu_ids().index(gpu) for gpu in gpus]  # this process sees every GPU of the host
    return device, {index: worker.max_memory[i] for i, index in enumerate(indices)}
