"""``dpboard bench kernels``: what computing a rank's loads costs, beside its baselines in one run.

Host side (every machine): ``compute_loads`` per call for each CPU backend beside the NumPy
reference. GPU side (with CuPy and a GPU): the same on CuPy arrays and PyTorch tensors; the
PyTorch peer (the nine counts written in PyTorch, one ``.tolist()``); the floor (a trivial kernel
+ 72-byte copy into pinned memory + stream sync, and a launch alone); the kernel's device time from
CUDA events over back-to-back launches (an empty kernel beside it); ``LoadPublisher.step()``;
GPU-direct host time per step and launch-to-visible in the board. Each GPU row is also given as a
ratio to the floor.

``--host-overhead`` runs the cupy hot path (``LoadPublisher.step()``, GPU-direct included) on
``dpboard.loads.launch.NullDevice``, whose launch, copy and sync do nothing: the per-step Python
cost, measurable on a machine without a GPU (docs/KERNELS.md, "What a step costs").
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.bench.stats import machine_line, topic_parser, write_json
from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.loads import compute_loads
from dpboard.options import count

REQUESTS = (256, 4096, 16384)
PAGES = (65536, 1 << 20)
BACKENDS = ("numba", "numba-parallel", "numba-cuda", "cupy")
TARGET_SIZE = (4096, 1 << 20)  # the size the kernel targets of docs/BENCHMARKS.md are stated for


def time_calls(fn: Callable[[], Any], iterations: int, warmup: int) -> dict[str, float]:
    """Median and p99 of single calls, in µs."""
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


def make_tables(n_req: int, n_pages: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 request states, int32 seqlens, int8 page states, random."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 7, n_req).astype(np.int8), rng.integers(1, 32768, n_req).astype(np.int32),
            rng.integers(0, 3, n_pages).astype(np.int8))


# -- which backends --------------------------------------------------------------------------------

def _numba_cuda_usable() -> bool:
    from dpboard.loads import cuda as loads_cuda

    try:
        from numba import cuda
    except Exception:  # numba-cuda missing or broken
        return False
    try:
        return bool(loads_cuda.simulator_enabled() or cuda.is_available())
    except Exception:  # a CUDA driver that does not load
        return False


def available_backends() -> list[str]:
    from dpboard.loads import cuda as loads_cuda

    found = ["numba", "numba-parallel"]
    if _numba_cuda_usable():
        found.append("numba-cuda")
    if loads_cuda.cupy_available():
        found.append("cupy")
    return found


def resolve_backends(spec: str) -> list[str]:
    """The backends of ``--backends``: a one-line DpboardError for a name that is none, or for a
    backend this machine cannot run."""
    if spec == "available":
        return available_backends()
    chosen = [b.strip() for b in spec.split(",") if b.strip()]
    for b in chosen:
        if b not in BACKENDS:
            raise InvalidInputError(f"--backends: {b!r} is not a backend: choose from {', '.join(BACKENDS)} "
                                    f"(comma-separated), or 'available'")
    from dpboard.loads import cuda as loads_cuda

    if "cupy" in chosen and not loads_cuda.cupy_available():
        raise UnavailableError("--backends cupy: CuPy with a GPU is not available here: install "
                               "the cuda13 or cuda12 extra (pip install -e '.[cuda13]') on a GPU machine, or leave cupy out "
                               "(--host-overhead measures the cupy path's host side without a GPU)")
    if "numba-cuda" in chosen and not _numba_cuda_usable():
        raise UnavailableError("--backends numba-cuda: no CUDA GPU for numba-cuda here: run it on a GPU machine, "
                               "or leave numba-cuda out")
    return chosen


# -- host: compute_loads per backend ---------------------------------------------------------------

def to_device(tables: tuple[np.ndarray, ...], kind: str) -> tuple[Any, ...]:
    if kind == "cupy":
        import cupy

        return tuple(cupy.asarray(t) for t in tables)
    if kind == "torch":
        import torch

        return tuple(torch.from_numpy(t).cuda() for t in tables)
    from numba import cuda

    return tuple(cuda.to_device(t) for t in tables)


def torch_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # no torch, or one without CUDA
        return False


def run(quick: bool, backends: list[str], page_size: int = 16,
        sizes: tuple[tuple[int, ...], tuple[int, ...]] = (REQUESTS, PAGES)) -> list[dict[str, Any]]:
    """compute_loads per call: each backend (and input kind) beside the NumPy reference."""
    ref_iters, iters, warmup = (15, 200, 20) if quick else (100, 3000, 200)
    inputs = [("numba", "host"), ("numba-parallel", "host")]
    for b in ("numba-cuda", "cupy"):
        if b in backends:
            inputs.append((b, "numba" if b == "numba-cuda" else "cupy"))
    if "cupy" in backends and torch_available():
        inputs.append(("cupy", "torch"))
    inputs = [(b, k) for b, k in inputs if b in backends]
    rows = []
    for n_req in sizes[0]:
        for n_pages in sizes[1]:
            tables = make_tables(n_req, n_pages)
            expected = compute_loads(*tables, page_size=page_size, backend="numpy")
            ref = time_calls(lambda t=tables: compute_loads(*t, page_size=page_size, backend="numpy"), ref_iters, 2)
            for backend, kind in inputs:
                if backend == "numba-parallel":  # every pass on Numba's thread pool, whatever the size
                    from dpboard.loads.cpu import raw_counts

                    def fn(t=tables):
                        return raw_counts(*t, req_parallel_min=0, page_parallel_min=0)
                else:
                    data = tables if kind == "host" else to_device(tables, kind)
                    got = compute_loads(*data, page_size=page_size, backend=backend)
                    if got != expected:
                        raise RuntimeError(f"backend {backend!r} on {kind} inputs disagrees with the reference: "
                                           f"{got} != {expected}")

                    def fn(d=data, b=backend):
                        return compute_loads(*d, page_size=page_size, backend=b)
                res = time_calls(fn, iters, warmup)
                rows.append({"requests": n_req, "pages": n_pages, "backend": backend, "inputs": kind, **res,
                             "numpy_median_us": ref["median_us"], "numpy_p99_us": ref["p99_us"],
                             "speedup": ref["median_us"] / res["median_us"]})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| requests | pages | backend | inputs | median µs | p99 µs | NumPy ref median µs | NumPy ref p99 µs "
        "| speed-up (median) |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['requests']} | {r['pages']} | {r['backend']} | {r['inputs']} | {r['median_us']:.1f} | "
            f"{r['p99_us']:.1f} | {r['numpy_median_us']:.1f} | {r['numpy_p99_us']:.1f} | {r['speedup']:.1f}x |"
        )
    return "\n".join(lines)


# -- host overhead: the cupy hot path on NullDevice ------------------------------------------------

def host_overhead(quick: bool, page_size: int = 16) -> list[dict[str, Any]]:
    """Per-step host cost of the cupy path with launch, copy and sync replaced by no-ops, beside the
    board publish every step ends with and the Numba CPU step, measured in the same run."""
    from dpboard.board import Board
    from dpboard.loads import cuda as loads_cuda
    from dpboard.loads.launch import HostBackedTable, NullDevice
    from dpboard.publish import LoadPublisher

    iters, warmup = (20000, 2000) if quick else (200000, 20000)
    tables = make_tables(*TARGET_SIZE)
    dev = tuple(HostBackedTable(t) for t in tables)
    name = f"dpb-bench-kernels-{os.getpid()}"
    rows: list[dict[str, Any]] = []

    def add(what: str, fn: Callable[[], Any]) -> None:
        rows.append({"what": what, **time_calls(fn, iters, warmup)})

    with loads_cuda.runner_override("cupy", loads_cuda.CupyRunner(NullDevice())), \
            Board.create(name, n_slots=4) as board:
        writer = board.writer(0)
        add("board publish alone (writer.publish_values)", lambda: writer.publish_values(1, 2, 3, 4, 5, 6, 7))
        cpu = LoadPublisher(board.writer(1), tables=tables, page_size=page_size, backend="numba")
        add("LoadPublisher.step(), numba (CPU, real kernel)", cpu.step)
        sync = LoadPublisher(board.writer(2), tables=dev, page_size=page_size, backend="cupy")
        add("LoadPublisher.step(), cupy, no-op launch/copy/sync", sync.step)
        moving = LoadPublisher(board.writer(3), tables=lambda: dev, page_size=page_size, backend="cupy")
        add("the same, tables from a callable (same objects)", moving.step)
        add("compute_loads(..., backend='cupy'), same tables again",
            lambda: compute_loads(*dev, page_size=page_size, backend="cupy"))
        direct = LoadPublisher(board.writer(0, takeover=True), tables=dev, page_size=page_size, backend="cupy",
                               gpu_direct=True)
        add("LoadPublisher.step(), cupy GPU-direct, no-op launch", direct.step)
        direct.close()
    return rows


def host_overhead_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| per step (R=4096, 1M pages) | median µs | p99 µs |", "|---|---:|---:|"]
    lines += [f"| {r['what']} | {r['median_us']:.2f} | {r['p99_us']:.2f} |" for r in rows]
    return "\n".join(lines)


# -- GPU: floor, events, PyTorch peer, steps, GPU-direct ------------------------------------------

FLOOR_SOURCE = r'''
extern "C" __global__ void dpb_bench_empty(long long *out) {
    if (out != 0 && threadIdx.x == 1024) out[0] = 0;  // never true: a kernel that does nothing
}
'''


def gpu_story(quick: bool, page_size: int = 16, size: tuple[int, int] = TARGET_SIZE,
              iterations: tuple[int, int, int] | None = None) -> list[dict[str, Any]]:
    """The GPU rows (CuPy and a GPU needed), each with its ratio to the floor. ``iterations``:
    (timed calls, warm-up calls, back-to-back launches per CUDA-event figure)."""
    import cupy

    from dpboard.board import Board
    from dpboard.loads import cuda as loads_cuda
    from dpboard.loads.launch import BLOCK, MEMCPY_DEVICE_TO_HOST, RAW_BYTES
    from dpboard.publish import LoadPublisher

    iters, warmup, back_to_back = iterations or ((1000, 100, 1000) if quick else (3000, 300, 1000))
    rt, driver = cupy.cuda.runtime, cupy.cuda.driver
    tables = make_tables(*size)
    expected = compute_loads(*tables, page_size=page_size, backend="numpy")
    dev = to_device(tables, "cupy")
    rows: list[dict[str, Any]] = []

    def add(what: str, res: dict[str, float]) -> None:
        rows.append({"what": what, **res})

    # The floor: a trivial kernel + the 72-byte copy into pinned memory + a stream sync; a launch alone.
    empty = cupy.RawModule(code=FLOOR_SOURCE).get_function("dpb_bench_empty")
    empty_fn = int(empty.kernel.ptr)
    binding = loads_cuda.runner("cupy").prepare(*dev)
    stream = binding._stream
    params = ctypes_pointer_array(binding._raw_dev)
    raw_dev, raw_host = binding._raw_dev, binding._raw_host

    def floor() -> None:
        driver.launchKernel(empty_fn, 1, 1, 1, 32, 1, 1, 0, stream, params.address, 0)
        rt.memcpyAsync(raw_host, raw_dev, RAW_BYTES, MEMCPY_DEVICE_TO_HOST, stream)
        rt.streamSynchronize(stream)

    def launch_alone() -> None:
        driver.launchKernel(empty_fn, 1, 1, 1, 32, 1, 1, 0, stream, params.address, 0)
        rt.streamSynchronize(stream)

    add("floor: trivial kernel + 72-byte pinned copy + stream sync", time_calls(floor, iters, warmup))
    add("launch alone (trivial kernel + sync)", time_calls(launch_alone, iters, warmup))

    # Device time from CUDA events over back-to-back launches.
    def event_time(launch: Callable[[], None]) -> dict[str, float]:
        start, end = rt.eventCreateWithFlags(0), rt.eventCreateWithFlags(0)
        try:
            launch()
            rt.streamSynchronize(stream)
            rt.eventRecord(start, stream)
            for _ in range(back_to_back):
                launch()
            rt.eventRecord(end, stream)
            rt.eventSynchronize(end)
            per = rt.eventElapsedTime(start, end) * 1e3 / back_to_back
        finally:
            rt.eventDestroy(start)
            rt.eventDestroy(end)
        return {"median_us": per, "p99_us": None, "n": back_to_back}  # one figure: the mean of the launches

    p = binding.prepared
    add(f"dpb_raw_counts device time, CUDA events ({p.grid} blocks of {BLOCK})",
        event_time(lambda: driver.launchKernel(p.function, p.grid, 1, 1, BLOCK, 1, 1, 0, stream, p.args.address, 0)))
    add("empty kernel device time, CUDA events",
        event_time(lambda: driver.launchKernel(empty_fn, 1, 1, 1, 32, 1, 1, 0, stream, params.address, 0)))

    add("compute_loads, CuPy arrays", time_calls(lambda: compute_loads(*dev, page_size=page_size, backend="cupy"),
                                                 iters, warmup))
    if torch_available():
        tdev = to_device(tables, "torch")
        add("compute_loads, PyTorch tensors",
            time_calls(lambda: compute_loads(*tdev, page_size=page_size, backend="cupy"), iters, warmup))
        peer = torch_peer(tdev)
        if peer() != torch_expected(tables):
            raise RuntimeError("the PyTorch peer disagrees with the reference")
        add("PyTorch peer: the nine counts in PyTorch, one .tolist()", time_calls(peer, iters, warmup))
    with Board.create(f"dpb-bench-gpu-{os.getpid()}", n_slots=2) as board:
        pub = LoadPublisher(board, 0, dev, page_size=page_size, backend="cupy")
        if pub.step() != expected:
            raise RuntimeError("LoadPublisher.step() on the GPU disagrees with the reference")
        add("LoadPublisher.step(), cupy, synchronous", time_calls(pub.step, iters, warmup))
        if "numba-cuda" in available_backends():
            ndev = to_device(tables, "numba")
            npub = LoadPublisher(board.writer(1), tables=ndev, page_size=page_size, backend="numba-cuda")
            add("LoadPublisher.step(), numba-cuda, synchronous", time_calls(npub.step, iters, warmup))
        for backend, inputs in (("cupy", dev), ("numba-cuda", None)):
            if backend == "numba-cuda":
                if "numba-cuda" not in available_backends():
                    continue
                inputs = to_device(tables, "numba")
            direct = LoadPublisher(board.writer(0, takeover=True), tables=inputs, page_size=page_size,
                                   backend=backend, gpu_direct=True)
            add(f"GPU-direct step() host time, {backend}", time_calls(direct.step, iters, warmup))
            direct.synchronize()
            add(f"GPU-direct launch to visible in the board, {backend}",
                launch_to_visible(direct, board, iters // 2))
            direct.close()
    floor_us = rows[0]["median_us"]
    for r in rows:
        r["vs_floor"] = r["median_us"] / floor_us
    return rows


def ctypes_pointer_array(address: int) -> Any:
    """The packed single argument of the floor's kernel (a pointer)."""
    from dpboard.loads.launch import KernelArgs

    args = KernelArgs(("out",))
    args.set(out=address)
    return args


