"""The CUDA sources and kernels where no GPU is needed: nvcc builds every kernels/*.cu for sm_90,
the package ships them, and the numba-cuda kernels pass their tests in Numba's CUDA simulator."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted((ROOT / "kernels").glob("*.cu"))


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/bin/nvcc"), Path("/usr/local/cuda/bin/nvcc")) if p.exists()), None
    )


def test_there_are_cuda_sources():
    assert CU_FILES, "kernels/ holds no .cu file"


@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_nvcc_compiles_for_sm90(source, tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed here (the CUDA toolkit is needed for this check)")
    cubin = tmp_path / (source.stem + ".cubin")
    result = subprocess.run(
        [nvcc, "-arch=sm_90", "-cubin", "-DDPBOARD_INSTANTIATE", "-Werror", "all-warnings", "-o", str(cubin),
         str(source)],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert cubin.stat().st_size > 0
    # The instantiated kernels are really in the binary.
    names = cubin.read_bytes()
    assert b"dpb_raw_counts" in names and b"dpb_publish" in names


def test_the_package_ships_the_cuda_source():
    from dpboard.loads.cuda import cuda_source

    assert cuda_source() == (ROOT / "kernels" / "loads.cu").read_text()


def test_numba_cuda_kernels_in_the_simulator():
    """tests/cudasim in its own interpreter: the simulator must be chosen before numba is imported."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "loads" / "cudasim")],
        capture_output=True, text=True, timeout=280, env=env, cwd=ROOT,
    )
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "failed" not in result.stdout and "skipped" not in result.stdout, tail


HOST_PROGRAM = r"""
// The counting rules of kernels/loads.cu, run on the host (they are __host__ __device__): the whole
// tables split over `stride` threads as a launch splits them, each thread's 16-byte chunks and
// left-over entries, with the tables placed `offset` entries past an aligned address (offset 0:
// the vector path; otherwise the entry-by-entry one for every table it misaligns).
#include "loads.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>

template <typename T> std::vector<T> load(const char *path, long long n, int offset) {
    std::vector<T> v(n + offset + 1);
    FILE *f = fopen(path, "rb");
    if (!f || (n > 0 && fread(v.data() + offset, sizeof(T), n, f) != (size_t)n)) exit(3);
    fclose(f);
    return v;
}

template <typename S, typename L, typename P> int run(char **argv) {
    long long n_req = atoll(argv[2]), n_pages = atoll(argv[3]), stride = atoll(argv[7]);
    int offset = atoi(argv[8]);
    std::vector<S> state = load<S>(argv[4], n_req, offset);
    std::vector<L> seqlen = load<L>(argv[5], n_req, offset);
    std::vector<P> pages = load<P>(argv[6], n_pages, offset);
    i64 total[DPB_NUM_RAW] = {0};
    for (long long first = 0; first < stride; first++) {
        DpbAcc acc;
        i64 raw[DPB_NUM_RAW];
        dpb_count_range(state.data() + offset, seqlen.data() + offset, n_req, pages.data() + offset, n_pages,
                        first, stride, acc);
        dpb_acc_raw(acc, raw);
        for (int k = 0; k < DPB_NUM_RAW; k++) total[k] += raw[k];
    }
    for (int k = 0; k < DPB_NUM_RAW; k++) printf("%lld\n", total[k]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 9) return 2;
    switch (atoi(argv[1])) {
        case 0: return run<signed char, long long, signed char>(argv);
        case 1: return run<int, int, int>(argv);
        case 2: return run<unsigned char, unsigned int, unsigned char>(argv);
        case 3: return run<long long, short, unsigned short>(argv);
    }
    return 2;
}
"""
HOST_DTYPES = [(np.int8, np.int64, np.int8), (np.int32, np.int32, np.int32), (np.uint8, np.uint32, np.uint8),
               (np.int64, np.int16, np.uint16)]


@pytest.fixture(scope="module")
def host_counter(tmp_path_factory):
    """kernels/loads.cu's counting rules compiled by nvcc for the host: no GPU needed to run them."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed here (the CUDA toolkit is needed for this check)")
    d = tmp_path_factory.mktemp("host_counter")
    (d / "main.cu").write_text(HOST_PROGRAM)
    binary = d / "count"
    result = subprocess.run([nvcc, "-std=c++17", "-I", str(ROOT / "kernels"), "-o", str(binary), str(d / "main.cu")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    return binary, d


def host_raw(host_counter, kind, state, seqlen, pages, stride=1, offset=0) -> list[int]:
    binary, d = host_counter
    paths = []
    for name, arr in (("state", state), ("seqlen", seqlen), ("pages", pages)):
        path = d / f"{name}.bin"
        path.write_bytes(np.ascontiguousarray(arr).tobytes())
        paths.append(str(path))
    out = subprocess.run([str(binary), str(kind), str(len(state)), str(len(pages)), *paths, str(stride), str(offset)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("kind", range(len(HOST_DTYPES)))
def test_cuda_c_counts_like_the_reference_seqlen_bounds_included(host_counter, kind):
    """The same tables through the CUDA C counting rules and the NumPy reference: equal raw counters,
    out-of-range seqlens (the overflow guard) and bad codes included."""
    from dpboard.loads.reference import raw_counts_numpy
    from dpboard.snapshot import MAX_SEQLEN

    s_dt, l_dt, p_dt = HOST_DTYPES[kind]
    rng = np.random.default_rng(kind)
    n = 3000
    state = rng.integers(-1, 8, n).astype(s_dt) if np.dtype(s_dt).kind == "i" else rng.integers(0, 8, n).astype(s_dt)
    info = np.iinfo(l_dt)
    seqlen = rng.integers(0, 5000, n).astype(l_dt)
    edges = [v for v in (-1, MAX_SEQLEN, MAX_SEQLEN + 1, 2**62, info.max, info.min) if info.min <= v <= info.max]
    seqlen[: len(edges)] = edges
    pages = rng.integers(0, 4, 5000).astype(p_dt)
    expected = raw_counts_numpy(state, seqlen, pages).tolist()
    assert host_raw(host_counter, kind, state, seqlen, pages) == expected
    # split over threads as a launch splits it; aligned (16-byte chunks) and misaligned (entry by entry)
    for stride, offset in ((7, 0), (64, 0), (5, 1), (33, 3)):
        assert host_raw(host_counter, kind, state, seqlen, pages, stride, offset) == expected, (stride, offset)
    # every state with a seqlen past the bound: counted bad, summed nowhere
    if info.max > MAX_SEQLEN:
        state = np.arange(7).astype(s_dt)
        seqlen = np.full(7, 2**62, l_dt)
        got = host_raw(host_counter, kind, state, seqlen, np.zeros(1, p_dt))
        assert got == raw_counts_numpy(state, seqlen, np.zeros(1, p_dt)).tolist()
        assert got[8] == 6 and got[2] == got[3] == 0
