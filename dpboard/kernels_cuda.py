"""The CUDA backends of ``compute_loads`` and the GPU-direct publish (docs/KERNELS.md).

Two implementations of one design (a single pass over both tables, block reduction, one atomic per
counter per block, the last block finishes):

- ``numba-cuda``: ``@cuda.jit`` kernels written in Python. They also run in Numba's CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``), which is how the test suite checks them on machines without a GPU.
- ``cupy``: the CUDA C of ``kernels/loads.cu`` (shipped as the package ``dpboard.cuda_sources``),
  compiled by NVRTC through ``cupy.RawModule``, one instantiation per dtype combination.

Only the nine raw counters cross to the host (``compute_loads``), or nothing at all: the GPU-direct
publishers launch a kernel whose last block writes the snapshot into the board slot itself, through
the slot's page registered as mapped host memory (``cudaHostRegister``), seqlock included.

Nothing here is imported until a CUDA backend is asked for; CuPy and a GPU are optional.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from importlib import resources
from typing import Any

import numpy as np

from dpboard.loads import NUM_RAW, array_info

BLOCK = 256  # threads per block on a GPU (a multiple of 32, a power of two)
SIM_BLOCK = 32  # in the simulator every thread is a Python thread: keep blocks small
MAX_BLOCKS = 1024  # grid-stride beyond this; enough to fill an H200 (132 SMs) several times
SIM_MAX_BLOCKS = 4
STATUS_WORDS = 8  # kernels/loads.cu ST_NUM
ST_LAUNCH_ID, ST_PUBLISHED, ST_BAD_REQ, ST_BAD_PAGE, ST_BAD_SEQLEN, ST_PUBLISH_SEQ = range(6)
SLOT_WORDS = 14  # the sequence word and the 13 LoadSnapshot fields

_NO_CUPY = (
    "backend 'cupy' needs CuPy and an NVIDIA GPU: install the CUDA extra (pip install 'dpboard[cuda]', "
    "i.e. cupy-cuda12x) on a machine with a GPU, or use backend='numba' on a CPU-only machine"
)
_NO_GPU_NUMBA = (
    "backend 'numba-cuda' finds no CUDA GPU (numba.cuda.is_available() is False): use backend='numba' "
    "on a CPU-only machine, install the CUDA extra (pip install 'dpboard[cuda]') where a GPU exists, or set "
    "NUMBA_ENABLE_CUDASIM=1 before importing numba to run the kernels in Numba's simulator (slow; for tests)"
)


def simulator_enabled() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # CUDA driver missing or broken: the same as no GPU for us
        return False


def _numba_cuda():
    from numba import cuda

    if not simulator_enabled() and not cuda.is_available():
        raise RuntimeError(_NO_GPU_NUMBA)
    return cuda


def _cupy():
    try:
        import cupy
    except ImportError:
        raise RuntimeError(_NO_CUPY) from None
    if not cupy_available():
        raise RuntimeError(_NO_CUPY)
    return cupy


def to_host(x: Any) -> np.ndarray:
    """A host copy of a device array (the error path only)."""
    if not hasattr(x, "__cuda_array_interface__"):
        return np.asarray(x)
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "cpu"):
        return x.cpu().numpy()
    from numba import cuda

    return cuda.as_cuda_array(x).copy_to_host()


# -- numba-cuda ------------------------------------------------------------------------------------

_numba_kernels: dict[int, tuple[Any, Any]] = {}
_numba_lock = threading.Lock()


def numba_kernels(block: int) -> tuple[Any, Any]:
    """(raw_counts_kernel, publish_kernel) for blocks of ``block`` threads (a power of two)."""
    with _numba_lock:
        if block not in _numba_kernels:
            _numba_kernels[block] = _build_numba_kernels(block)
        return _numba_kernels[block]


cuda: Any = None  # numba.cuda, bound on first use (the simulator swaps this global while a kernel runs)


def _build_numba_kernels(block: int) -> tuple[Any, Any]:
    global cuda
    import numba.cuda
    from numba import int64

    cuda = numba.cuda

    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")

    @cuda.jit(device=True)
    def accumulate(state, seqlen, pages, acc):
        for k in range(NUM_RAW):
            acc[k] = 0
        stride = cuda.gridsize(1)
        num_requests = state.shape[0]
        num_pages = pages.shape[0]
        n = max(num_requests, num_pages)
        i = cuda.grid(1)
        while i < n:
            if i < num_requests:
                s = int64(state[i])
                length = int64(seqlen[i])
                waiting = s >= 2 and s <= 6
                if s == 1:
                    acc[0] += 1
                if waiting:
                    acc[1] += 1
                    if s != 5:
                        acc[2] += length
                if s == 4 or s == 5:
                    acc[3] += length
                if s < 0 or s > 6:
                    acc[6] += 1
                if length < 0 and s != 0:
                    acc[8] += 1
            if i < num_pages:
                p = int64(pages[i])
                if p == 0:
                    acc[4] += 1
                elif p == 2:
                    acc[5] += 1
                elif p != 1:
                    acc[7] += 1
            i += stride

    @cuda.jit(device=True)
    def reduce_block(acc, accum, ticket):
        """Block sums into the global accumulators; True in thread 0 of the last block, whose acc
        then holds the grand totals (and the accumulators are reset for the next launch)."""
        sums = cuda.shared.array((NUM_RAW, block), int64)
        is_last = cuda.shared.array(1, int64)
        tid = cuda.threadIdx.x
        for k in range(NUM_RAW):
            sums[k, tid] = acc[k]
        cuda.syncthreads()
        half = block // 2
        while half > 0:
            if tid < half:
                for k in range(NUM_RAW):
                    sums[k, tid] += sums[k, tid + half]
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            for k in range(NUM_RAW):
                cuda.atomic.add(accum, k, sums[k, 0])
            cuda.threadfence()  # our adds are visible device-wide before our ticket is
            is_last[0] = 1 if cuda.atomic.add(ticket, 0, 1) == cuda.gridDim.x - 1 else 0
        cuda.syncthreads()
        if tid != 0 or is_last[0] == 0:
            return False
        cuda.threadfence()
        for k in range(NUM_RAW):
            acc[k] = cuda.atomic.exch(accum, k, 0)
        cuda.atomic.exch(ticket, 0, 0)
        return True

    @cuda.jit
    def raw_counts_kernel(state, seqlen, pages, accum, ticket, raw):
        acc = cuda.local.array(NUM_RAW, int64)
        accumulate(state, seqlen, pages, acc)
        if reduce_block(acc, accum, ticket):
            for k in range(NUM_RAW):
                raw[k] = acc[k]

    @cuda.jit
    def publish_kernel(state, seqlen, pages, page_size, accum, ticket, slot, host_fields, status, launch_id):
        # slot: int64[14] view of the board slot (sequence word, then the 13 fields).
        # host_fields: int64[6] = dp_rank, num_received_reqs, timestamp_ns, monotonic_ns, writer_pid, node_id.
        acc = cuda.local.array(NUM_RAW, int64)
        accumulate(state, seqlen, pages, acc)
        if not reduce_block(acc, accum, ticket):
            return
        status[ST_BAD_REQ] = acc[6]
        status[ST_BAD_PAGE] = acc[7]
        status[ST_BAD_SEQLEN] = acc[8]
        if acc[6] != 0 or acc[7] != 0 or acc[8] != 0:
            status[ST_PUBLISHED] = 0
            cuda.threadfence_system()
            status[ST_LAUNCH_ID] = launch_id
            return
        num_pages = int64(pages.shape[0])
        used = (num_pages - acc[4] - acc[5]) * page_size
        total = used + acc[2]
        active = max(int64(0), total - acc[3])
        s = slot[0]
        if s & 1:
            s += 1  # left odd by a writer that died mid-write: step past it
        publish_seq = max(int64(0), slot[11]) + 1
        cuda.atomic.exch(slot, 0, s + 1)  # odd: a write is in progress
        cuda.threadfence_system()
        slot[1] = host_fields[0]
        slot[2] = acc[0]
        slot[3] = acc[1]
        slot[4] = used
        slot[5] = total
        slot[6] = active
        slot[7] = num_pages * page_size
        slot[8] = host_fields[1]
        slot[9] = host_fields[2]
        slot[10] = host_fields[3]
        slot[11] = publish_seq
        slot[12] = host_fields[4]
        slot[13] = host_fields[5]
        cuda.threadfence_system()
        cuda.atomic.exch(slot, 0, s + 2)  # even: the snapshot is whole
        status[ST_PUBLISH_SEQ] = publish_seq
        status[ST_PUBLISHED] = 1
        cuda.threadfence_system()
        status[ST_LAUNCH_ID] = launch_id

    return raw_counts_kernel, publish_kernel


def _grid(n: int, block: int, max_blocks: int) -> int:
    return max(1, min(max_blocks, -(-n // block)))


class NumbaCudaRunner:
    """Device buffers and launches of the numba-cuda raw-counts kernel (one per user: not shared
    between concurrent streams)."""

    def __init__(self) -> None:
        self.cuda = _numba_cuda()
        sim = simulator_enabled()
        self.block = SIM_BLOCK if sim else BLOCK
        self.max_blocks = SIM_MAX_BLOCKS if sim else MAX_BLOCKS
        self.kernel, self.publish_kernel = numba_kernels(self.block)
        self.accum = self.cuda.to_device(np.zeros(NUM_RAW, dtype=np.int64))
        self.ticket = self.cuda.to_device(np.zeros(1, dtype=np.uint32))
        self.raw_dev = self.cuda.device_array(NUM_RAW, dtype=np.int64)
        self.raw_host = self.cuda.pinned_array(NUM_RAW, dtype=np.int64) if not sim else np.zeros(NUM_RAW, np.int64)

    def device(self, x: Any) -> Any:
        if simulator_enabled():
            return x  # the simulator runs kernels on host arrays
        if hasattr(x, "__cuda_array_interface__"):
            return self.cuda.as_cuda_array(x)
        return self.cuda.to_device(np.ascontiguousarray(x))

    def raw_counts(self, req_state: Any, req_seqlen: Any, page_state: Any) -> np.ndarray:
        state, seqlen, pages = (self.device(x) for x in (req_state, req_seqlen, page_state))
        grid = _grid(max(state.shape[0], pages.shape[0]), self.block, self.max_blocks)
        self.kernel[grid, self.block](state, seqlen, pages, self.accum, self.ticket, self.raw_dev)
        self.raw_dev.copy_to_host(self.raw_host)  # nine integers; waits for the kernel
        return np.array(self.raw_host)


# -- cupy ------------------------------------------------------------------------------------------

_C_TYPES = {
    np.dtype(np.int8): "signed char",
    np.dtype(np.uint8): "unsigned char",
    np.dtype(np.int16): "short",
    np.dtype(np.uint16): "unsigned short",
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "unsigned int",
    np.dtype(np.int64): "long long",
}


def cuda_source() -> str:
    """The CUDA C of kernels/loads.cu, from the installed package (it ships inside the wheel)."""
    try:
        return resources.files("dpboard.cuda_sources").joinpath("loads.cu").read_text()
    except ModuleNotFoundError:  # a source checkout that is not installed
        from pathlib import Path

        return (Path(__file__).resolve().parent.parent / "kernels" / "loads.cu").read_text()


_cupy_functions: dict[tuple[str, ...], Any] = {}


def cupy_function(kind: str, state_dtype: np.dtype, seqlen_dtype: np.dtype, page_dtype: np.dtype) -> Any:
    """The compiled ``dpb_raw_counts`` or ``dpb_publish`` for these dtypes (NVRTC; cached)."""
    cupy = _cupy()
    types = [_C_TYPES[np.dtype(d).newbyteorder("=")] for d in (state_dtype, seqlen_dtype, page_dtype)]
    name = f"dpb_{kind}<{', '.join(types)}>"
    key = (name,)
    fn = _cupy_functions.get(key)
    if fn is None:
        module = cupy.RawModule(code=cuda_source(), options=("-std=c++17",), name_expressions=[name])
        fn = _cupy_functions[key] = module.get_function(name)
    return fn


def _pointer(x: Any) -> np.uint64:
    return np.uint64(x.__cuda_array_interface__["data"][0])


class CupyRunner:
    """Device buffers and launches of the CuPy raw-counts kernel."""

    def __init__(self) -> None:
        self.cupy = _cupy()
        self.accum = self.cupy.zeros(NUM_RAW, dtype=np.uint64)
        self.ticket = self.cupy.zeros(1, dtype=np.uint32)
        self.raw_dev = self.cupy.zeros(NUM_RAW, dtype=np.int64)
        self.raw_host = np.zeros(NUM_RAW, dtype=np.int64)

    def device(self, x: Any) -> Any:
        if hasattr(x, "__cuda_array_interface__"):
            cai = x.__cuda_array_interface__
            if cai.get("strides") not in (None, (np.dtype(cai["typestr"]).itemsize,)):
                raise ValueError("device tables must be contiguous: pass x.contiguous() / cupy.ascontiguousarray(x)")
            return x
        return self.cupy.asarray(np.ascontiguousarray(x))

    def launch(self, fn: Any, state: Any, seqlen: Any, pages: Any, *extra: Any) -> None:
        num_requests, num_pages = array_info(state, "req_state")[1][0], array_info(pages, "page_state")[1][0]
        grid = _grid(max(num_requests, num_pages), BLOCK, MAX_BLOCKS)
        fn((grid,), (BLOCK,), (_pointer(state), _pointer(seqlen), np.int64(num_requests), _pointer(pages),
                               np.int64(num_pages), *extra))

    def raw_counts(self, req_state: Any, req_seqlen: Any, page_state: Any) -> np.ndarray:
        state, seqlen, pages = (self.device(x) for x in (req_state, req_seqlen, page_state))
        fn = cupy_function("raw_counts", *(array_info(x, "table")[0] for x in (state, seqlen, pages)))
        self.launch(fn, state, seqlen, pages, self.accum, self.ticket, self.raw_dev)
        return self.raw_dev.get()  # nine integers; waits for the kernel


_runners: dict[str, Any] = {}


def runner(backend: str) -> Any:
    r = _runners.get(backend)
    if r is None:
        r = _runners[backend] = NumbaCudaRunner() if backend == "numba-cuda" else CupyRunner()
    return r


def raw_counts(req_state: Any, req_seqlen: Any, page_state: Any, *, backend: str) -> np.ndarray:
    if backend not in ("numba-cuda", "cupy"):
        raise ValueError(f"not a CUDA backend: {backend!r}")
    return runner(backend).raw_counts(req_state, req_seqlen, page_state)


# -- GPU-direct publish ----------------------------------------------------------------------------

PAGE = mmap.PAGESIZE
_registered: dict[int, list[Any]] = {}  # page address -> [refcount, handle]
_registered_lock = threading.Lock()


def slot_view(slot_address: int) -> np.ndarray:
    """An int64[14] NumPy view of a board slot at ``slot_address`` (the writer keeps the mapping)."""
    buf = (ctypes.c_int64 * SLOT_WORDS).from_address(slot_address)
    return np.frombuffer(buf, dtype=np.int64)


class DirectPublisherBase:
    """Common host side of GPU-direct publish: the slot, the status words, the launch counter.

    The board writer of the rank must exist (it records this process as the slot's owner) but must
    not publish while this object is in use: the kernel is the slot's only writer.
    """

    def __init__(self, writer: Any, page_size: int, node_id: int = 0) -> None:
        self.writer = writer  # keeps the board mapping alive
        self.rank = int(writer.rank)
        self.slot_address = int(writer.slot_address)
        self.page_size = int(page_size)
        self.pid = os.getpid()
        self.node_id = int(node_id)
        self.launch_id = 0

    def host_fields(self, num_received_reqs: int) -> tuple[int, ...]:
        # The kernel cannot read the host clocks: they are taken now, at launch.
        return (self.rank, int(num_received_reqs), time.time_ns(), time.monotonic_ns(), self.pid, self.node_id)

    def poll(self) -> dict[str, int] | None:
        """What the last finished launch did (None before any finished); never waits for the GPU."""
        status = self.status_host
        launch = int(status[ST_LAUNCH_ID])
        if launch == 0:
            return None
        return {
            "launch_id": launch,
            "published": int(status[ST_PUBLISHED]),
            "bad_req_states": int(status[ST_BAD_REQ]),
            "bad_page_states": int(status[ST_BAD_PAGE]),
            "bad_seqlens": int(status[ST_BAD_SEQLEN]),
            "publish_seq": int(status[ST_PUBLISH_SEQ]),
        }

    def check(self) -> None:
        """Raise ValueError when the last finished launch rejected the tables (nothing was published)."""
        st = self.poll()
        if st is not None and not st["published"]:
            raise ValueError(
                f"GPU-direct launch {st['launch_id']} found bad tables and published nothing: "
                f"{st['bad_req_states']} req_state code(s) outside ReqState, {st['bad_page_states']} page_state "
                f"code(s) outside PageState, {st['bad_seqlens']} negative seqlen(s); fix the scheduler's tables"
            )


class NumbaDirectPublisher(DirectPublisherBase):
    """GPU-direct publish with the numba-cuda kernel. In the simulator the kernel works on the slot's
    host memory itself (wrapped so that the simulator does not copy it to a device array and back,
    which would rewrite the slot outside the seqlock); on a GPU the slot's page is pinned and mapped
    (``mempin(mapped=True)``)."""

    def __init__(self, writer: Any, page_size: int, node_id: int = 0) -> None:
        super().__init__(writer, page_size, node_id)
        self.runner = NumbaCudaRunner()
        cuda = self.runner.cuda
        host_slot = slot_view(self.slot_address)
        if simulator_enabled():
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            # The simulator's stand-in for mapped memory: the kernel's stores land in the board.
            self.slot = FakeCUDAArray(host_slot)
            self.status_host = np.zeros(STATUS_WORDS, dtype=np.int64)
            self.status = FakeCUDAArray(self.status_host)
            self._pins: list[Any] = []
        else:
            page_base = self.slot_address & ~(PAGE - 1)
            page = np.frombuffer((ctypes.c_char * PAGE).from_address(page_base), dtype=np.uint8)
            pin = cuda.current_context().mempin(page, page_base, PAGE, mapped=True)
            offset = self.slot_address - page_base
            device_page = cuda.devicearray.from_array_like(page, gpu_data=pin)
            self.slot = device_page[offset : offset + 8 * SLOT_WORDS].view(np.int64)
            self.status = cuda.mapped_array(STATUS_WORDS, dtype=np.int64)
            self.status_host = self.status
            self._pins = [pin]
        self.host_fields_dev = np.zeros(6, dtype=np.int64)

    def publish(self, req_state: Any, req_seqlen: Any, page_state: Any, num_received_reqs: int) -> int:
        """Launch the compute-and-publish kernel; returns at once (the launch id)."""
        self.launch_id += 1
        r = self.runner
        state, seqlen, pages = (r.device(x) for x in (req_state, req_seqlen, page_state))
        fields = np.array(self.host_fields(num_received_reqs), dtype=np.int64)
        grid = _grid(max(state.shape[0], pages.shape[0]), r.block, r.max_blocks)
        r.publish_kernel[grid, r.block](state, seqlen, pages, self.page_size, r.accum, r.ticket, self.slot,
                                        fields, self.status, self.launch_id)
        return self.launch_id

    def synchronize(self) -> None:
        if not simulator_enabled():
            self.runner.cuda.synchronize()
        self.check()

    def close(self) -> None:
        self.synchronize()
        for pin in self._pins:
            pin.free()
        self._pins = []


class CupyDirectPublisher(DirectPublisherBase):
    """GPU-direct publish with the CUDA C kernel ``dpb_publish`` of kernels/loads.cu.

    The page holding the slot is registered with ``cudaHostRegister(Mapped | Portable)`` and the
    kernel gets its device address from ``cudaHostGetDevicePointer``; the status words live in
    mapped pinned memory (``cudaHostAlloc(Mapped | Portable)``), so the host reads them without a sync.
    """

    def __init__(self, writer: Any, page_size: int, node_id: int = 0) -> None:
        super().__init__(writer, page_size, node_id)
        self.runner = CupyRunner()
        cupy = self.runner.cupy
        rt = cupy.cuda.runtime
        page_base = self.slot_address & ~(PAGE - 1)
        with _registered_lock:
            entry = _registered.get(page_base)
            if entry is None:
                rt.hostRegister(page_base, PAGE, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable)
                entry = _registered[page_base] = [0]
            entry[0] += 1
        self._page_base = page_base
        self.slot_device = rt.hostGetDevicePointer(page_base, 0) + (self.slot_address - page_base)
        status_bytes = 8 * STATUS_WORDS
        self._status_ptr = rt.hostAlloc(status_bytes, rt.cudaHostAllocMapped | rt.cudaHostAllocPortable)
        ctypes.memset(self._status_ptr, 0, status_bytes)
        self.status_host = np.frombuffer((ctypes.c_int64 * STATUS_WORDS).from_address(self._status_ptr), np.int64)
        self.status_device = rt.hostGetDevicePointer(self._status_ptr, 0)
        self._fn: dict[tuple[np.dtype, ...], Any] = {}

    def publish(self, req_state: Any, req_seqlen: Any, page_state: Any, num_received_reqs: int) -> int:
        """Launch the compute-and-publish kernel on CuPy's current stream; returns at once."""
        self.launch_id += 1
        r = self.runner
        state, seqlen, pages = (r.device(x) for x in (req_state, req_seqlen, page_state))
        dtypes = tuple(array_info(x, "table")[0] for x in (state, seqlen, pages))
        fn = self._fn.get(dtypes)
        if fn is None:
            fn = self._fn[dtypes] = cupy_function("publish", *dtypes)
        rank, received, wall, mono, pid, node = self.host_fields(num_received_reqs)
        r.launch(fn, state, seqlen, pages, np.int64(self.page_size), r.accum, r.ticket, np.uint64(self.slot_device),
                 np.int64(rank), np.int64(received), np.int64(wall), np.int64(mono), np.int64(pid),
                 np.int64(node), np.uint64(self.status_device), np.int64(self.launch_id))
        return self.launch_id

    def synchronize(self) -> None:
        self.runner.cupy.cuda.get_current_stream().synchronize()
        self.check()

    def close(self) -> None:
        if self._page_base is None:
            return
        self.synchronize()
        rt = self.runner.cupy.cuda.runtime
        with _registered_lock:
            entry = _registered[self._page_base]
            entry[0] -= 1
            if entry[0] == 0:
                rt.hostUnregister(self._page_base)
                del _registered[self._page_base]
        rt.freeHost(self._status_ptr)
        self._page_base = None


def direct_publisher(writer: Any, page_size: int, backend: str, node_id: int = 0) -> DirectPublisherBase:
    """A GPU-direct publisher for ``backend`` ("cupy" or "numba-cuda"; RuntimeError without a GPU)."""
    if backend == "cupy":
        return CupyDirectPublisher(writer, page_size, node_id)
    if backend == "numba-cuda":
        return NumbaDirectPublisher(writer, page_size, node_id)
    raise ValueError(f"GPU-direct publish needs backend 'cupy' or 'numba-cuda', got {backend!r}")
