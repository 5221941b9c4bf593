"""Hidden states from vLLM's engine, run by the extraction step itself (`extract.backend=vllm-engine`):
how a verifier that only vLLM runs at scale (MLA attention, hundreds of routed experts, INT4 weights,
tensor, pipeline or expert parallelism, several hosts through Ray) is extracted without a server.

Design: vLLM cannot be imported here (it pins an older fastapi than Prefect), so the step starts one
child process per extraction attempt with the vLLM environment's python
(`eagle3.extraction.vllm_engine_driver`), at the first shard the attempt takes, and feeds it one shard
at a time over a pipe. The child holds a `vllm.LLM` whose workers capture the aux layers with forward
hooks (`eagle3.extraction.vllm_capture`), writes the shard's files itself (states never cross the
pipe: at Kimi-K2.5's width that is 56 KB a token) and answers with their digests; this side checks
them as for every route (`verify_shard`) and moves the shard into place. A long-lived server of our
own would spare the engine start per attempt, but needs its own lifecycle, port, and a second
place that checks the verifier it serves; a child the attempt owns dies with it, runs on the GPUs the
attempt claimed, and starts for the one verifier the step keys.

Costs: the engine start (the verifier's load: ~70 s for a tiny model on 2 CPU cores, ~20 min for
Kimi-K2.5 on 8 GPUs) once per attempt; then prefill only (`max_tokens=1`), in eager mode (hooks do
not run inside torch.compile or CUDA graphs) with prefix caching off (a cached prefix is never
computed). The engine's log goes to `<store>/logs/vllm-engine-<time>-<pid>.log`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO, cast

from eagle3.config import ConfigError, EngineConfig
from eagle3.runtime.attempts import dying_with_parent
from eagle3.store.artifacts import ArtifactError
from eagle3.store.versions import engine_versions
from eagle3.verifier.resolve_verifier import VerifierManifest

__all__ = ["ENGINE_ROUTE", "EngineStates", "engine_identity", "engine_python"]

logger = logging.getLogger(__name__)

ENGINE_ROUTE = "hidden_states/vllm-engine"
_PACKAGE = Path(__file__).resolve().parents[1]  # `eagle3`, which the child and vLLM's workers import
_STOP_S = 60.0  # the engine's own shutdown, before its process group is killed


def engine_python(cfg: EngineConfig) -> str:
    """The vLLM environment's interpreter: `cfg.python`, else this checkout's `.venv-vllm`."""
    return cfg.python or str(_PACKAGE.parent / ".venv-vllm" / "bin" / "python")


def engine_identity(cfg: EngineConfig) -> dict:
    """What of the engine shapes its states, for the cache and shard keys: the vLLM environment's
    releases, the compute dtype and the extra `vllm.LLM` arguments.

    Raises:
        ConfigError: the vLLM environment's python does not run or lacks vllm or torch.
    """
    python = engine_python(cfg)
    try:
        libraries = engine_versions(ENGINE_ROUTE, python)
    except ValueError as exc:
        raise ConfigError(
            f"extract.engine.python = {python!r}: {exc}. Run ./setup-vllm.sh, or point extract.engine.python at the "
            "python of an environment with vLLM."
        ) from exc
    return {"libraries": libraries, "dtype": cfg.dtype, "args": dict(sorted(cfg.args.items()))}


def _llm_args(cfg: EngineConfig) -> dict:
    args = {
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "enable_expert_parallel": cfg.enable_expert_parallel,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
    }
    if cfg.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    return args | cfg.args


def _check_devices(cfg: EngineConfig) -> None:
    """An attempt on claimed GPUs sees only those: the engine needs one per tensor-parallel rank and stage."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    needed = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if visible and len(visible.split(",")) < needed and cfg.args.get("distributed_executor_backend") != "ray":
        raise ConfigError(
            f"extract.engine: tensor_parallel_size {cfg.tensor_parallel_size} x pipeline_parallel_size "
            f"{cfg.pipeline_parallel_size} needs {needed} GPUs, the step claimed {visible!r}: set verifier.num_gpus={needed}."
        )


