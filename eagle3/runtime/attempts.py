"""One GPU attempt, one child process: its CUDA context and all its memory go when it exits.

A failed attempt then leaves nothing behind in the long-lived flow process (no allocator cache, no
exception frames pinning tensors), so a retry with a smaller batch starts from an empty GPU. The
child is spawned (CUDA cannot be forked), sees only the devices it was given
(`CUDA_VISIBLE_DEVICES`), streams progress and its `eagle3` log records back over a pipe (so its
warnings reach the flow's log) and returns a small picklable result. Exceptions come back as
themselves where they pickle, `torch.OutOfMemoryError` included, so callers back off the same way
whether an attempt ran in a child or in-process.
"""

from __future__ import annotations

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
from contextlib import AbstractContextManager, nullcontext
from typing import Any

__all__ = [
    "NO_GPU",
    "ChildProcessFailed",
    "GpuClaim",
    "die_with_parent",
    "dying_with_parent",
    "fixed_devices",
    "halve_after_oom",
    "run_attempt",
]


logger = logging.getLogger(__name__)

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


def _child_main(fn: Callable, kwargs: dict, visible_devices: list[str] | None, conn, parent_pid: int, log_level: int) -> None:
    die_with_parent(parent_pid)
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible_devices))
    sending = threading.Lock()  # records also come from the step's worker threads

    def send(kind: str, payload: Any) -> None:
        with sending:
            conn.send((kind, payload))

    library = logging.getLogger("eagle3")
    library.setLevel(log_level)
    library.addHandler(_ToParent(send))
    library.propagate = False
    try:
        result = fn(**kwargs, on_progress=lambda *args: send("progress", args))
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


def run_attempt(fn: Callable[..., Any], kwargs: dict, visible_devices: list[str] | None, on_progress=None) -> Any:
    """`fn(**kwargs, on_progress=...)` in a spawned child seeing only `visible_devices`, or in this
    process when `visible_devices` is None (CPU work needs no isolation). `fn` must be importable."""
    forward = on_progress or (lambda *_: None)
    if visible_devices is None:
        return fn(**kwargs, on_progress=forward)
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    log_level = logging.getLogger("eagle3").getEffectiveLevel()
    child = ctx.Process(target=_child_main, args=(fn, kwargs, visible_devices, send, os.getpid(), log_level), name=f"eagle3-{fn.__name__}")
    child.start()
    send.close()
    outcome = None
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
    finally:
        child.join()
        receive.close()
    if outcome is None:
        raise ChildProcessFailed(f"{fn.__name__} died in its child process (exit code {child.exitcode}) without a result")
    kind, payload = outcome
    if kind == "result":
        return payload
    error, child_traceback = payload
    raise pickle.loads(error) from ChildProcessFailed(f"in the child process:\n{child_traceback}")


def halve_after_oom(knob: str, value: int, minimum: int, backoffs: list[dict], error: str, where: str, kept: str, **record) -> int:
    """The out-of-memory back-off every GPU step shares: half of `value`, the batch setting `knob`
    (e.g. 'train.total_seq_len') that ran out of memory, logged and appended to `backoffs` (with
    `record`'s fields); below `minimum`, a RuntimeError saying what was tried and what is `kept`.
    `where`: what ran out, for the messages ('in shard 3')."""
    group, name = knob.split(".")
    if value // 2 < minimum:
        tried = [b[name] for b in backoffs] + [value]
        raise RuntimeError(
            f"{group} ran out of memory {where} at every batch size tried ({knob} = {tried}) down to "
            f"{group}.min_{name} = {minimum}: {error}. {kept}"
        )
    backoffs.append({**record, name: value, "retry_with": value // 2, "error": error})
    logger.warning("%s ran out of memory %s at %s=%d; retrying with %d", group, where, knob, value, value // 2)
    return value // 2


