"""The temporary Prefect server's process: uvicorn's command line, with Prefect's server modules
loaded first and Python's cyclic garbage collector off while they load.

Loading them is most of the server's start (5 s on two cores), and the run waits for it. The
collector finds no garbage among modules being defined, yet scans the growing heap again and again
(634 collections). With it off, and the flow engine preloaded meanwhile (`tasks.temporary_server`),
a fully cached rerun took 9.5 s instead of 11.0 (`python bench/cached_rerun.py`). Frozen
afterwards, what was loaded is never scanned again; the collector is back on before the server serves.

    python -m tasks.server_process <uvicorn's arguments>
"""

from __future__ import annotations

import gc


def main() -> None:
    gc.disable()
    import prefect.server.api.server  # noqa: F401  (the module of the app factory uvicorn is told to call)
    import uvicorn.main

    gc.freeze()
    gc.enable()
    uvicorn.main.main()


if __name__ == "__main__":
    main()
