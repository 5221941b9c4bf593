#!/usr/bin/env bash
# Register with the Prefect server at PREFECT_API_URL: the process work pool, the GPU concurrency
# limit (GPU hosts only) and every deployment in prefect.yaml. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
POOL=eagle3
.venv/bin/prefect work-pool inspect "$POOL" >/dev/null 2>&1 || .venv/bin/prefect work-pool create "$POOL" --type process
.venv/bin/eagle3 gpu-limit || [ $? -eq 2 ]  # 2: no GPU here, which it says; CPU runs claim no GPU slots
.venv/bin/prefect --no-prompt deploy --all
