"""`eagle3 plan`: will a run fit, and what will it cost, before anything loads.

From the verifier's `config.json` (and `model.safetensors.index.json`, or the safetensors files'
sizes), the dataset and the store alone, reading no weights: the verifier's parameters and bytes in
the compute dtype (what transformers holds: it dequantizes compressed-tensors MoE experts at load)
and as stored (what vLLM holds: it keeps them quantized), the GPUs each step needs at the claimed
memory and the route it takes, the hidden states' bytes per token and for the whole dataset against
the store's free disk, and time estimates wherever the store holds a measured throughput for this
verifier. Sizes come from the verifier's meta-device model (`eagle3.verifier.placement`); a
Kimi-K2.5 plan takes a few seconds, most of it importing transformers.

The flow runs `check_verifier_fits` before its first step: a verifier that cannot fit the GPUs a
step claims fails the run there, with the plan in the message, instead of after a long load.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from eagle3.config import ConfigError, PipelineConfig, store_path
from eagle3.data.prepare_dataset import dataset_source, read_conversations, read_user_turns
from eagle3.extraction.storage import bytes_per_token, per_token_arithmetic
from eagle3.runtime.devices import device_type, gpu_memory_bytes, host_gpu_ids
from eagle3.store.artifacts import digest_tree, memo_tag
from eagle3.verifier import placement
from eagle3.verifier.loading import load_tokenizer, read_config, text_config
from eagle3.verifier.resolve_verifier import verifier_source

if TYPE_CHECKING:  # imported where used: the flow loads this module on every run, these only where a step runs
    import torch

__all__ = ["Plan", "StepPlan", "check_verifier_fits", "make_plan"]

GB = 1e9
GIB = placement.GIB
TOKEN_SAMPLE = 256  # records tokenized to estimate a large dataset's tokens
# Of vLLM's share of a GPU, what its weights may take: the rest holds the KV cache of one whole prompt and the
# activations, without which it refuses to start.
ENGINE_WEIGHTS_MAX_SHARE = 0.9
REFERENCE_GPUS = {"H100 80GB": 79.2, "H200 141GB": 139.8}  # GiB as torch reports them: planned for when no GPU is known


class StepPlan(BaseModel):
    step: str
    route: str = Field(description="where the step runs the verifier, in words")
    on_gpus: bool = Field(False, description="runs the verifier in the step, on GPUs it claims")
    gpus_needed: int | None = Field(None, description="fewest GPUs holding the verifier for this step (None: not on GPUs, or none do)")
    fits: bool = True
    how: str = ""


class Plan(BaseModel):
    verifier: str
    architecture: str
    num_parameters: int
    hidden_size: int
    bytes_bf16: int = Field(description="every parameter and buffer in bfloat16, as transformers holds it on GPUs")
    bytes_stored: int | None = Field(None, description="the checkpoint's weights as stored")
    stored_from: str = ""
    quantization: str | None = None
    gpu_memory_bytes: int | None = Field(None, description="memory of each GPU (None: no GPU known)")
    gpu_memory_from: str = ""
    gpu_memory_fraction: float
    num_gpus: int
    gpus_needed_bf16: int | None = None
    gpus_needed_as_stored: int | None = None
    reference: dict[str, tuple[int | None, int | None]] = Field(
        default_factory=dict, description="card -> GPUs needed in bfloat16 and as stored, when no GPU is known"
    )
    steps: list[StepPlan]
    hidden_state_bytes_per_token: int
    hidden_state_storage: str = Field("bf16", description="extract.storage; 'online' where training computes the states and stores none")
    dataset_records: int | None = None
    dataset_tokens: int | None = None
    tokens_from: str = ""
    store_dir: str
    store_free_bytes: int | None = None
    estimates: list[str] = Field(default_factory=list, description="time estimates from throughputs measured in the store")
    seconds: float = 0.0

    @property
    def states_bytes(self) -> int | None:
        """The dataset's hidden states on disk (None: not estimated, or none stored)."""
        if self.dataset_tokens is None or self.hidden_state_storage == "online":
            return None
        return self.dataset_tokens * self.hidden_state_bytes_per_token

    @property
    def fits(self) -> bool:
        """Whether every step that runs the verifier on GPUs fits the GPUs it claims, and the hidden
        states the store's free disk (where both are known)."""
        disk = self.states_bytes is None or self.store_free_bytes is None or self.states_bytes <= self.store_free_bytes
        return disk and all(step.fits for step in self.steps)

    def render(self) -> str:
        """The plan as `eagle3 plan` prints it."""
        lines = [f"verifier      {self.verifier}", f"  model       {self.architecture}, {self.num_parameters / 1e9:,.2f} B parameters"]
        dequantized = " (it dequantizes compressed-tensors MoE experts at load)" if self.quantization else ""
        lines.append(f"  bfloat16    {_size(self.bytes_bf16)}: what transformers holds on GPUs{dequantized}")
        if self.bytes_stored is not None:
            held = "what vLLM holds (it keeps the quantized weights)" if self.quantization else "weights as stored"
            lines.append(f"  as stored   {_size(self.bytes_stored)} ({self.stored_from}): {held}")
        if self.quantization:
            lines.append(f"  quantized   {self.quantization}")
        if self.gpu_memory_bytes is not None:
            budget = self.gpu_memory_bytes * self.gpu_memory_fraction
            lines.append(
                f"GPUs          {self.num_gpus} claimed (verifier.num_gpus), {self.gpu_memory_bytes / GIB:.1f} GiB each "
                f"({self.gpu_memory_from}); {budget / GIB:.1f} GiB for weights at verifier.gpu_memory_fraction={self.gpu_memory_fraction}"
            )
            lines.append(
                f"  needed      {_count(self.gpus_needed_bf16)} in bfloat16 (transformers), "
                f"{_stored_count(self.gpus_needed_as_stored)} as stored (vLLM: weights only, its KV cache needs more)"
            )
        else:
            lines.append(
                f"GPUs          none known here (set verifier.gpu_memory_gib to plan for some); at "
                f"verifier.gpu_memory_fraction={self.gpu_memory_fraction}, needed:"
            )
            for card, (bf16, stored) in self.reference.items():
                lines.append(
                    f"  {card:<11} {_count(bf16)} in bfloat16 (transformers), {_stored_count(stored)} as stored (vLLM, weights only)"
                )
        lines.append("steps")
        for step in self.steps:
            verdict = "" if step.fits else "DOES NOT FIT: "
            lines.append(f"  {step.step:<11} {step.route}" + (f": {verdict}{step.how}" if step.how else ""))
        lines.append("hidden states")
        if self.hidden_state_storage == "online":
            lines.append("  none stored (train.hidden_states=online): the verifier computes them in training, every epoch")
        else:
            lines.append(f"  size        {per_token_arithmetic(self.hidden_size, self.hidden_state_storage)}")
        if (total := self.states_bytes) is not None:
            lines.append(
                f"  dataset     {self.dataset_records:,} records, {self.dataset_tokens:,} tokens ({self.tokens_from}): {_size(total)}"
            )
            if self.store_free_bytes is not None:
                room = "fits" if total <= self.store_free_bytes else "DOES NOT FIT"
                lines.append(f"  store       {self.store_dir}: {_size(self.store_free_bytes)} free: {room}")
        if self.estimates:
            lines.append("time (at rates measured in this store)")
            lines += [f"  {estimate}" for estimate in self.estimates]
        return "\n".join(lines)


