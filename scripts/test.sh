#!/usr/bin/env bash
# The README's test command: set up (if needed) and run every test, notebooks included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# One intra-op thread: tiny models gain nothing from more, and 2 threads on a shared 2-core
# machine were 3-10x slower here (spin-waiting). Override by exporting OMP_NUM_THREADS.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# tests/ plus every notebook executed by nbval (plotly output is not deterministic text: --nbval-lax)
.venv/bin/python -m pytest tests notebooks --nbval-lax "$@"
