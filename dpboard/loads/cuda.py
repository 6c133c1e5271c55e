"""The CUDA backends of ``compute_loads``, and the kernel of GPU-direct publish (docs/KERNELS.md).

Two implementations of one design (a single pass over both tables, block reduction, one atomic per
counter per block, the last block finishes):

- ``numba-cuda``: ``@cuda.jit`` kernels written in Python. They also run in Numba's CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``), which is how the test suite checks them on machines without a GPU.
- ``cupy``: the CUDA C of ``kernels/loads.cu`` (shipped as the package ``dpboard.cuda_sources``),
  compiled by NVRTC through ``cupy.RawModule``, one instantiation per dtype combination, launched
  from the prepared launches of ``dpboard.loads.launch``.

Both backends bind a set of tables once (``runner.prepare``: device views or pointers, grid,
arguments, result buffer, stream) and then only launch; ``compute_loads`` keeps the last binding.

Only the nine raw counters cross to the host (``compute_loads``), or nothing at all: the GPU-direct
publishers (``dpboard.publish.gpu_direct``) launch the publish kernel built here, whose last block
writes the snapshot into the board slot itself, through the slot's page registered as mapped host
memory (``cudaHostRegister``), seqlock included.

Nothing here is imported until a CUDA backend is asked for; CuPy and a GPU are optional.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dpboard.errors import DpboardError, InvalidInputError, UnavailableError
from dpboard.loads import counters as c
from dpboard.loads import formula
from dpboard.snapshot import MAX_SEQLEN, NUM_RAW, PageState, ReqState

BLOCK = 256  # threads per block on a GPU (a multiple of 32, a power of two); the grid comes from the SM count
SIM_BLOCK = 32  # in the simulator every thread is a Python thread: keep blocks small
SIM_MAX_BLOCKS = 4

# Plain ints for the kernels (Numba freezes module globals into the compiled code).
_R_FREE, _R_RUNNING, _R_PREALLOC, _R_TRANSFER = (int(s) for s in (ReqState.FREE, ReqState.RUNNING,
                                                                 ReqState.PREALLOC, ReqState.TRANSFER))
_R_FIRST_QUEUED, _R_LAST_QUEUED, _R_MAX = int(ReqState.WAITING), int(ReqState.RETRACTED), int(max(ReqState))
_P_FREE, _P_USED, _P_EVICTABLE = int(PageState.FREE), int(PageState.USED), int(PageState.EVICTABLE)
_MAX_SEQLEN = MAX_SEQLEN
assert [int(s) for s in ReqState] == list(range(_R_MAX + 1)) and _R_LAST_QUEUED == _R_MAX
_SEQ_WORD = formula.SEQ_WORD

_NO_CUPY = (
    "backend 'cupy' needs CuPy and an NVIDIA GPU: install the CUDA extra for the machine's CUDA "
    "(the cuda13 or cuda12 extra: pip install -e '.[cuda13]') on a machine with a GPU, or use backend='numba' "
    "on a CPU-only machine"
)
_NO_GPU_NUMBA = (
    "backend 'numba-cuda' finds no CUDA GPU (numba.cuda.is_available() is False): use backend='numba' "
    "on a CPU-only machine, install the cuda13 or cuda12 extra (pip install -e '.[cuda13]') where a GPU exists, or set "
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
        raise UnavailableError(_NO_GPU_NUMBA)
    return cuda


def _cupy():
    try:
        import cupy
    except ImportError:
        raise UnavailableError(_NO_CUPY) from None
    if not cupy_available():
        raise UnavailableError(_NO_CUPY)
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
    """Compile the raw-counts and GPU-direct publish kernels for blocks of ``block`` threads."""
    if block < 1 or block & (block - 1):
        raise InvalidInputError(f"block must be a power of two, got {block}")
    _bind_cuda()
    accumulate = _accumulate_device()
    reduce_block = _reduce_block_device(block)
    publish_raw = formula_devices()["publish_raw"]
    return _raw_counts_kernel(accumulate, reduce_block), _publish_kernel(accumulate, reduce_block, publish_raw)


# The builders below refer to ``cuda`` as this module's global, not as a closure: the simulator runs
# a kernel by swapping that global for its fake module.


def _bind_cuda() -> None:
    global cuda
    import numba.cuda

    cuda = numba.cuda


def _seqlock_primitives() -> dict[str, Any]:
    """formula.PRIMITIVES on the GPU: dpboard/board/dpb_seqlock.h's writer order with system-scope
    fences, as kernels/dpb_seqlock_gpu.h has them in CUDA C."""

    @cuda.jit(device=True)
    def fence_system():
        cuda.threadfence_system()

    @cuda.jit(device=True)
    def seq_open(slot, odd):
        cuda.atomic.exch(slot, _SEQ_WORD, odd)  # [W0] odd: a write is in progress
        cuda.threadfence_system()  # [W1]

    @cuda.jit(device=True)
    def seq_close(slot, odd):
        cuda.threadfence_system()  # [W2] its fence
        cuda.atomic.exch(slot, _SEQ_WORD, odd + 1)  # [W2] its store: even, the write is whole

    return {"fence_system": fence_system, "seq_open": seq_open, "seq_close": seq_close}


def formula_devices() -> dict[str, Any]:
    """The functions of ``dpboard.loads.formula`` as numba-cuda device functions: the very
    functions the CPU runs, with the GPU's seqlock primitives."""
    _bind_cuda()
    return bind_formula(cuda.jit(device=True), _seqlock_primitives())


