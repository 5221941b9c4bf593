"""The temporary Prefect server `eagle3 run` starts where no server is configured (PREFECT_API_URL).

Prefect would start one itself (its "ephemeral" server), as a plain child in the run's process
group. SIGTERM to the group (`timeout`, a scheduler, `kill -- -PGID`) then reached the server too,
and the run spent 74-156 s retrying to mark itself crashed on a server that was shutting down;
SIGKILL of the run alone (the kernel's OOM killer) left the server running (202 MB, for good).
This one is started the way Prefect starts its own (uvicorn over `create_app`, no UI, ephemeral
services; through `tasks.server_process`, which loads Prefect's server faster) but in its own
session, so a signal to the run's group reaches only the run, which stops the server last, after
Prefect's log and event workers have drained; and the kernel sends it SIGTERM the moment the run's
process dies, however it dies (PR_SET_PDEATHSIG). A server that dies first ends the run within
seconds, saying so, instead of leaving it retrying.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from eagle3.runtime.attempts import dying_with_parent

__all__ = ["TEMPORARY_API_URL", "TemporaryServer", "preload_flow_engine", "start_temporary_server"]

TEMPORARY_API_URL = "EAGLE3_TEMPORARY_API_URL"  # the URL of the server `eagle3 run` started (`tasks.gpu` asks)

PORT_IN_USE = 3  # uvicorn's exit code when another process took the port first
STOP_WAIT_S = 3.0  # then SIGKILL: SQLite survives it, and a run must be gone within 10 s of SIGTERM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class TemporaryServer:
    """A Prefect API server in a child process that dies with this one; `stop` ends it."""

    def __init__(self, log_file: Path):
        self.log_file = log_file
        self.stopping = False
        self.port = _free_port()
        self.process = self._start()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _start(self) -> subprocess.Popen:
        prefect_spec = importlib.util.find_spec("prefect")  # found, not imported: the server starts at once
        if prefect_spec is None or prefect_spec.origin is None:
            raise RuntimeError("the temporary Prefect server needs the prefect package installed")
        prefect_dir = Path(prefect_spec.origin).parent
        command = [
            sys.executable,
            "-m",
            "tasks.server_process",
            "--app-dir",
            str(prefect_dir.parent),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:  # its services log the batch a stop cuts short: not for the terminal
            return subprocess.Popen(dying_with_parent(command), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_healthy(self) -> bool:
        """Once the server answers, point this process's Prefect settings at it and return True;
        return False, and stop it, where Prefect's settings (a profile, prefect.toml) name a server
        or forbid a temporary one after all.

        Raises:
            RuntimeError: the server exited, or did not answer within its startup timeout.
        """
        import prefect.context
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        if settings.api.url or not settings.server.ephemeral.enabled:
            self.stop()
            return False
        timeout_s = settings.server.ephemeral.startup_timeout_seconds
        deadline = time.monotonic() + timeout_s
        while not _answers(f"{self.api_url}/health"):
            if self.process.poll() == PORT_IN_USE:  # taken between choosing the port and binding it
                self.port = _free_port()
                self.process = self._start()
            elif self.process.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {self.process.returncode}; its log: {self.log_file}")
            elif time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the temporary Prefect server did not answer within {timeout_s:g} s "
                    f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS; its log: {self.log_file}); start one with "
                    "`prefect server start` and set PREFECT_API_URL"
                )
            time.sleep(0.1)
        os.environ["PREFECT_API_URL"] = os.environ[TEMPORARY_API_URL] = self.api_url
        os.environ.setdefault("PREFECT_UI_URL", "")  # it serves no UI: no "View at <url>" lines that lead nowhere
        prefect.context.refresh_global_settings_context()
        print(
            f"eagle3: a temporary Prefect server runs on http://127.0.0.1:{self.port} until the run ends "
            "(set PREFECT_API_URL to use a persistent one and see runs in its UI)",
            file=sys.stderr,
        )
        threading.Thread(target=self._end_run_if_it_dies, name="eagle3-server-watch", daemon=True).start()
        return True

    def _end_run_if_it_dies(self) -> None:
        """A run whose server died (killed, out of memory) cannot record anything: rather than retry
        for minutes, it stops as SIGTERM stops it, within seconds."""
        code = self.process.wait()
        if not self.stopping:
            print(
                f"eagle3: the temporary Prefect server stopped (exit code {code}; its log: {self.log_file}), so this run "
                "stops too; finished steps stay cached: run again",
                file=sys.stderr,
            )
            os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        self.stopping = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# What Prefect imports only once a flow starts: its engines, FastAPI's encoder for the flow's
# parameters, graphviz for its visualisation helpers. Imported while the server starts, they add
# nothing to a run's wall time; at the flow's start they took 0.27 s of a fully cached rerun's 2.3 s.
FLOW_START_MODULES = ("prefect.flow_engine", "prefect.task_engine", "fastapi.encoders", "prefect.utilities.visualization")


def preload_flow_engine() -> None:
    """Import what the flow's start would, while this process only waits for the server."""
    for name in FLOW_START_MODULES:
        importlib.import_module(name)


def start_temporary_server(log_file: Path) -> TemporaryServer | None:
    """Start a temporary server, logging to `log_file`, unless PREFECT_API_URL names one; None then. Prefect is not
    imported first (2 s on two cores): the server's own start (6.5 s) runs beside the loading of the
    flow's modules, and `wait_until_healthy` then consults the rest of Prefect's settings. It is
    stopped at exit, after Prefect's own exit hooks (registered later, so run earlier) have sent
    their last logs."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    server = TemporaryServer(log_file)
    atexit.register(server.stop)
    return server
