#!/usr/bin/env bash
# The Python packages a GPU session carries (scripts/gpu_session.sh installs them there), fetched into .whl/ here.
#
# The GPU machine (python3 3.12, torch 2.11 cu130, transformers 5.17, accelerate 1.15, no network) lacks
# bitsandbytes, peft and the notebook stack that `lora-kit run` needs (papermill, ipykernel, nbconvert, plotly,
# ipywidgets, anywidget and what they need that the machine does not have). Versions are the ones CI runs
# (scripts/constraints.txt) and this checkout's .venv holds; one version of each.
# - transformers 5.24 is carried too: the version CI, the golden figures and the shipped memory-model fits were
#   made with (the machine's 5.17 is above the kit's floor; --without-transformers leaves it in place).
# - bitsandbytes' wheel holds native libraries for CUDA 11.8 to 13.2, ROCm and XPU, too large to carry beside the
#   rest; its CPU and CUDA 13.0 libraries are kept, the same version: torch cu130 loads libbitsandbytes_cuda130.so
#   (bitsandbytes loads the newest CUDA 13 library not above torch's CUDA, so any cu13x torch would too).
# - .whl/fits/: the memory-model fits the session would otherwise make on the spot (scripts/gpu_session.py fits),
#   made with this checkout's Python (KIT_PYTHON, default .venv/bin/python); --no-fits skips them.
# Ends with the size of what a session sends (tracked and untracked files + .whl) against the device's limit.
#
#   bash scripts/gpu_wheels.sh [--without-transformers] [--no-fits]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KIT_PY=${KIT_PYTHON:-.venv/bin/python}
LIMIT_MIB=64
WITH_TRANSFORMERS=1 FITS=1
for arg in "$@"; do
  case "$arg" in
    --without-transformers) WITH_TRANSFORMERS=0 ;;
    --no-fits) FITS=0 ;;
    *) echo "usage: bash scripts/gpu_wheels.sh [--without-transformers] [--no-fits]" >&2; exit 2 ;;
  esac
done

WHEELS=(
  bitsandbytes==0.50.2 peft==0.21.2
  # the notebook stack: lora-kit run executes notebooks with papermill on an ipykernel, exports HTML, plots with plotly
  papermill==2.7.0 nbclient==0.11.0 nbformat==5.11.1 nbconvert==7.17.2 ipykernel==7.4.0 ipython==9.19.1
  jupyter-client==8.10.0 jupyter-core==5.9.1 plotly==7.1.0 ipywidgets==8.1.9 anywidget==0.11.0
  widgetsnbextension==4.0.16 jupyterlab-widgets==3.0.17 psygnal==0.16.1 comm==0.2.3 traitlets==5.16.1
  pyzmq==27.3.0 tornado==6.6.1 debugpy==1.8.22 nest-asyncio2==1.7.4 matplotlib-inline==0.2.2 platformdirs==4.14.9
  entrypoints==0.4.2 tenacity==9.2.1 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 jedi==0.20.1 parso==0.8.7 prompt-toolkit==3.0.53 wcwidth==0.9.5
  pexpect==4.9.0 ptyprocess==0.7.0 stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0 pure-eval==0.2.4
  ipython-pygments-lexers==1.1.1 beautifulsoup4==4.15.0 soupsieve==4.1.4 bleach==6.4.0 webencodings==0.6.1
  tinycss2==1.5.1 mistune==3.4.0 defusedxml==0.7.1 pandocfilters==1.5.1 jupyterlab-pygments==0.3.0
)
[ "$WITH_TRANSFORMERS" = 1 ] && WHEELS+=(transformers==5.24.0)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl
mkdir -p .whl
echo "fetching ${#WHEELS[@]} wheels for python 3.12 x86-64 into .whl/"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl "${WHEELS[@]}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
[ "$(ls .whl/*.whl | wc -l)" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels in .whl/" >&2; exit 1; }

# bitsandbytes: the same wheel with only its CPU and CUDA 13.0 libraries (its RECORD rewritten to match)
"$PY" - .whl/bitsandbytes-*.whl <<'EOF'
import re, sys, zipfile
from pathlib import Path
src = Path(sys.argv[1])
keep = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")
drop = lambda n: re.search(r"libbitsandbytes_\w+\.so$", n) and not keep.search(n)  # noqa: E731
tmp = src.with_suffix(".trim")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if drop(item.filename):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True) if not drop(l.split(",")[0])).encode()
        zout.writestr(item, data)
before = src.stat().st_size
tmp.replace(src)
print(f"bitsandbytes: kept {sorted(n.split('/')[-1] for n in zipfile.ZipFile(src).namelist() if keep.search(n))}, "
      f"{before / 2**20:.1f} -> {src.stat().st_size / 2**20:.1f} MiB")
EOF

"$PY" scripts/gpu_session.py wheels-check .whl

if [ "$FITS" = 1 ] && ! [ -x "$KIT_PY" ]; then
  echo "no fits: $KIT_PY is not there (set KIT_PYTHON to the kit's python); the session will fit on the spot"
  FITS=0
fi
if [ "$FITS" = 1 ]; then
  have=$("$KIT_PY" -c "import transformers; print(transformers.__version__)")
  if [ "$WITH_TRANSFORMERS" = 1 ] && [ "$have" != 5.24.0 ]; then
    echo "note: $KIT_PY has transformers $have, the session 5.24.0: fits may be keyed differently there"
  fi
  echo "making the memory-model fits the session would make (minutes on 2 cores)"
  HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$KIT_PY" scripts/gpu_session.py fits .whl/fits
fi

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
  awk '{s+=$1} END {print s+0}')
whl=$(find .whl -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
awk -v t="$tree" -v w="$whl" -v l="$LIMIT_MIB" 'BEGIN {
  printf "sent to the GPU machine: tree %.1f MiB + .whl %.1f MiB = %.1f MiB of %d MiB\n", t/2^20, w/2^20, (t+w)/2^20, l;
  exit ((t + w) / 2^20 > l) }' || { echo "over the limit: carry less" >&2; exit 1; }