def _size(n: float) -> str:
    if n < 999.95e6:  # under what rounds to 1,000.0 MB: a demo's states or a tiny model would read "0.0 GB"
        return f"{n / 1e6:,.1f} MB ({n / 2**20:,.1f} MiB)"
    return f"{n / GB:,.1f} GB ({n / GIB:,.1f} GiB)"


def _duration(seconds: float) -> str:
    """Hours for a run at scale; minutes or seconds for one that would read "0.0 h"."""
    if seconds < 59.5:  # what rounds to "60 s" reads as minutes, what rounds to "60.0 min" as hours
        return f"{seconds:,.0f} s"
    if seconds < 3597:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def _count(gpus: int | None) -> str:
    return "no number of GPUs (a layer is larger than one)" if gpus is None else f"{gpus} GPU(s)"


def _stored_count(gpus: int | None) -> str:
    return "unknown (no weights or index here)" if gpus is None else f"{gpus} GPU(s)"


def _config(source: Path):
    """The verifier's config as transformers reads it: from `config.json`, or a GGUF file's header."""
    from transformers import AutoConfig

    if source.suffix == ".gguf":
        return AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    return read_config(source)


def _stored(source: Path) -> tuple[int | None, str]:
    """The weights' bytes as stored: the index's total, else the files' sizes (None: none here)."""
    if source.suffix == ".gguf":
        return source.stat().st_size, source.name
    index = source / "model.safetensors.index.json"
    if index.is_file() and (total := json.loads(index.read_text()).get("metadata", {}).get("total_size")):
        return int(total), index.name
    files = sorted(source.glob("*.safetensors"))
    return (sum(f.stat().st_size for f in files), f"{len(files)} safetensors file(s)") if files else (None, "")


