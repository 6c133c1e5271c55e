"""GPU-direct publish: the load kernel's last block writes the snapshot into the board slot itself.

The slot's page is registered with CUDA as mapped host memory (``cudaHostRegister`` for CuPy,
``mempin(mapped=True)`` for numba-cuda) and the kernel honours the seqlock with system-scope fences,
so a scheduler publishes with no device-to-host synchronisation at all. The kernels are built in
``dpboard.loads.cuda`` (the numba-cuda ``publish_kernel``, the CUDA C ``dpb_publish``); this module
is their host side: registration, launch, the status words and their check.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.loads.cuda import CupyRunner, NumbaCudaRunner, cupy_function, grid_size, simulator_enabled
from dpboard.loads.tables import array_info
from dpboard.snapshot import DIRECT_SLOT_WORDS, DIRECT_STATUS_INDEX, DIRECT_STATUS_WORDS

ST_LAUNCH_ID, ST_PUBLISHED, ST_BAD_REQ, ST_BAD_PAGE, ST_BAD_SEQLEN, ST_PUBLISH_SEQ = (
    DIRECT_STATUS_INDEX[name] for name in (
        "launch_id", "published", "bad_req_states", "bad_page_states", "bad_seqlens", "publish_seq"))
STATUS_WORDS = DIRECT_STATUS_WORDS

PAGE = mmap.PAGESIZE
_registered: dict[int, list[Any]] = {}  # page address -> [refcount, handle]
_registered_lock = threading.Lock()


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
            self.slot = device_page[offset : offset + 8 * DIRECT_SLOT_WORDS].view(np.int64)
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
        grid = grid_size(max(state.shape[0], pages.shape[0]), r.block, r.max_blocks)
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
    """A GPU-direct publisher for ``backend`` ("cupy" or "numba-cuda"; UnavailableError without a GPU)."""
    if backend == "cupy":
        return CupyDirectPublisher(writer, page_size, node_id)
    if backend == "numba-cuda":
        return NumbaDirectPublisher(writer, page_size, node_id)
    raise InvalidInputError(f"GPU-direct publish needs backend 'cupy' or 'numba-cuda', got {backend!r}")
