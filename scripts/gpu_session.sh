#!/usr/bin/env bash
# One call on a GPU machine gathers what the memory model's open questions need, with no debugging there.
#
# Prepared here by `bash scripts/gpu_wheels.sh` (.whl/: the packages the machine lacks, and memory-model fits);
# run there from the repository root, carrying .whl (docs/development.md, "A GPU session in one call"):
#
#   bash scripts/gpu_session.sh           # on the GPU machine; about 7-8 minutes, never past DEADLINE_S
#   bash scripts/gpu_session.sh --cpu     # the same steps on a CPU, tiny (checks the script, not the GPU)
#
# Steps, each under its own time limit so that one failure or overrun leaves the others their results:
#  1. install .whl/*.whl into /tmp/site (pip --no-index --no-deps --target)
#  2. env.json: nvidia-smi, versions, torch.cuda.mem_get_info, bitsandbytes' library, the carried wheels' needs
#  3. smoke_run.tar.gz: `lora-kit run` (00, 03, 04) of QLoRA on qwen2.5-0.5b's shapes with random weights, on CUDA
#  4. gpu_matmul_probe.json: the time model's matmuls (LoRA's narrow fp32 ones at few tokens) against CUDA's, with
#     the kernels cuBLAS picks (split-K or not: benchmarks/gpu_matmul_probe.py)
#  5. gpu_validate_expandable.json: a few configs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#  6. gpu_validate.json: benchmarks/gpu_validate.py under PyTorch's default allocator, every config in priority order
#     (VALIDATE_ORDER) until the time left is spent
#  7. session.log (everything printed) and extras.tar.gz (nvidia-smi -q, pip list, the fits used and made)
# Everything lands in $OUT (at most 8 files come back); nothing is written outside $WORK, $SITE, $OUT and /tmp.
set -u
cd "$(dirname "$0")/.."
CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
PY=${PYTHON:-python3}
WHL=${WHL:-.whl}
WORK=${WORK:-/tmp/gpu_session}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-$WORK/out}
DEADLINE_S=${DEADLINE_S:-500}  # the whole script, packing included (the device's call limit is 600 s)
# every config, the newest questions first: the cut 65B / MoE / MLA steps, then QLoRA, LoRA, full fine-tuning
VALIDATE_ORDER="4L,2L,qlora,lora,full"
# again under expandable segments: long rows with checkpointing, long-row QLoRA, and the paged 65B paper step
EXPANDABLE_ONLY="llama1b lora ckpt s4096 b2,qwen0.5b qlora ckpt s8192,llama-65b 4L"

for d in "$WORK" "$SITE"; do
  case "$d" in /tmp/?*) ;; *) echo "WORK and SITE must be folders under /tmp (they are emptied): $d" >&2; exit 2 ;; esac
done
rm -rf "$WORK" "$SITE"
mkdir -p "$WORK/home" "$WORK/tmp" "$WORK/fits" "$WORK/extras" "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HOME="$WORK/home" XDG_CACHE_HOME="$WORK/home/.cache" TMPDIR="$WORK/tmp" MPLCONFIGDIR="$WORK/home/.mpl"
export LORA_KIT_FITS="$WORK/fits" PYTHONPATH="$SITE:$PWD" JUPYTER_PATH="$SITE/share/jupyter"  # nbconvert templates
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
LOG="$OUT/session.log"
T0=$SECONDS

log() { echo "$(date +%H:%M:%S) [+$((SECONDS - T0))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE_S - (SECONDS - T0))); }
# step NAME CAP RESERVE CMD...: CMD under a limit of CAP seconds, or less so that RESERVE seconds stay for what
# follows; its output to the terminal and session.log; a failure is logged and the script goes on
step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local t=$(($(left) - reserve))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 15 ]; then
    log "$name: SKIPPED ($(left) s left of $DEADLINE_S)"
    return 0
  fi
  local cmd="$*"
  [ ${#cmd} -gt 300 ] && cmd="${cmd:0:300} ..."
  log "$name: start (limit $t s): $cmd"
  timeout -k 20 "$t" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "$name: end, rc $rc$([ "$rc" = 124 ] && echo ' (time limit)')"
}

log "gpu_session ($([ $CPU = 1 ] && echo cpu || echo gpu)) in $PWD at $(git rev-parse --short HEAD 2>/dev/null);" \
    "deadline $DEADLINE_S s; OUT=$OUT"
step install 120 0 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$WHL"/*.whl
cp "$WHL"/fits/*.json.gz "$WORK/fits/" 2>/dev/null
log "fits carried: $(ls "$WORK/fits" | wc -l)"
step env 60 0 "$PY" scripts/gpu_session.py env --out "$OUT/env.json" --site "$SITE"

if [ $CPU = 1 ]; then
  VALIDATE=(--cpu-dry-run)
  EXPANDABLE=(--cpu-dry-run --only tiny-llama)
  SMOKE=(--cpu)
  PROBE=(--cpu --repeat 3)
else
  VALIDATE=(--only "$VALIDATE_ORDER")
  EXPANDABLE=(--only "$EXPANDABLE_ONLY")
  SMOKE=()
  PROBE=()
fi
# bounded steps first, then gpu_validate under the default allocator until the deadline: its --budget-s leaves 45 s
# of its share for the process's start and the last config, which may start just before the budget ends
t=$(($(left) - 250))
[ "$t" -gt 150 ] && t=150
step smoke "$t" 250 "$PY" scripts/gpu_session.py smoke --runs-dir "$WORK/runs" --out "$OUT" --timeout $((t - 40)) \
  "${SMOKE[@]}"
step matmul_probe 60 200 "$PY" benchmarks/gpu_matmul_probe.py --out "$OUT/gpu_matmul_probe.json" "${PROBE[@]}"
t=$(($(left) - 160))
[ "$t" -gt 100 ] && t=100
step gpu_validate_expandable "$t" 160 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" \
  benchmarks/gpu_validate.py --out "$OUT/gpu_validate_expandable.json" --budget-s $((t - 50 > 20 ? t - 50 : 20)) \
  "${EXPANDABLE[@]}"
t=$(($(left) - 10))
step gpu_validate "$t" 10 "$PY" benchmarks/gpu_validate.py --out "$OUT/gpu_validate.json" \
  --budget-s $((t - 45 > 20 ? t - 45 : 20)) "${VALIDATE[@]}"

log "packing"
{
  nvidia-smi -q -d MEMORY,CLOCK,PERFORMANCE >"$WORK/extras/nvidia-smi-q.txt" 2>&1
  "$PY" -m pip list --format=freeze >"$WORK/extras/pip-list.txt" 2>&1
  cp -r "$WORK/fits" "$WORK/extras/fits"
  tar -czf "$OUT/extras.tar.gz" -C "$WORK" extras
} 2>&1 | tee -a "$LOG"
rm -f "$OUT"/.*.tmp
log "done in $((SECONDS - T0)) s; in $OUT: $(cd "$OUT" && ls -s --block-size=K | tr '\n' ' ')"