def _quantization(config) -> str | None:
    quantization = getattr(config, "quantization_config", None) or getattr(text_config(config), "quantization_config", None)
    if quantization is None:
        return None
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    groups = quantization.get("config_groups") or {}
    schemes = sorted({f"{g['weights']['type']}{g['weights']['num_bits']}" for g in groups.values() if g.get("weights")})
    return ", ".join([quantization.get("quant_method", "?"), *filter(None, [quantization.get("format")]), *schemes])


def _gpu_memory(config: PipelineConfig) -> tuple[int | None, str]:

    if config.verifier.gpu_memory_gib is not None:
        return int(config.verifier.gpu_memory_gib * GIB), "verifier.gpu_memory_gib"
    host = host_gpu_ids()[: config.verifier.num_gpus] if device_type("auto") == "cuda" else []
    memory = gpu_memory_bytes(host) if host else None
    return (min(memory), "nvidia-smi") if memory else (None, "")


def _on_gpus(device: str, config: PipelineConfig) -> bool:
    """Whether a step on `device` runs on GPUs: `auto` does where this host has one, or where
    `verifier.gpu_memory_gib` plans for GPUs it lacks."""
    return device == "cuda" or (device == "auto" and (config.verifier.gpu_memory_gib is not None or device_type("auto") == "cuda"))


class _Sizes:
    """The verifier's meta-device models and the GPUs they need, each worked out once."""

    def __init__(self, config):
        self.config, self.models, self.needed = config, {}, {}

    def model(self, dtype: torch.dtype):
        if dtype not in self.models:
            self.models[dtype] = placement.meta_model(self.config, dtype)
        return self.models[dtype]

    def gpus(self, dtype: torch.dtype, budget: int) -> int | None:
        if (dtype, budget) not in self.needed:
            self.needed[dtype, budget] = placement.gpus_needed(self.model(dtype), budget)
        return self.needed[dtype, budget]


def _in_step(
    name: str, sizes: _Sizes, dtype: torch.dtype, device: str, config: PipelineConfig, budget: int | None, data_parallel: bool
) -> StepPlan:
    """A step that runs the verifier itself, in `dtype`, on `device`."""
    import torch

    dtype_name = str(dtype).removeprefix("torch.")
    if not _on_gpus(device, config):
        held = placement.model_bytes(sizes.model(torch.float32))
        return StepPlan(step=name, route=f"transformers in the step, on the CPU (float32: {_size(held)} of host memory)")
    route = f"transformers in the step ({dtype_name})"
    if budget is None:
        return StepPlan(step=name, route=route, on_gpus=True, how="GPU memory unknown: not checked")
    needed, claimed = sizes.gpus(dtype, budget), config.verifier.num_gpus
    step = StepPlan(step=name, route=route, on_gpus=True, gpus_needed=needed)
    if needed is None or needed > claimed:
        step.fits = False
        step.how = f"needs {_count(needed)}, {claimed} claimed (verifier.num_gpus)"
    elif needed == 1 and claimed > 1 and data_parallel:
        step.how = f"data parallel: a replica on each of {claimed} GPUs"
    elif needed == 1:
        step.how = "on one GPU"
    else:
        step.how = f"layers spread over {claimed} GPUs (needs {needed}), one GPU computing at a time"
    return step


