"""The attempt protocol the GPU steps (regeneration, extraction, training) share.

One GPU attempt, one child process: its CUDA context and all its memory go when it exits. A failed
attempt then leaves nothing behind in the long-lived flow process (no allocator cache, no exception
frames pinning tensors), so a retry with a smaller batch starts from an empty GPU. An attempt is a
function of one typed spec (a pydantic model, which crosses into the child as itself) and a
progress callback. The child is spawned (CUDA cannot be forked), sees only the devices it was given
(`CUDA_VISIBLE_DEVICES`), streams progress and its `eagle3` log records back over a pipe (so its
warnings reach the flow's log) and returns a small picklable result. Exceptions come back as
themselves where they pickle, `torch.OutOfMemoryError` included.

An attempt that runs out of memory stops and says where (`OutOfMemory`); its step halves one
batch setting (`BatchBackoff`) and runs the next attempt on what is left, until the setting's
minimum. Each halving is logged and recorded in the step's manifest (`Backoff`), and listed in the
step's work directory as it is taken (`BACKOFF_LOG`), so a run that is killed or fails after one starts
again at the setting it reached: at scale each attempt reloads the verifier, which costs minutes.
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field

__all__ = [
    "BACKOFF_LOG",
    "NO_GPU",
    "Backoff",
    "BatchBackoff",
    "ChildProcessFailed",
    "GpuClaim",
    "OutOfMemory",
    "die_with_parent",
    "dying_with_parent",
    "fixed_devices",
    "read_backoffs",
    "run_attempt",
    "submit_in_context",
    "worker_backoff_log",
]

Spec = TypeVar("Spec", bound=BaseModel)
Result = TypeVar("Result")
Progress = Callable[..., None]


logger = logging.getLogger(__name__)

BACKOFF_LOG = "backoffs.jsonl"
"""Where a step's work directory lists the back-offs taken so far: a re-run of a killed or failed step
starts at the batch setting they left, instead of running out of memory at the configured one again."""


def submit_in_context(pool: Executor, fn: Callable[..., Result], *args: Any) -> Future[Result]:
    """`pool.submit(fn, *args)` run in a copy of the caller's context variables. A pool thread starts
    with none, and a workflow engine's run context is one (Prefect's): records a data-parallel worker's
    thread logs, its children's forwarded among them, then reach the run's log instead of the terminal only."""
    return pool.submit(contextvars.copy_context().run, fn, *args)


def worker_backoff_log(directory: Path, worker: int) -> Path:
    """Data-parallel worker `worker`'s back-off log in `directory` (worker 0's is `BACKOFF_LOG`)."""
    return directory / (BACKOFF_LOG if worker == 0 else f"backoffs.{worker}.jsonl")


GpuClaim = Callable[[], AbstractContextManager["list[str] | None"]]
"""How a step gets its GPUs: entered once the step holds its work directory (extraction, which locks
shards instead, lets it go before waiting for a shard another run is extracting, and may enter it
again), so a run waiting for another run holds no GPU. Yields the claimed devices'
CUDA_VISIBLE_DEVICES names, or None to work in this process on the configured device."""


def fixed_devices(devices: list[str] | None) -> GpuClaim:
    """A claim of devices the caller already owns (None: no GPU), for callers without a scheduler."""
    return lambda: nullcontext(devices)


NO_GPU = fixed_devices(None)


class ChildProcessFailed(RuntimeError):
    """The child died without a result (killed, crashed) or raised an exception that does not pickle."""


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGTERM when the one that started it dies, even by SIGKILL. A GPU
    child must not outlive the flow process: it writes into a work directory whose lock went with it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent was already gone
        os.kill(os.getpid(), signal.SIGTERM)


def dying_with_parent(command: list[str]) -> list[str]:
    """`command` (an executable and its arguments) started through `die_with_parent` and exec."""
    start = "import os, sys; from eagle3.runtime.attempts import die_with_parent; die_with_parent(int(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])"
    return [sys.executable, "-c", start, str(os.getpid()), *command]


class _ToParent(logging.Handler):
    """Sends each record, formatted, to the parent, which logs it again under the same name."""

    def __init__(self, send: Callable[[str, Any], None]):
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        self.send("log", (record.name, record.levelno, record.getMessage()))


def _child_main(
    fn: Callable, spec: BaseModel, visible_devices: list[str] | None, env: dict[str, str], conn, parent_pid: int, log_level: int
) -> None:
    die_with_parent(parent_pid)
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible_devices))
    for name, value in env.items():  # before the child's first CUDA call, which reads them; the user's own win
        os.environ.setdefault(name, value)
    sending = threading.Lock()  # records also come from the step's worker threads

    def send(kind: str, payload: Any) -> None:
        with sending:
            conn.send((kind, payload))

    library = logging.getLogger("eagle3")
    library.setLevel(log_level)
    library.addHandler(_ToParent(send))
    library.propagate = False
    try:
        result = fn(spec, lambda *args: send("progress", args))
        send("result", result)
    except BaseException as exc:
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:
            payload = pickle.dumps(ChildProcessFailed(f"{type(exc).__name__}: {exc}"))
        send("error", (payload, traceback.format_exc()))
    finally:
        conn.close()


def run_attempt(
    fn: Callable[[Spec, Progress], Result],
    spec: Spec,
    visible_devices: list[str] | None,
    on_progress: Progress | None = None,
    child_env: dict[str, str] | None = None,
) -> Result:
    """`fn(spec, on_progress)` in a spawned child seeing only `visible_devices`, or in this process
    when `visible_devices` is None (CPU work needs no isolation). `fn` must be importable. The child
    sets `child_env`'s variables that its environment does not set already (this process keeps its own)."""
    forward = on_progress or (lambda *_: None)
    if visible_devices is None:
        return fn(spec, forward)
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    log_level = logging.getLogger("eagle3").getEffectiveLevel()
    child = ctx.Process(
        target=_child_main, args=(fn, spec, visible_devices, child_env or {}, send, os.getpid(), log_level), name=f"eagle3-{fn.__name__}"
    )
    child.start()
    send.close()
    outcome, finished = None, False
    try:
        while outcome is None:
            try:
                kind, payload = receive.recv()
            except EOFError:
                break
            if kind == "progress":
                forward(*payload)
            elif kind == "log":
                name, level, message = payload
                logging.getLogger(name).log(level, message)
            else:
                outcome = kind, payload
        finished = True
    finally:
        if not finished:  # this side failed (a progress report that raised, an interrupt): the child's GPUs and locks go with it
            child.kill()
        child.join()
        receive.close()
    if outcome is None:
        raise ChildProcessFailed(f"{fn.__name__} died in its child process (exit code {child.exitcode}) without a result")
    kind, payload = outcome
    if kind == "result":
        return payload
    error, child_traceback = payload
    raise pickle.loads(error) from ChildProcessFailed(f"in the child process:\n{child_traceback}")


