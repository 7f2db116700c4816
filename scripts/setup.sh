#!/usr/bin/env bash
# Create .venv with a CPU torch and lora_kit (editable) plus everything the tests need.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Torch first and pinned, so that nothing drags in a multi-GB CUDA build on a CPU machine.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[dev]"
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