def bind_formula(jit: Any, primitives: dict[str, Any]) -> dict[str, Any]:
    """``formula.FUNCTIONS`` compiled by ``jit``, callees first, each with the names it calls (the
    other functions and ``primitives``) bound to their compiled versions; with the primitives."""
    compiled = dict(primitives)
    for name in formula.FUNCTIONS:
        fn = getattr(formula, name)
        bound = types.FunctionType(fn.__code__, {**fn.__globals__, **compiled}, fn.__name__, fn.__defaults__,
                                   fn.__closure__)
        compiled[name] = jit(bound)
    return compiled


def _accumulate_device() -> Any:
    """Each thread's grid-stride pass over both tables into its own raw counters."""
    from numba import int64

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
                if length < 0 or length > _MAX_SEQLEN:  # a bad table; adds nothing to the sums
                    if s != _R_FREE:
                        acc[c.BAD_SEQLENS] += 1
                    length = 0
                waiting = s >= _R_FIRST_QUEUED and s <= _R_LAST_QUEUED
                if s == _R_RUNNING:
                    acc[c.RUNNING] += 1
                if waiting:
                    acc[c.WAITING] += 1
                    if s != _R_TRANSFER:
                        acc[c.SEQLEN_WITHOUT_KV] += length
                if s == _R_PREALLOC or s == _R_TRANSFER:
                    acc[c.SEQLEN_AWAITING_TRANSFER] += length
                if s < 0 or s > _R_MAX:
                    acc[c.BAD_REQ_STATES] += 1
            if i < num_pages:
                p = int64(pages[i])
                if p == _P_FREE:
                    acc[c.FREE_PAGES] += 1
                elif p == _P_EVICTABLE:
                    acc[c.EVICTABLE_PAGES] += 1
                elif p != _P_USED:
                    acc[c.BAD_PAGE_STATES] += 1
            i += stride

    return accumulate


def _reduce_block_device(block: int) -> Any:
    """The block sum into the global accumulators; the last block to finish gets the totals."""
    from numba import int64

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

    return reduce_block


def _raw_counts_kernel(accumulate: Any, reduce_block: Any) -> Any:
    from numba import int64

    @cuda.jit
    def raw_counts_kernel(state, seqlen, pages, accum, ticket, raw):
        acc = cuda.local.array(NUM_RAW, int64)
        accumulate(state, seqlen, pages, acc)
        if reduce_block(acc, accum, ticket):
            for k in range(NUM_RAW):
                raw[k] = acc[k]

    return raw_counts_kernel


def _publish_kernel(accumulate: Any, reduce_block: Any, publish_raw: Any) -> Any:
    from numba import int64

    @cuda.jit
    def publish_kernel(state, seqlen, pages, page_size, accum, ticket, slot, dp_rank, num_received_reqs,
                       timestamp_ns, monotonic_ns, writer_pid, node_id, status, launch_id):
        # slot: int64 view of the board slot from its start (DIRECT_SLOT_WORDS words). The host values
        # are scalar arguments: copied at launch, so the next step's values never reach this launch.
        acc = cuda.local.array(NUM_RAW, int64)
        accumulate(state, seqlen, pages, acc)
        if not reduce_block(acc, accum, ticket):
            return
        # The formula, the seqlocked slot write and the status words: formula.publish_raw.
        publish_raw(acc, int64(pages.shape[0]), page_size, slot, status, dp_rank, num_received_reqs,
                    timestamp_ns, monotonic_ns, writer_pid, node_id, launch_id)

    return publish_kernel