class EngineStates:
    """The vLLM engine of one extraction attempt, in its own process; `extract_shard` per shard."""

    def __init__(
        self, cfg: EngineConfig, verifier: VerifierManifest, aux: list[int], max_prompt_tokens: int, log_dir: Path, storage: str = "bf16"
    ):
        """Start the engine and wait until it is ready to take a shard; it writes files in `storage` precision.

        Raises:
            ConfigError: the vLLM environment is missing, or the engine needs more GPUs than claimed.
            RuntimeError: the engine failed to start (its log is named).
        """
        _check_devices(cfg)
        python = engine_python(cfg)
        engine_identity(cfg)  # a missing vLLM environment is named before anything starts
        spec = {
            "model": str(verifier.path),
            "dtype": cfg.dtype,
            "trust_remote_code": verifier.trust_remote_code,
            "max_model_len": max_prompt_tokens + 1,  # the prompt and the one token each request answers
            "aux_layer_ids": aux,
            "batch_tokens": cfg.batch_tokens,
            "llm_args": _llm_args(cfg),
            "storage": storage,
        }
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-engine-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        # The package alone on the engine's path: the directory above it may be this environment's
        # site-packages, whose torch and transformers must not shadow the vLLM environment's.
        self.import_dir = Path(tempfile.mkdtemp(prefix="eagle3-engine-"))
        (self.import_dir / "eagle3").symlink_to(_PACKAGE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(self.import_dir), os.environ.get("PYTHONPATH")]))}
        read_end, write_end = os.pipe()
        command = [python, "-m", "eagle3.extraction.vllm_engine_driver", json.dumps(spec), str(write_end)]
        logger.info("starting vLLM's engine for %s (log: %s)", verifier.path, self.log_path)
        with open(self.log_path, "w") as log:
            # Its own session: the engine's processes are stopped together; it dies with this process.
            self.process = subprocess.Popen(
                dying_with_parent(command),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
                env=env,
                start_new_session=True,
                text=True,
            )
        os.close(write_end)
        self.requests = cast(IO[str], self.process.stdin)  # a pipe (stdin=PIPE), never None
        self.replies = os.fdopen(read_end, "r")
        try:
            ready = self._reply("ready")["ready"]
        except BaseException:
            self.close(stop_s=0)  # interrupted or failed: nothing to wait for
            raise
        logger.info("vLLM %s engine ready: %s", ready["vllm"], ready["workers"])

    def _reply(self, kind: str) -> dict:
        """The child's next reply; its error, or its death, raised."""
        line = self.replies.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(
                f"vLLM's engine exited (code {self.process.returncode}) before its {kind} reply; "
                f"its log {self.log_path} ends:\n{self._log_tail()}"
            )
        message = json.loads(line)
        if "error" in message:
            error = message["error"]
            if error["path"]:
                raise ArtifactError(Path(error["path"]), error["message"])
            cause = self._first_logged_error()
            raise RuntimeError(
                f"vLLM's engine: {error['type']}: {error['message']}"
                + (f"; first error in its log: {cause}" if cause else "")
                + f" (its log: {self.log_path})"
            )
        return message

    def _log_tail(self, lines: int = 30) -> str:
        with suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _first_logged_error(self) -> str | None:
        """The root cause a worker logged: vLLM's engine raises a generic EngineDeadError after it."""
        with suppress(OSError), open(self.log_path, errors="replace") as log:
            for line in log:
                if " ERROR " in line and (found := re.search(r"\b\w*(Error|Exception): .*", line)):
                    return found.group(0).strip()
        return None

    def extract_shard(self, shard_dir: Path, files: list[tuple[Path, list[int]]], progress: Callable[[int], None]) -> dict[Path, str]:
        """Have the engine write each `(path, token ids)` of one shard (paths in `shard_dir`);
        `progress(tokens)` as batches finish. Returns each file's sha256.

        Raises:
            ArtifactError: a file's states are not finite (named).
            RuntimeError: the engine failed or exited (its log is named).
        """
        request = {"shard_dir": str(shard_dir), "files": [[path.name, token_ids] for path, token_ids in files]}
        with suppress(BrokenPipeError):  # the engine is gone: reading its reply says why
            self.requests.write(json.dumps(request) + "\n")
            self.requests.flush()
        while "written" not in (message := self._reply("written")):
            progress(message["progress"])
        stats = message["stats"]
        logger.info(
            "vLLM engine: %d prompts in %d forwards, at most %d in one, %d split over several steps",
            len(files),
            stats["forwards"],
            stats["max_requests_per_forward"],
            stats["split_requests"],
        )
        return {shard_dir / name: digest for name, digest in message["written"].items()}

    def close(self, stop_s: float = _STOP_S) -> None:
        """Stop the engine: closing its input lets it shut down; its processes are killed if it has not
        within `stop_s`."""
        with suppress(OSError):
            self.requests.close()
        try:
            self.process.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        with suppress(ProcessLookupError):  # stragglers of its session
            os.killpg(self.process.pid, signal.SIGKILL)
        self.replies.close()
        shutil.rmtree(self.import_dir, ignore_errors=True)
