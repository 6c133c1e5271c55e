#!/usr/bin/env bash
# The one script to run on a GPU machine: the CUDA tests without the simulator (both backends,
# GPU-direct publish with a concurrent reader counting torn/inconsistent reads), nvcc, and the
# kernel benchmark. Logs and JSON go under "$OUT" (default ./gpu_check_out).
#
#   OUT=/tmp/out tools/gpu_check.sh
#
# It installs nothing from the network: CuPy and numba-cuda come from wheels carried in the tree
# (shared/wheels) when present, else whatever is installed is used.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
status=0
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

log "machine: $(hostname) $(date -u +%FT%TZ)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed (no GPU driver?)"

if [ -d shared/wheels ]; then
    log "installing CUDA extras from shared/wheels"
    "$PY" -m pip install --no-index --find-links shared/wheels cupy-cuda12x numba-cuda >"$OUT/pip.log" 2>&1 \
        || log "pip install from shared/wheels failed (see pip.log); using what is installed"
fi
if ! "$PY" -c "import dpboard._seqlock" 2>/dev/null; then
    log "building dpboard in place"
    "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . >"$OUT/pip-dpboard.log" 2>&1 \
        || { log "cannot build dpboard (see pip-dpboard.log)"; exit 1; }
fi
"$PY" - >"$OUT/versions.txt" 2>&1 <<'PYEOF'
import importlib
for m in ("numpy", "numba", "numba_cuda", "cupy"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "missing:", e)
from dpboard import kernels_cuda
print("cupy usable:", kernels_cuda.cupy_available())
from numba import cuda
print("numba.cuda usable:", cuda.is_available())
PYEOF
cat "$OUT/versions.txt" | tee -a "$OUT/summary.txt"

log "CUDA tests (real GPU, no simulator) + nvcc"
NUMBA_ENABLE_CUDASIM=0 DPBOARD_GPU_CHECK_OUT="$OUT" timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_kernels_gpu.py tests/test_kernels.py -k "not simulator" \
    --junitxml="$OUT/pytest-gpu.xml" >"$OUT/pytest-gpu.log" 2>&1 || status=1
tail -n 15 "$OUT/pytest-gpu.log" | tee -a "$OUT/summary.txt"

log "kernel benchmark"
timeout 300 "$PY" tools/bench_kernels.py --quick --json "$OUT/bench_kernels.json" >"$OUT/bench_kernels.md" 2>&1 \
    || status=1
cat "$OUT/bench_kernels.md" | tee -a "$OUT/summary.txt"

for f in "$OUT"/gpu_direct_*.json; do
    [ -e "$f" ] && { log "$(basename "$f")"; cat "$f" | tee -a "$OUT/summary.txt"; echo; }
done
log "exit status $status"
exit $status