def grid_size(n: int, block: int, max_blocks: int) -> int:
    return max(1, min(max_blocks, -(-n // block)))


def _compile_failure(error: BaseException) -> str:
    import numpy

    try:
        from importlib.metadata import version

        numba_cuda = f"numba-cuda {version('numba-cuda')}"
    except Exception:  # the numba.cuda built into numba, or no metadata
        numba_cuda = "numba-cuda"
    return (
        f"{numba_cuda} cannot compile dpboard's kernels with numpy {numpy.__version__} "
        f"({type(error).__name__}: {error}): numba-cuda 0.30 and older fail on numpy 2.5 (np.row_stack is gone); "
        f"install numpy<2.5 beside them (pip install 'numpy<2.5') or a numba-cuda that supports this numpy, or "
        f"use backend='cupy' (the cuda13 or cuda12 extra: pip install -e '.[cuda13]')"
    )


def specialize(kernel: Any, args: tuple[Any, ...]) -> Any:
    """``kernel`` compiled now for the types of ``args``: its launches skip numba's type dispatch.
    A numba-cuda that cannot compile here raises UnavailableError naming the fix."""
    try:
        return kernel.specialize(*args)
    except (DpboardError, KeyboardInterrupt):
        raise
    except Exception as e:  # numba-cuda's own failure (an import inside it, a numpy it does not know)
        raise UnavailableError(_compile_failure(e)) from e


class _BindingRunner:
    """What both CUDA runners do with a binding (``prepare``'s, of one set of tables): keep the last
    one, so that ``compute_loads`` on the same tables again only launches."""

    _last: Any = None

    def prepare(self, req_state: Any, req_seqlen: Any, page_state: Any) -> Any:
        raise NotImplementedError

    def bound(self, req_state: Any, req_seqlen: Any, page_state: Any) -> Any:
        """The binding of the last tables if these are they, else a new one (compute_loads' cache)."""
        last = self._last
        if last is None or not last.same_tables(req_state, req_seqlen, page_state):
            last = self._last = self.prepare(req_state, req_seqlen, page_state)
        return last

    def raw_counts(self, req_state: Any, req_seqlen: Any, page_state: Any) -> np.ndarray:
        return self.bound(req_state, req_seqlen, page_state).raw_counts().copy()


class NumbaCudaRunner(_BindingRunner):
    """The numba-cuda kernels, compiled once per process, and the launch geometry of this device."""

    def __init__(self) -> None:
        self.cuda = _numba_cuda()
        self.sim = simulator_enabled()
        self.block = SIM_BLOCK if self.sim else BLOCK
        try:
            self.kernel, self.publish_kernel = numba_kernels(self.block)
        except (DpboardError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise UnavailableError(_compile_failure(e)) from e
        if self.sim:
            self.max_blocks = SIM_MAX_BLOCKS
        else:
            from dpboard.loads.launch import BLOCKS_PER_SM

            self.max_blocks = self.cuda.get_current_device().MULTIPROCESSOR_COUNT * BLOCKS_PER_SM

    def device(self, x: Any) -> Any:
        """A device view of a table (once per binding)."""
        if self.sim:
            return np.asarray(x) if not hasattr(x, "__cuda_array_interface__") else x
        if hasattr(x, "__cuda_array_interface__"):
            return self.cuda.as_cuda_array(x)
        return self.cuda.to_device(np.ascontiguousarray(x))

    def stream(self) -> Any:
        return 0 if self.sim else self.cuda.stream()

    def accumulators(self) -> tuple[Any, Any]:
        """Zeroed accumulators and ticket of one binding (the last block resets them)."""
        return self.cuda.to_device(np.zeros(NUM_RAW, dtype=np.int64)), self.cuda.to_device(np.zeros(1, np.uint32))

    def prepare(self, req_state: Any, req_seqlen: Any, page_state: Any) -> NumbaRawCounts:
        return NumbaRawCounts(self, (req_state, req_seqlen, page_state))


class NumbaRawCounts:
    """numba-cuda's raw counters of one set of tables: device views, the kernel specialised for
    their types, the launch configuration, a pinned result buffer and a stream, all made once."""

    def __init__(self, runner: NumbaCudaRunner, tables: tuple[Any, Any, Any]) -> None:
        cuda = runner.cuda
        self.tables = tables
        state, seqlen, pages = (runner.device(x) for x in tables)
        self.stream = runner.stream()
        accum, ticket = runner.accumulators()
        self._raw_dev = cuda.device_array(NUM_RAW, dtype=np.int64)
        self.raw = np.zeros(NUM_RAW, np.int64) if runner.sim else cuda.pinned_array(NUM_RAW, dtype=np.int64)
        self._args = (state, seqlen, pages, accum, ticket, self._raw_dev)
        grid = grid_size(max(state.shape[0], pages.shape[0]), runner.block, runner.max_blocks)
        kernel = specialize(runner.kernel, self._args)
        self._config = (grid, runner.block, self.stream)
        self._kernel = kernel
        self._launch = kernel[self._config]
        self._sim = runner.sim

    def same_tables(self, state: Any, seqlen: Any, pages: Any) -> bool:
        t = self.tables
        return state is t[0] and seqlen is t[1] and pages is t[2]

    def raw_counts(self) -> np.ndarray:
        """The nine raw counters (this binding's buffer, valid until its next call)."""
        if self._sim:  # the simulator keeps one launch configuration per kernel: set it each time
            self._kernel[self._config](*self._args)
            self._raw_dev.copy_to_host(self.raw)
            return self.raw
        self._launch(*self._args)
        self._raw_dev.copy_to_host(self.raw, stream=self.stream)  # nine integers into pinned memory
        self.stream.synchronize()
        return self.raw


# -- cupy ------------------------------------------------------------------------------------------


def cuda_sources_dir() -> Path:
    """The folder of kernels/loads.cu and its generated header, installed (the package
    ``dpboard.cuda_sources``, shipped in the wheel) or in a source checkout."""
    try:
        return Path(str(resources.files("dpboard.cuda_sources")))
    except ModuleNotFoundError:  # a source checkout that is not installed
        return Path(__file__).resolve().parents[2] / "kernels"


@functools.lru_cache(maxsize=1)
def cuda_source() -> str:
    """The CUDA C of kernels/loads.cu (it includes dpboard_layout.h from the same folder)."""
    return (cuda_sources_dir() / "loads.cu").read_text()


class CupyRunner(_BindingRunner):
    """The CUDA C kernels through CuPy on ``device`` (a ``launch.CupyDevice``; ``launch.NullDevice``
    to measure the host side alone)."""

    def __init__(self, device: Any = None) -> None:
        from dpboard.loads.launch import CupyDevice

        self.device = device if device is not None else CupyDevice(_cupy())

    def sources(self) -> tuple[str, str]:
        return cuda_source(), str(cuda_sources_dir())

    def on_device(self, x: Any) -> Any:
        if hasattr(x, "__cuda_array_interface__"):
            return x
        return self.device.cupy.asarray(np.ascontiguousarray(x))  # host tables given to backend="cupy"

    def prepare(self, req_state: Any, req_seqlen: Any, page_state: Any) -> Any:
        from dpboard.loads.launch import CupyRawCounts

        tables = tuple(self.on_device(x) for x in (req_state, req_seqlen, page_state))
        return CupyRawCounts(self.device, tables, *self.sources())  # type: ignore[arg-type]


_runners: dict[str, Any] = {}


@contextlib.contextmanager
def runner_override(backend: str, replacement: Any) -> Iterator[Any]:
    """Use ``replacement`` as the process's runner of ``backend`` inside the block (the host-overhead
    benchmark runs the cupy path on a ``launch.NullDevice`` this way)."""
    saved = _runners.get(backend)
    _runners[backend] = replacement
    try:
        yield replacement
    finally:
        if saved is None:
            _runners.pop(backend, None)
        else:
            _runners[backend] = saved


def runner(backend: str) -> Any:
    """The process's runner of a CUDA backend (made on first use; UnavailableError without one)."""
    r = _runners.get(backend)
    if r is None:
        r = _runners[backend] = NumbaCudaRunner() if backend == "numba-cuda" else CupyRunner()
    return r


def raw_counts(req_state: Any, req_seqlen: Any, page_state: Any, *, backend: str) -> np.ndarray:
    if backend not in ("numba-cuda", "cupy"):
        raise InvalidInputError(f"not a CUDA backend: {backend!r}")
    return runner(backend).raw_counts(req_state, req_seqlen, page_state)