class OutOfMemory(BaseModel):
    """Where an attempt ran out of memory: what its step backs off from."""

    error: str = Field(description="the error's first line")
    where: str = Field(description="what ran out, for messages: 'in shard 3', 'on records [...]'")
    at: dict[str, Any] = Field(default_factory=dict, description="the unit that ran out, recorded with the back-off")


class Backoff(BaseModel):
    """One halving of a batch setting after an out-of-memory error, as a step's manifest records it."""

    setting: str = Field(description="the setting halved, as a user sets it: 'extract.prefill_batch_tokens'")
    value: int = Field(description="its value when memory ran out")
    retry_with: int
    error: str
    where: str
    at: dict[str, Any] = Field(default_factory=dict)


class BatchBackoff:
    """The out-of-memory back-off every GPU step shares: halve one batch setting per out-of-memory
    attempt, down to its minimum, then fail saying what was tried and what is `kept`."""

    def __init__(self, setting: str, value: int, minimum_setting: str, minimum: int, kept: str, log: Path | None = None):
        self.setting, self.value, self.minimum_setting, self.minimum, self.kept = setting, value, minimum_setting, minimum, kept
        self.log = log
        self.taken: list[Backoff] = []
        earlier = [b for b in read_backoffs(log) if b.setting == setting] if log else []
        if earlier and (resumed := max(min(b.retry_with for b in earlier), minimum)) < value:
            logger.warning(
                "resuming at %s=%d, where this work backed off to before (%s lists each back-off; delete it to start at the configured %d)",
                setting,
                resumed,
                log,
                value,
            )
            self.taken, self.value = earlier, resumed

    def after(self, oom: OutOfMemory) -> int:
        """The value to retry with, logged and recorded in `taken`.

        Raises:
            RuntimeError: the value is at its minimum already (halving stops there: the minimum is tried).
        """
        if self.value <= self.minimum:
            tried = [b.value for b in self.taken] + [self.value]
            restart = f" A re-run starts at {self.value} ({self.log} lists the back-offs: delete it to start at the configured value)."
            raise RuntimeError(
                f"ran out of memory {oom.where} at every batch size tried ({self.setting} = {tried}) down to "
                f"{self.minimum_setting} = {self.minimum}: {oom.error}. {self.kept}{restart if self.log else ''}"
            )
        return self._retry_with(max(self.value // 2, self.minimum), oom)

    def _retry_with(self, value: int, oom: OutOfMemory) -> int:
        taken = Backoff(setting=self.setting, value=self.value, retry_with=value, error=oom.error, where=oom.where, at=oom.at)
        logger.warning("ran out of memory %s at %s=%d; retrying with %d", oom.where, self.setting, self.value, value)
        self.taken.append(taken)
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "a") as log:
                log.write(taken.model_dump_json() + "\n")  # one write: a kill leaves at most this line torn
        self.value = value
        return value


def read_backoffs(log: Path) -> list[Backoff]:
    """The back-offs listed in `log`, oldest first. A last line without its newline is a write a kill
    cut short: it is cut from the file, so the next back-off starts a line of its own. A line that
    does not read is passed over with a warning: it costs a re-run one out-of-memory attempt at most."""
    if not log.exists():
        return []
    data = log.read_bytes()
    if (complete := data.rfind(b"\n") + 1) < len(data):
        os.truncate(log, complete)
    taken = []
    for number, line in enumerate(data[:complete].decode(errors="replace").splitlines(), 1):
        try:
            taken.append(Backoff.model_validate_json(line))
        except ValueError as exc:
            logger.warning("%s: line %d is not a back-off (%s); passed over", log, number, str(exc).splitlines()[0])
    return taken
