#!/usr/bin/env bash
# The README's test command: set up (if needed) and run the fast suite, notebooks included (pyproject's addopts
# leaves out tests marked long / gpu / hub; `bash scripts/test.sh -m long` selects them, docs/development.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# One intra-op thread: tiny models gain nothing from more, and 2 threads on a shared 2-core
# machine were 3-10x slower here (spin-waiting). Override by exporting OMP_NUM_THREADS.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The notebooks execute once per suite in full: tests/test_pipeline.py::test_main_job_on_embedded_default
# runs all five headless through papermill (`lora-kit run`, the README's main job) and checks that every
# cell ran, each notebook's own assert cell included. nbval re-executes only 02_memory_sweeps, ~10 s:
# nbval runs a notebook as a user does (interactive = True, which the headless pipeline turns off) and
# 02 has the only cell that needs it (the PlannerPanel widget displayed in a kernel). 00 and 01 never
# read `interactive`, so nbval ran the same cells with the same values (tests/test_settings.py checks
# parameters cells == Settings defaults); 03 and 04 use it only for progress bars (smoke loop: the CLI
# run in tests/test_distributed.py; evaluate: tests/test_evaluate.py), and nbval of them cost ~120 s.
# --nbval-lax: plotly output is not deterministic text. --durations=15: keep the costs visible.
# -n: the suite is single-threaded work (one OpenMP thread, kernels, subprocesses), so one pytest
# worker per core (xdist, at most 2 by default; PYTEST_WORKERS=0 runs in-process) nearly halves it.
# --dist loadfile keeps each test file in one worker, so the expensive module and session fixtures
# (main job, your-model run, tiny-model story) are still built once: a session fixture used by
# several files would be built once per worker, so each lives in one file.
WORKERS=${PYTEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(2, len(os.sched_getaffinity(0))))")}
XDIST=()
if [ "$WORKERS" -gt 1 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
.venv/bin/python -m pytest tests notebooks/02_memory_sweeps.ipynb --nbval-lax --durations=15 "${XDIST[@]}" "$@"
