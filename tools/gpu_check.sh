#!/usr/bin/env bash
# The one script to run on a GPU machine: the CUDA tests without the simulator (both backends,
# GPU-direct publish with a concurrent reader counting torn/inconsistent reads), nvcc, and the
# kernel benchmark. Logs and JSON go under "$OUT" (default ./gpu_check_out).
#
#   OUT=/tmp/out tools/gpu_check.sh
#
# It installs nothing from the network. The H200 image it is written for (python3 3.12) already has numba,
# numba-cuda, cupy, msgpack, rich, prometheus-client, pytest and hypothesis; posix_ipc and pyzmq travel
# as wheels in .whl/ (git-ignored). Fetch them on a machine with PyPI access:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl posix-ipc pyzmq
#
# then copy the tree with .whl/ to the GPU machine and run `OUT=/some/dir bash tools/gpu_check.sh`.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
# The device tool brings back at most 8 files from $OUT: logs go to $LOGS and travel as one tarball.
LOGS="$(mktemp -d /tmp/gpu_check_logs.XXXXXX)"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import numpy" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
status=0
log() { echo "== $*" | tee -a "$LOGS/summary.txt"; }

log "machine: $(hostname) $(date -u +%FT%TZ) python: $("$PY" --version 2>&1)"
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed (no GPU driver?)"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    log "installing carried wheels from .whl/"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >"$LOGS/pip.log" 2>&1 || log "pip install of .whl/ failed (see pip.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import dpboard.board._seqlock, dpboard.controller._dispatch" 2>/dev/null; then
    log "building dpboard's C extensions in place"
    "$PY" -c "from setuptools import setup; setup()" build_ext --inplace >"$LOGS/build.log" 2>&1 \
        || { log "cannot build dpboard (see build.log)"; exit 1; }
fi
"$PY" - >"$LOGS/versions.txt" 2>&1 <<'PYEOF'
import importlib
for m in ("numpy", "numba", "numba_cuda", "cupy"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "missing:", e)
from dpboard.loads import cuda as loads_cuda
print("cupy usable:", loads_cuda.cupy_available())
from numba import cuda
print("numba.cuda usable:", cuda.is_available())
PYEOF
cat "$LOGS/versions.txt" | tee -a "$LOGS/summary.txt"

log "CUDA tests (real GPU, no simulator) + nvcc"
NUMBA_ENABLE_CUDASIM=0 DPBOARD_GPU_CHECK_OUT="$LOGS" timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/loads/test_gpu.py tests/loads/test_cuda_sources.py -k "not simulator" \
    --junitxml="$LOGS/pytest-gpu.xml" >"$LOGS/pytest-gpu.log" 2>&1 || status=1
tail -n 15 "$LOGS/pytest-gpu.log" | tee -a "$LOGS/summary.txt"

log "kernel benchmark"
timeout 180 "$PY" tools/bench_kernels.py --quick --json "$LOGS/bench_kernels.json" >"$LOGS/bench_kernels.md" 2>&1 \
    || status=1
cat "$LOGS/bench_kernels.md" | tee -a "$LOGS/summary.txt"

for f in "$LOGS"/gpu_direct_*.json; do
    [ -e "$f" ] && { log "$(basename "$f")"; cat "$f" | tee -a "$LOGS/summary.txt"; echo; cp "$f" "$OUT/"; }
done
log "exit status $status"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
[ -e "$LOGS/bench_kernels.json" ] && cp "$LOGS/bench_kernels.json" "$OUT/"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
exit $status
