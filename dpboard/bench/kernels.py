"""``dpboard bench kernels``: compute_loads per call, every available backend beside the NumPy
reference on the same tables in the same run (the targets of docs/KERNELS.md, "Figures": Numba CPU >= 5x the reference at
R=4096 / 1M pages; CUDA <= 10 µs per call on an H200).

Tables: int8 request states, int32 seqlens, int8 page states, random. A CUDA backend's time is
the whole call: launch, kernel, and the copy of the nine result integers back to the host.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.loads import compute_loads

REQUESTS = (256, 4096, 16384)
PAGES = (65536, 1 << 20)


def time_calls(fn: Callable[[], Any], iterations: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = np.empty(iterations, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(iterations):
        t0 = clock()
        fn()
        samples[i] = clock() - t0
    us = samples / 1e3
    return {"median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)), "n": iterations}


def available_backends() -> list[str]:
    backends = ["numba", "numba-parallel"]
    from dpboard.loads import cuda as kernels_cuda

    try:
        from numba import cuda

        if cuda.is_available() or kernels_cuda.simulator_enabled():
            backends.append("numba-cuda")
    except Exception:  # numba-cuda missing or broken: not available
        pass
    if kernels_cuda.cupy_available():
        backends.append("cupy")
    return backends


def to_device(tables: tuple[np.ndarray, ...], backend: str) -> tuple[Any, ...]:
    if backend == "cupy":
        import cupy

        return tuple(cupy.asarray(t) for t in tables)
    from numba import cuda

    return tuple(cuda.to_device(t) for t in tables)


def run(quick: bool, backends: list[str], page_size: int = 16) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    ref_iters, iters, warmup = (15, 200, 20) if quick else (100, 3000, 200)
    rows = []
    for n_req in REQUESTS:
        for n_pages in PAGES:
            tables = (rng.integers(0, 7, n_req).astype(np.int8), rng.integers(1, 32768, n_req).astype(np.int32),
                      rng.integers(0, 3, n_pages).astype(np.int8))
            expected = compute_loads(*tables, page_size=page_size, backend="numpy")
            ref = time_calls(lambda t=tables: compute_loads(*t, page_size=page_size, backend="numpy"), ref_iters, 2)
            for backend in backends:
                if backend == "numba-parallel":  # every pass on Numba's thread pool, whatever the size
                    from dpboard.loads.cpu import raw_counts

                    res = time_calls(lambda t=tables: raw_counts(*t, req_parallel_min=0, page_parallel_min=0),
                                     iters, warmup)
                    rows.append({"requests": n_req, "pages": n_pages, "backend": backend, **res,
                                 "numpy_median_us": ref["median_us"], "numpy_p99_us": ref["p99_us"],
                                 "speedup": ref["median_us"] / res["median_us"]})
                    continue
                data = tables if backend == "numba" else to_device(tables, backend)
                got = compute_loads(*data, page_size=page_size, backend=backend)
                if got != expected:
                    raise RuntimeError(f"backend {backend!r} disagrees with the reference: {got} != {expected}")
                res = time_calls(lambda d=data, b=backend: compute_loads(*d, page_size=page_size, backend=b),
                                 iters, warmup)
                rows.append({
                    "requests": n_req, "pages": n_pages, "backend": backend, **res,
                    "numpy_median_us": ref["median_us"], "numpy_p99_us": ref["p99_us"],
                    "speedup": ref["median_us"] / res["median_us"],
                })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| requests | pages | backend | median µs | p99 µs | NumPy ref median µs | NumPy ref p99 µs | speed-up (median) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['requests']} | {r['pages']} | {r['backend']} | {r['median_us']:.1f} | {r['p99_us']:.1f} | "
            f"{r['numpy_median_us']:.1f} | {r['numpy_p99_us']:.1f} | {r['speedup']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpboard bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--backends", default="available",
                        help="comma-separated: numba, numba-parallel (raw kernel on every thread), numba-cuda, "
                             "cupy (default: every one available here)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    backends = available_backends() if args.backends == "available" else args.backends.split(",")
    for b in backends:
        if b not in ("numba", "numba-parallel", "numba-cuda", "cupy"):
            raise ValueError(f"unknown backend {b!r}: choose from numba, numba-parallel, numba-cuda, cupy")
    from dpboard.loads import cpu as kernels_cpu

    kernels_cpu.warm_up()  # compile (or load) before anything is timed
    rows = run(args.quick, backends)
    print(f"compute_loads per call ({platform.processor() or platform.machine()}, "
          f"{'quick' if args.quick else 'full'} run; backends: {', '.join(backends)})\n")
    print(markdown(rows))
    target = next((r for r in rows if r["backend"] == "numba" and r["requests"] == 4096 and r["pages"] == 1 << 20), None)
    if target:
        verdict = "meets" if target["speedup"] >= 5 else "misses"
        print(f"\nNumba CPU at R=4096 / 1M pages: {target['speedup']:.1f}x the NumPy reference ({verdict} the 5x target)")
    for r in rows:
        if r["backend"] in ("numba-cuda", "cupy") and r["requests"] == 4096 and r["pages"] == 1 << 20:
            print(f"{r['backend']} at R=4096 / 1M pages: {r['median_us']:.1f} µs median (target <= 10 µs on an H200)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
