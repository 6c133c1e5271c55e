"""GPU-direct publish: the load kernel's last block writes the snapshot into the board slot itself.

The slot's page is registered with CUDA as mapped host memory (``cudaHostRegister`` for CuPy,
``mempin(mapped=True)`` for numba-cuda) and the kernel honours the seqlock with system-scope fences,
so a scheduler publishes with no device-to-host synchronisation at all. The kernels are built in
``dpboard.loads.cuda`` (the numba-cuda ``publish_kernel``, the CUDA C ``dpb_publish``); this module
is their host side: registration, launch, the status words and their check.

A step costs a launch: ``bind`` resolves the tables' pointers, the grid and the packed arguments
once; ``launch`` stores the step's few host values (clocks, ``num_received_reqs``, the launch id)
into them and launches. A construction that fails part-way undoes what it did (the page's
registration above all: a later board mapped at the same address could not register it again),
and publishers still open at exit are closed before CUDA's own teardown, so nothing prints then.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.loads import cuda as loads_cuda
from dpboard.loads.cuda import grid_size, simulator_enabled
from dpboard.snapshot import DIRECT_SLOT_WORDS, DIRECT_STATUS_INDEX, DIRECT_STATUS_WORDS

ST_LAUNCH_ID, ST_PUBLISHED, ST_BAD_REQ, ST_BAD_PAGE, ST_BAD_SEQLEN, ST_PUBLISH_SEQ = (
    DIRECT_STATUS_INDEX[name] for name in (
        "launch_id", "published", "bad_req_states", "bad_page_states", "bad_seqlens", "publish_seq"))
STATUS_WORDS = DIRECT_STATUS_WORDS

PAGE = mmap.PAGESIZE
_registered: dict[int, list[Any]] = {}  # page address -> [refcount]
_registered_lock = threading.Lock()
_open: weakref.WeakSet[Any] = weakref.WeakSet()  # publishers not closed yet
_atexit_registered = False


def _close_open_publishers() -> None:
    """At exit, before CUDA's teardown (registered after CuPy / numba were imported, so it runs
    first): a registration or a pin released later would print an error at exit."""
    for pub in list(_open):
        try:
            pub.close()
        except Exception:  # a GPU already gone: exit quietly
            pass


def _track(pub: Any) -> None:
    global _atexit_registered
    with _registered_lock:
        if not _atexit_registered:
            atexit.register(_close_open_publishers)
            _atexit_registered = True
    _open.add(pub)


def slot_view(slot_address: int) -> np.ndarray:
    """An int64[DIRECT_SLOT_WORDS] NumPy view of a board slot at ``slot_address`` (the writer keeps the mapping)."""
    buf = (ctypes.c_int64 * DIRECT_SLOT_WORDS).from_address(slot_address)
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
        self._tables: tuple[Any, Any, Any] | None = None

    def bind(self, req_state: Any, req_seqlen: Any, page_state: Any) -> None:
        """Resolve the launch for these tables (once per set of tables)."""
        raise NotImplementedError

    def launch(self, num_received_reqs: int) -> int:
        """Launch the compute-and-publish kernel on the bound tables; returns at once (the launch id)."""
        raise NotImplementedError

    def publish(self, req_state: Any, req_seqlen: Any, page_state: Any, num_received_reqs: int) -> int:
        """Bind these tables if they are not the bound ones, then launch; returns at once."""
        t = self._tables
        if t is None or req_state is not t[0] or req_seqlen is not t[1] or page_state is not t[2]:
            self.bind(req_state, req_seqlen, page_state)
            self._tables = (req_state, req_seqlen, page_state)
        return self.launch(num_received_reqs)

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
        """Raise InvalidInputError (a ValueError) when the last finished launch rejected the tables
        (nothing was published)."""
        st = self.poll()
        if st is not None and not st["published"]:
            raise InvalidInputError(
                f"GPU-direct launch {st['launch_id']} found bad tables and published nothing: "
                f"{st['bad_req_states']} req_state code(s) outside ReqState, {st['bad_page_states']} page_state "
                f"code(s) outside PageState, {st['bad_seqlens']} seqlen(s) outside [0, 2**32]; fix the scheduler's tables"
            )


class NumbaDirectPublisher(DirectPublisherBase):
    """GPU-direct publish with the numba-cuda kernel. In the simulator the kernel works on the slot's
    host memory itself (wrapped so that the simulator does not copy it to a device array and back,
    which would rewrite the slot outside the seqlock); on a GPU the slot's page is pinned and mapped
    (``mempin(mapped=True)``). The step's host values travel as scalar arguments, copied at launch."""

    def __init__(self, writer: Any, page_size: int, node_id: int = 0) -> None:
        super().__init__(writer, page_size, node_id)
        self.runner = loads_cuda.runner("numba-cuda")
        cuda = self.runner.cuda
        self._pins: list[Any] = []
        try:
            host_slot = slot_view(self.slot_address)
            if simulator_enabled():
                from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

                # The simulator's stand-in for mapped memory: the kernel's stores land in the board.
                self.slot = FakeCUDAArray(host_slot)
                self.status_host = np.zeros(STATUS_WORDS, dtype=np.int64)
                self.status = FakeCUDAArray(self.status_host)
            else:
                page_base = self.slot_address & ~(PAGE - 1)
                page = np.frombuffer((ctypes.c_char * PAGE).from_address(page_base), dtype=np.uint8)
                pin = cuda.current_context().mempin(page, page_base, PAGE, mapped=True)
                self._pins.append(pin)
                offset = self.slot_address - page_base
                device_page = cuda.devicearray.from_array_like(page, gpu_data=pin)
                self.slot = device_page[offset : offset + 8 * DIRECT_SLOT_WORDS].view(np.int64)
                self.status = cuda.mapped_array(STATUS_WORDS, dtype=np.int64)
                self.status_host = self.status
            self.stream = self.runner.stream()
        except BaseException:
            self._release()
            raise
        _track(self)

    def bind(self, req_state: Any, req_seqlen: Any, page_state: Any) -> None:
        r = self.runner
        state, seqlen, pages = (r.device(x) for x in (req_state, req_seqlen, page_state))
        accum, ticket = r.accumulators()
        self._head = (state, seqlen, pages, self.page_size, accum, ticket, self.slot, self.rank)
        self._tail = (self.pid, self.node_id, self.status)
        sample = (*self._head, 0, 0, 0, *self._tail, 0)
        kernel = loads_cuda.specialize(r.publish_kernel, sample)
        grid = grid_size(max(state.shape[0], pages.shape[0]), r.block, r.max_blocks)
        self._config = (grid, r.block, self.stream)
        self._kernel = kernel
        self._launch = kernel[self._config]
        self._tables = (req_state, req_seqlen, page_state)

    def launch(self, num_received_reqs: int) -> int:
        self.launch_id += 1
        # The kernel cannot read the host clocks: they are taken now, at launch.
        args = (*self._head, num_received_reqs, time.time_ns(), time.monotonic_ns(), *self._tail, self.launch_id)
        if simulator_enabled():  # the simulator keeps one launch configuration per kernel
            self._kernel[self._config](*args)
        else:
            self._launch(*args)
        return self.launch_id

    def synchronize(self) -> None:
        if not simulator_enabled():
            self.stream.synchronize()
        self.check()

    def _release(self) -> None:
        pins, self._pins = self._pins, []
        for pin in pins:
            finalizer = getattr(pin, "_finalizer", None)
            # numba's own exit hook may have unpinned it already; free() would then raise
            # "Freeing dead memory" (what the first H200 run printed at exit).
            if finalizer is None or finalizer.alive:
                pin.free()

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if not simulator_enabled():
                self.stream.synchronize()
        finally:
            self._release()
            _open.discard(self)