def _steps(config: PipelineConfig, sizes: _Sizes, memory: int | None, stored: int | None) -> list[StepPlan]:
    import torch

    bf16 = torch.bfloat16
    budget = int(memory * config.verifier.gpu_memory_fraction) if memory else None
    regenerate, extract = config.regenerate, config.extract
    steps = []
    if config.draft_path is not None:  # a draft trained elsewhere: only evaluation runs
        return [_evaluate_step(config, sizes, budget)]
    if not regenerate.enabled:
        steps.append(StepPlan(step="regenerate", route="off (regenerate.enabled=false)"))
    elif regenerate.backend == "openai":
        steps.append(StepPlan(step="regenerate", route=f"server {regenerate.endpoint.display_url} ({regenerate.endpoint.model})"))
    else:
        steps.append(_in_step("regenerate", sizes, bf16, regenerate.device, config, budget, data_parallel=True))
    if config.train.hidden_states == "online":
        steps.append(StepPlan(step="extract", route="none: training computes the states (train.hidden_states=online)"))
    elif extract.backend == "transformers":
        steps.append(_in_step("extract", sizes, bf16, extract.device, config, budget, data_parallel=True))
    elif extract.backend == "vllm":
        steps.append(StepPlan(step="extract", route=f"vLLM server {extract.endpoint.display_url} ({extract.endpoint.model})"))
    else:
        steps.append(_engine_step(config, memory, stored, text_config(sizes.config).num_hidden_layers))
    steps.append(_evaluate_step(config, sizes, budget))
    train = config.train
    if train.hidden_states == "online":
        steps.append(_online_train_step(sizes, config, budget))
    else:
        steps.append(
            StepPlan(
                step="train",
                route=f"the draft only, {train.num_gpus} GPU(s) (train.num_gpus); the verifier is not loaded"
                if _on_gpus(train.device, config)
                else "the draft only, on the CPU",
            )
        )
    return steps


def _evaluate_step(config: PipelineConfig, sizes: _Sizes, budget: int | None) -> StepPlan:
    import torch

    evaluate = config.evaluate
    if evaluate.backend == "transformers":  # the baselines too
        return _in_step("evaluate", sizes, getattr(torch, evaluate.dtype), evaluate.device, config, budget, data_parallel=False)
    return StepPlan(step="evaluate", route=f"vLLM server {evaluate.endpoint.display_url} ({evaluate.endpoint.model}) serving the draft")


def _engine_step(config: PipelineConfig, memory: int | None, stored: int | None, layers: int) -> StepPlan:
    """vLLM's engine holds the weights as stored, split over its tensor x pipeline parallel ranks,
    each on a GPU of its own, in `extract.engine.gpu_memory_utilization` of that GPU. A pipeline
    stage holds a whole number of layers: the largest, ceil(layers / stages), is what must fit, with
    room beside it for the KV cache and activations (`ENGINE_WEIGHTS_MAX_SHARE`)."""
    engine = config.extract.engine
    gpus = engine.tensor_parallel_size * engine.pipeline_parallel_size
    largest_stage = math.ceil(layers / engine.pipeline_parallel_size) / layers
    share = stored * largest_stage / engine.tensor_parallel_size if stored else None
    weights = f"{_size(share)} of weights as stored on the fullest" if share else "weights as stored"
    route = f"vLLM engine in the step on {gpus} GPU(s) (tensor x pipeline parallel): {weights}"
    if not _on_gpus(config.extract.device, config):
        return StepPlan(step="extract", route=route)
    step = StepPlan(step="extract", route=route, on_gpus=True)
    held = memory * engine.gpu_memory_utilization if memory else None
    if gpus > config.verifier.num_gpus and engine.args.get("distributed_executor_backend") != "ray":
        step.fits = False
        step.how = f"needs {gpus} GPU(s), {config.verifier.num_gpus} claimed (verifier.num_gpus)"
    elif held is None or share is None:
        step.how = "GPU memory unknown: not checked" if held is None else "weights' size unknown: not checked"
    elif share > held * ENGINE_WEIGHTS_MAX_SHARE:
        step.fits = False
        step.how = (
            f"the weights take {share / held:.0%} of the engine's {_size(held)} of a GPU (extract.engine.gpu_memory_utilization="
            f"{engine.gpu_memory_utilization}), more than {ENGINE_WEIGHTS_MAX_SHARE:.0%}: raise tensor or pipeline parallelism"
        )
    else:
        step.how = f"the weights take {share / held:.0%} of the engine's share of the fullest GPU; the rest holds its KV cache"
    return step