def launch_to_visible(publisher: Any, board: Any, n: int) -> dict[str, float]:
    """From just before ``step()`` to the slot's publish_seq moving, read from the host (bounded wait)."""
    reader = board.reader()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        before = reader.read(0).publish_seq
        t0 = clock()
        publisher.step()
        deadline = t0 + 1_000_000_000
        while True:
            snap = reader.read(0)
            now = clock()
            if snap is not None and snap.publish_seq != before:
                samples.append(now - t0)
                break
            if now > deadline:
                raise RuntimeError("a GPU-direct publish did not become visible within 1 s")
    us = np.array(samples) / 1e3
    return {"median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)), "n": n}


def torch_peer(tdev: tuple[Any, Any, Any]) -> Callable[[], list[int]]:
    """What an engine developer would write in PyTorch: bincounts and masked sums, one .tolist()."""
    import torch

    state, seqlen, pages = tdev

    def peer() -> list[int]:
        s = state.long()
        per_state = torch.bincount(s.clamp(0, 7), minlength=8)
        queued = (s >= 2) & (s <= 6)
        seq = seqlen.long()
        without_kv = torch.where(queued & (s != 5), seq, 0).sum()
        awaiting = torch.where((s == 4) | (s == 5), seq, 0).sum()
        per_page = torch.bincount(pages.long().clamp(0, 3), minlength=4)
        out = torch.stack([per_state[1], per_state[2:7].sum(), without_kv, awaiting, per_page[0], per_page[2]])
        return out.tolist()

    return peer


def torch_expected(tables: tuple[np.ndarray, ...]) -> list[int]:
    from dpboard.loads.reference import raw_counts_numpy

    return raw_counts_numpy(*tables)[:6].tolist()


def gpu_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| R=4096, 1M int8 pages, page_size 16 | median µs | p99 µs | × floor |", "|---|---:|---:|---:|"]
    for r in rows:
        p99 = "-" if r["p99_us"] is None else f"{r['p99_us']:.1f}"
        lines.append(f"| {r['what']} | {r['median_us']:.1f} | {p99} | {r['vs_floor']:.2f} |")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = topic_parser("kernels", __doc__, "fewer iterations (a smoke run)")
    p.add_argument("--backends", default="available",
                   help="comma-separated: numba, numba-parallel (raw kernel on every thread), numba-cuda, cupy "
                        "(default: every one available here)")
    p.add_argument("--host-overhead", action="store_true",
                   help="only the cupy path's per-step host cost, launch/copy/sync replaced by no-ops (no GPU needed)")
    p.add_argument("--requests", type=count(0, 1 << 30), nargs="+", default=list(REQUESTS),
                   help="request rows to measure (default 256 4096 16384)")
    p.add_argument("--pages", type=count(1, 1 << 30), nargs="+", default=list(PAGES),
                   help="KV pages to measure (default 65536 1048576)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result: dict[str, Any] = {"machine": machine_line(), "quick": bool(args.quick)}
    if args.host_overhead:
        rows = host_overhead(args.quick)
        result["host_overhead"] = rows
        print(f"cupy hot path, launch/copy/sync replaced by no-ops ({machine_line()})\n")
        print(host_overhead_markdown(rows))
    else:
        backends = resolve_backends(args.backends)
        from dpboard.loads import cpu as kernels_cpu

        kernels_cpu.warm_up()  # compile (or load) before anything is timed
        rows = run(args.quick, backends, sizes=(tuple(args.requests), tuple(args.pages)))
        result["compute_loads"] = rows
        print(f"compute_loads per call ({machine_line()}; {'quick' if args.quick else 'full'} run; "
              f"backends: {', '.join(backends)})\n")
        print(markdown(rows))
        target = next((r for r in rows if r["backend"] == "numba" and (r["requests"], r["pages"]) == TARGET_SIZE),
                      None)
        if target:
            verdict = "meets" if target["speedup"] >= 5 else "misses"
            print(f"\nNumba CPU at R=4096 / 1M pages: {target['speedup']:.1f}x the NumPy reference "
                  f"({verdict} the 5x target)")
        if "cupy" in backends:
            gpu = gpu_story(args.quick)
            result["gpu"] = gpu
            print("\nThe GPU path beside its floor (one run)\n")
            print(gpu_markdown(gpu))
    write_json(args.json, result)
    return 0