class CupyDirectPublisher(DirectPublisherBase):
    """GPU-direct publish with the CUDA C kernel ``dpb_publish`` of kernels/loads.cu.

    The page holding the slot is registered with ``cudaHostRegister(Mapped | Portable)`` and the
    kernel gets its device address from ``cudaPointerGetAttributes``; the status words live in
    mapped pinned memory (``cudaHostAlloc(Mapped | Portable)``), so the host reads them without a
    sync. ``device``: a ``dpboard.loads.launch`` device (CuPy's by default).
    """

    def __init__(self, writer: Any, page_size: int, node_id: int = 0, device: Any = None) -> None:
        super().__init__(writer, page_size, node_id)
        runner = loads_cuda.runner("cupy") if device is None else loads_cuda.CupyRunner(device)
        self.device = runner.device
        self._sources = runner.sources()
        self._page_base: int | None = None
        self._status_free: Any = None
        self._stream_destroy: Any = None
        self.stream = 0
        try:
            page_base = self.slot_address & ~(PAGE - 1)
            with _registered_lock:
                entry = _registered.get(page_base)
                if entry is None:
                    self.device.register(page_base, PAGE)
                    entry = _registered[page_base] = [0]
                entry[0] += 1
            self._page_base = page_base
            self.slot_device = self.device.device_address(page_base) + (self.slot_address - page_base)
            status_ptr, self._status_free = self.device.pinned(8 * STATUS_WORDS, mapped=True)
            self.status_host = np.frombuffer((ctypes.c_int64 * STATUS_WORDS).from_address(status_ptr), np.int64)
            self.status_device = self.device.device_address(status_ptr)
            self.stream, self._stream_destroy = self.device.stream()
        except BaseException:
            self._release()
            raise
        _track(self)

    def bind(self, req_state: Any, req_seqlen: Any, page_state: Any) -> None:
        from dpboard.loads.launch import BLOCK, PreparedLaunch

        p = PreparedLaunch(self.device, "publish", (req_state, req_seqlen, page_state), *self._sources, self.stream)
        p.args.set(page_size=self.page_size, slot=self.slot_device, dp_rank=self.rank, writer_pid=self.pid,
                   node_id=self.node_id, status=self.status_device)
        self._prepared = p
        self._values = p.args.values  # the step's stores go here; cuLaunchKernel copies them
        self._launch = self.device.launch
        self._launch_args = (p.function, p.grid, 1, 1, BLOCK, 1, 1, 0, self.stream, p.args.address, 0)
        self._tables = (req_state, req_seqlen, page_state)

    def launch(self, num_received_reqs: int) -> int:
        self.launch_id += 1
        v = self._values
        v.num_received_reqs = num_received_reqs
        v.timestamp_ns = time.time_ns()  # the kernel cannot read the host clocks: launch time
        v.monotonic_ns = time.monotonic_ns()
        v.launch_id = self.launch_id
        self._launch(*self._launch_args)
        return self.launch_id

    def synchronize(self) -> None:
        self.device.sync(self.stream)
        self.check()

    def _release(self) -> None:
        """Undo what construction did, whatever part of it ran."""
        page_base, self._page_base = self._page_base, None
        if page_base is not None:
            with _registered_lock:
                entry = _registered.get(page_base)
                if entry is not None:
                    entry[0] -= 1
                    if entry[0] == 0:
                        del _registered[page_base]
                        self.device.unregister(page_base)
        for attr in ("_status_free", "_stream_destroy"):
            release = getattr(self, attr)
            setattr(self, attr, None)
            if release is not None:
                release()

    def close(self) -> None:
        if self._page_base is None:
            return
        try:
            self.device.sync(self.stream)
        finally:
            self._release()
            _open.discard(self)


def direct_publisher(writer: Any, page_size: int, backend: str, node_id: int = 0) -> DirectPublisherBase:
    """A GPU-direct publisher for ``backend`` ("cupy" or "numba-cuda"; UnavailableError without a GPU)."""
    if backend == "cupy":
        return CupyDirectPublisher(writer, page_size, node_id)
    if backend == "numba-cuda":
        return NumbaDirectPublisher(writer, page_size, node_id)
    raise InvalidInputError(f"GPU-direct publish needs backend 'cupy' or 'numba-cuda', got {backend!r}")