def _online_train_step(sizes: _Sizes, config: PipelineConfig, budget: int | None) -> StepPlan:
    """Online training holds the whole verifier beside the draft in each training process, on its one
    device (`eagle3.training.online_transfer`): it fits only a verifier that one GPU holds."""
    import torch

    train = config.train
    if not _on_gpus(train.device, config):
        held = placement.model_bytes(sizes.model(torch.float32))
        return StepPlan(
            step="train", route=f"the draft and the verifier (online states), on the CPU (float32: {_size(held)} of host memory)"
        )
    route = f"the draft and the whole verifier (online states) on each of {train.num_gpus} GPU(s) (train.num_gpus)"
    if budget is None:
        return StepPlan(step="train", route=route, on_gpus=True, how="GPU memory unknown: not checked")
    needed = sizes.gpus(torch.bfloat16, budget)
    step = StepPlan(step="train", route=route, on_gpus=True, gpus_needed=needed)
    if needed == 1:
        held = placement.model_bytes(sizes.model(torch.bfloat16))
        step.how = (
            f"the verifier takes {_size(held)} of one GPU's {_size(budget)}: the draft trains in the rest "
            "(its memory not estimated here; it is not checked)"
        )
    else:
        step.fits = False
        step.how = f"the verifier needs {_count(needed)} and online training holds it on one: train.hidden_states=offline"
    return step


def _dataset_tokens(config: PipelineConfig, source: Path) -> tuple[int, int, str]:
    """(records, tokens, how they were counted) of the dataset the run will extract."""
    tokenizer = None
    if source.is_dir():
        try:
            tokenizer = load_tokenizer(source, config.verifier.trust_remote_code)
        except Exception:  # a config-only directory (planning ahead of a download): estimate from characters
            tokenizer = None
    elif source.suffix == ".gguf":  # the tokenizer is in its header, as the config is
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    data = dataset_source(config.dataset)
    limit = config.dataset.max_records
    if config.regenerate.enabled:  # assistant turns are the verifier's own, at most max_new_tokens each
        turns = read_user_turns(data, min(filter(None, [limit, config.regenerate.max_records]), default=None))
        conversations = [[*system, *({"role": "user", "content": u} for u in users)] for _, system, users in turns]
        extra = [len(users) * config.regenerate.max_new_tokens for _, _, users in turns]
    else:
        conversations = [messages for _, messages in read_conversations(data, limit)]
        extra = [0] * len(conversations)
    sample = (
        range(len(conversations))
        if len(conversations) <= TOKEN_SAMPLE
        else [round(i * (len(conversations) - 1) / (TOKEN_SAMPLE - 1)) for i in range(TOKEN_SAMPLE)]
    )
    if tokenizer is not None:

        def count(i):
            return len(tokenizer.apply_chat_template(conversations[i], tokenize=True, return_dict=True)["input_ids"])

        how = "tokenized" if len(sample) == len(conversations) else f"estimated from {len(sample)} records tokenized"
    else:

        def count(i):
            return sum(len(m["content"]) for m in conversations[i]) // 4

        how = "estimated at 4 characters a token: no tokenizer here"
    if config.regenerate.enabled:
        how += f", answers at most regenerate.max_new_tokens={config.regenerate.max_new_tokens}"
    counted = [min(config.dataset.max_seq_len, count(i) + extra[i]) for i in sample]
    tokens = round(sum(counted) * len(conversations) / max(len(sample), 1))
    return len(conversations), tokens, how


