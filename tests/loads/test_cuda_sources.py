"""The CUDA sources and kernels where no GPU is needed: nvcc builds every kernels/*.cu for sm_90,
the package ships them, and the numba-cuda kernels pass their tests in Numba's CUDA simulator."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
