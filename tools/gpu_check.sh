#!/usr/bin/env bash
# The one script to run on a GPU machine, in under 5 minutes: the CUDA tests without the simulator
# (both backends against the reference, GPU-direct publish with a concurrent reader counting torn and
# inconsistent reads), nvcc, and `dpboard bench kernels` at R=4096 / 1M pages with the whole GPU
# story (floor, CUDA-event device time, PyTorch inputs and peer, steps, GPU-direct). It writes
# $OUT/gpu_table.md, ready to paste into docs/BENCHMARKS.md, beside summary.txt, the JSON and the logs.
#
#   OUT=/tmp/out tools/gpu_check.sh
#
# It installs nothing from the network. An image with numba, numba-cuda, cupy, msgpack, rich,
# prometheus-client, pytest and hypothesis needs posix-ipc and pyzmq, which travel as wheels in
# .whl/ (git-ignored); a numpy below 2.5 travels there too, for a numba-cuda that cannot compile on
# numpy 2.5 (numba-cuda 0.30.4 fails with "module 'numpy' has no attribute 'row_stack'"): it is
# installed only when numba-cuda reports exactly that. Fetch them on a machine with PyPI access:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl posix-ipc pyzmq 'numpy>=2.2,<2.5'
#
# then copy the tree with .whl/ to the GPU machine and run `OUT=/some/dir bash tools/gpu_check.sh`.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
# The device tool brings back few files from $OUT: logs go to $LOGS and travel as one tarball.
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
    log "installing carried wheels from .whl/ (numpy aside)"
    wheels=$(ls .whl/*.whl | grep -v '/numpy-')
    [ -n "$wheels" ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $wheels >"$LOGS/pip.log" 2>&1 || log "pip install of .whl/ failed (see pip.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# numba-cuda on a numpy it cannot compile with: dpboard reports it as UnavailableError naming the
# fix; take the carried numpy < 2.5 then, and only then.
if "$PY" -c "from dpboard.loads import cuda; cuda.runner('numba-cuda')" 2>"$LOGS/numba_cuda_probe.txt"; then
    log "numba-cuda compiles here"
elif grep -q "row_stack" "$LOGS/numba_cuda_probe.txt" && ls .whl/numpy-*.whl >/dev/null 2>&1; then
    log "numba-cuda cannot compile on this numpy: installing the carried numpy < 2.5"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/numpy-*.whl >>"$LOGS/pip.log" 2>&1 || log "numpy install failed (see pip.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    log "numba-cuda unusable here: $(tail -n 1 "$LOGS/numba_cuda_probe.txt")"
fi
if ! "$PY" -c "import dpboard.board._seqlock, dpboard.controller._dispatch" 2>/dev/null; then
    log "building dpboard's C extensions in place"
    "$PY" -c "from setuptools import setup; setup()" build_ext --inplace >"$LOGS/build.log" 2>&1 \
        || { log "cannot build dpboard (see build.log)"; exit 1; }
fi
"$PY" - >"$LOGS/versions.txt" 2>&1 <<'PYEOF'
import importlib
for m in ("numpy", "numba", "numba_cuda", "cupy", "torch"):
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

log "CUDA tests (real GPU, no simulator) + nvcc + the CuPy stand-ins"
NUMBA_ENABLE_CUDASIM=0 DPBOARD_GPU_CHECK_OUT="$LOGS" timeout 170 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/loads/test_gpu.py tests/loads/test_cuda_sources.py tests/loads/test_cupy_host.py -k "not simulator" \
    --junitxml="$LOGS/pytest-gpu.xml" >"$LOGS/pytest-gpu.log" 2>&1 || status=1
tail -n 15 "$LOGS/pytest-gpu.log" | tee -a "$LOGS/summary.txt"

log "kernel benchmark (R=4096, 1M pages)"
timeout 80 "$PY" tools/bench_kernels.py --quick --requests 4096 --pages 1048576 \
    --json "$LOGS/bench_kernels.json" >"$LOGS/bench_kernels.md" 2>&1 || status=1
cat "$LOGS/bench_kernels.md" | tee -a "$LOGS/summary.txt"

log "host overhead of the cupy step (launch, copy and sync replaced by no-ops)"
timeout 30 "$PY" tools/bench_kernels.py --host-overhead --quick >"$LOGS/host_overhead.md" 2>&1 || status=1
cat "$LOGS/host_overhead.md" | tee -a "$LOGS/summary.txt"

for f in "$LOGS"/gpu_direct_*.json; do
    [ -e "$f" ] && { log "$(basename "$f")"; cat "$f" | tee -a "$LOGS/summary.txt"; echo; cp "$f" "$OUT/"; }
done
{
    echo "**Run:** $(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)," \
         "$("$PY" --version 2>&1); $(tr '\n' ';' < "$LOGS/versions.txt" | sed 's/;$//; s/;/; /g')"
    echo
    echo "CUDA tests: $(tail -n 1 "$LOGS/pytest-gpu.log")"
    echo
    cat "$LOGS/bench_kernels.md"
    echo
    cat "$LOGS/host_overhead.md"
} > "$OUT/gpu_table.md"
log "exit status $status"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
[ -e "$LOGS/bench_kernels.json" ] && cp "$LOGS/bench_kernels.json" "$OUT/"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
exit $status