def _known_digest(store_dir: Path, source: Path) -> str | None:
    """The verifier's digest as the store memoised it when a run last read its files (no weights read
    here); None where a file was never hashed in this store, or changed since."""
    memo_path = store_dir / "file-digests.json"  # written by ArtifactStore.input_digest: path -> memo_tag, sha256
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}

    def memoised(path: Path) -> str:
        stat, entry = path.stat(), memo.get(str(path))
        if not entry or entry["tag"] != memo_tag(stat):
            raise KeyError(path)
        return entry["sha256"]

    try:
        return digest_tree(source, memoised) if source.is_dir() else memoised(source)
    except (KeyError, OSError):
        return None


def _estimates(config: PipelineConfig, store_dir: Path, source: Path, records: int | None, tokens: int | None) -> list[str]:
    """Times from the latest of each kind of artifact the store holds for this verifier."""
    digest = _known_digest(store_dir, source)
    if digest is None or tokens is None:
        return []
    paths = sorted((store_dir / "artifacts").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    manifests = [json.loads(path.read_text()) for path in paths]
    if source.suffix == ".gguf":  # steps name the directory it was converted into (latest first), by its digest
        converted = (
            m["digest"] for m in reversed(manifests) if m.get("kind") == "verifier" and m.get("parents", {}).get("source") == digest
        )
        if (digest := next(converted, None)) is None:
            return []
    elif config.verifier.trust_remote_code:  # as resolve_verifier keys it
        import hashlib

        digest = hashlib.sha256(f"{digest}:trust_remote_code".encode()).hexdigest()
    latest: dict[str, dict] = {}
    for manifest in manifests:
        if manifest.get("parents", {}).get("verifier") == digest and manifest.get("seconds"):
            latest[manifest["kind"]] = manifest
    out = []
    if (hidden := latest.get("hidden_states")) and hidden.get("extracted_shards"):
        share = hidden["extracted_shards"] / (hidden["extracted_shards"] + hidden["reused_shards"])
        rate = hidden["num_tokens"] * share / hidden["seconds"]
        out.append(f"extract     {_duration(tokens / rate)} at {rate:,.0f} tok/s (artifact {hidden['digest'][:12]})")
    regenerated = latest.get("regenerated")
    if (
        config.regenerate.enabled
        and regenerated
        and records
        and (generated := regenerated["num_records"] - regenerated.get("reused_records", 0) - regenerated.get("resumed_records", 0))
    ):
        rate = generated / regenerated["seconds"]  # reused answers took no time, resumed ones a killed run's
        out.append(f"regenerate  {_duration(records / rate)} at {rate:,.2f} records/s (artifact {regenerated['digest'][:12]})")
    if (draft := latest.get("draft")) and draft.get("tokens_per_s"):
        train = config.train
        per_second = draft["tokens_per_s"] * train.num_gpus
        seconds = train.epochs * tokens * train.train_data_ratio / per_second
        out.append(
            f"train       {_duration(seconds)} at {draft['tokens_per_s']:,.0f} tok/s per GPU x {train.num_gpus} (artifact {draft['digest'][:12]})"
        )
    return out


def make_plan(config: PipelineConfig, costs: bool = True) -> Plan:
    """The plan of `config`'s run, from the verifier's config and index, the dataset and the store.

    Args:
        costs: also count the dataset's tokens (tokenizing a sample of it) and look up measured
            throughputs in the store; without, only sizes and GPUs (what the flow's check needs).

    Raises:
        ArtifactError: the dataset file is malformed.
    """
    import time

    import torch

    start = time.perf_counter()
    source = verifier_source(config.verifier)
    hf_config = _config(source)
    sizes = _Sizes(hf_config)
    model = sizes.model(torch.bfloat16)
    stored, stored_from = _stored(source)
    memory, memory_from = _gpu_memory(config)
    fraction = config.verifier.gpu_memory_fraction
    budget = int(memory * fraction) if memory else None
    plan = Plan(
        verifier=str(source),
        architecture=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters()),
        hidden_size=text_config(hf_config).hidden_size,
        bytes_bf16=placement.model_bytes(model),
        bytes_stored=stored,
        stored_from=stored_from,
        quantization=_quantization(hf_config),
        gpu_memory_bytes=memory,
        gpu_memory_from=memory_from,
        gpu_memory_fraction=fraction,
        num_gpus=config.verifier.num_gpus,
        steps=_steps(config, sizes, memory, stored),
        hidden_state_bytes_per_token=bytes_per_token(text_config(hf_config).hidden_size, config.extract.storage),
        hidden_state_storage="online" if config.train.hidden_states == "online" else config.extract.storage,
        store_dir=str(store_path(config.store_dir)),
    )
    if budget is not None:
        plan.gpus_needed_bf16 = sizes.gpus(torch.bfloat16, budget)
        plan.gpus_needed_as_stored = math.ceil(stored / budget) if stored else None
    else:
        for card, gib in REFERENCE_GPUS.items():
            card_budget = int(gib * GIB * fraction)
            plan.reference[card] = (sizes.gpus(torch.bfloat16, card_budget), math.ceil(stored / card_budget) if stored else None)
    if costs and config.draft_path is None:  # a given draft trains nothing: no dataset, no states
        plan.dataset_records, plan.dataset_tokens, plan.tokens_from = _dataset_tokens(config, source)
        store_dir = store_path(config.store_dir)
        existing = next(p for p in [store_dir, *store_dir.parents] if p.exists())
        plan.store_free_bytes = shutil.disk_usage(existing).free
        plan.estimates = _estimates(config, store_dir, source, plan.dataset_records, plan.dataset_tokens)
    plan.seconds = time.perf_counter() - start
    return plan


