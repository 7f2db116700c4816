#!/usr/bin/env bash
# Create .venv with a CPU torch and lora_kit (editable) plus everything the tests need.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Torch first and pinned, so that nothing drags in a multi-GB CUDA build on a CPU machine.
# Off a GPU machine the CPU build comes from PyTorch's CPU index (plain PyPI serves the multi-GB CUDA
# build on Linux; `torch==X` then resolves to `X+cpu`). Where that index is unreachable (offline mirrors,
# this project's CI, which has torch on local disk) plain pip is used. On a GPU machine nothing changes:
# set TORCH_SPEC / TORCH_INDEX for your CUDA version (README: "On a rented GPU").
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_ARGS=()
if ! command -v nvidia-smi >/dev/null 2>&1 && .venv/bin/python - "$TORCH_INDEX" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)
PY
then
  TORCH_ARGS=(--extra-index-url "$TORCH_INDEX")
fi
.venv/bin/python -m pip install -q "${TORCH_ARGS[@]}" "$TORCH_SPEC"
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[dev]"
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
# Notebook outputs never reach git: .gitattributes runs notebooks/*.ipynb through this clean filter, so a
# session in JupyterLab leaves the tracked notebooks clean (git status, diff and commits see no outputs).
# JupyterLab without its news toast and update check (offline machines; scripts/jupyterlab_settings.py).
.venv/bin/python scripts/jupyterlab_settings.py >/dev/null
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git config filter.strip-notebook-outputs.clean ".venv/bin/python scripts/strip_notebook_outputs.py"
fi