def _running_steps(config: PipelineConfig) -> set[str]:
    """The verifier's steps this run reaches (`stop_after` ends it early: a staged run on a host whose
    GPUs hold one stage at a time is checked stage by stage; a given `draft_path` is only evaluated)."""
    if config.draft_path is not None:
        return {"evaluate"}
    online = config.train.hidden_states == "online"
    extracts = config.stop_after != "dataset" and not online
    trains_online = online and config.stop_after in (None, "checkpoint")
    return (
        {"regenerate"}
        | ({"extract"} if extracts else set())
        | ({"train"} if trains_online else set())
        | ({"evaluate"} if config.stop_after is None else set())
    )


def check_verifier_fits(config: PipelineConfig) -> None:
    """Fail a run whose verifier cannot fit the GPUs a step claims for it, before any step loads it.

    Checked where a step runs the verifier itself on GPUs (not where a server does) and the GPUs'
    memory is known; a .gguf verifier is checked by its steps once converted.

    Raises:
        ConfigError: a step's verifier does not fit; the message holds the whole plan.
    """
    source = verifier_source(config.verifier)
    running = _running_steps(config)
    in_step = "extract" in running and config.extract.backend in ("transformers", "vllm-engine")  # not on a server
    devices = [config.extract.device] if in_step else []
    devices += (
        [config.regenerate.device]
        if "regenerate" in running and config.regenerate.enabled and config.regenerate.backend == "transformers"
        else []
    )
    devices += [config.evaluate.device] if "evaluate" in running and config.evaluate.backend == "transformers" else []
    devices += [config.train.device] if "train" in running else []
    if source.suffix == ".gguf" or not any(_on_gpus(device, config) for device in devices):
        return
    plan = make_plan(config, costs=False)
    failing = ", ".join(f"{step.step} ({step.how})" for step in plan.steps if not step.fits and step.step in running)
    if not failing:
        return
    raise ConfigError(
        f"verifier.path '{source}' does not fit the GPUs its steps claim: {failing}. Raise verifier.num_gpus, or run those steps "
        "on a vLLM server (regenerate.backend=openai, extract.backend=vllm or vllm-engine, evaluate.backend=vllm); "
        f"nothing was loaded. The plan (`eagle3 plan`):\n{make_plan(config).render()}"
    )
