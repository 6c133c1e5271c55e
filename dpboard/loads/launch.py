"""Prepared launches of the CUDA C kernels (kernels/loads.cu) through CuPy: the hot path of the
``cupy`` backend and of GPU-direct publish with CuPy (docs/KERNELS.md, "What a step costs").

Everything a launch needs is resolved once per binding of tables: the compiled kernel for their
dtypes, the device pointers, the grid, the argument block that ``cuLaunchKernel`` reads (packed
once with ctypes), a pinned host buffer for the nine raw counters and a non-blocking stream. A step
is then three calls into CUDA and no Python object built from the tables::

    launch(function, grid, 1, 1, BLOCK, 1, 1, 0, stream, params, 0)   # cuLaunchKernel
    copy(raw_host, raw_device, 72, DEVICE_TO_HOST, stream)             # cudaMemcpyAsync, pinned
    sync(stream)                                                       # cudaStreamSynchronize

Only names that CuPy 13 and CuPy 14 both have are used (``cupy.cuda.runtime``: hostAlloc, freeHost,
hostRegister, hostUnregister, pointerGetAttributes, memcpyAsync, streamCreateWithFlags,
streamSynchronize, streamDestroy, deviceGetAttribute, getDevice; ``cupy.cuda.driver``:
launchKernel, occupancyMaxActiveBlocksPerMultiprocessor). Neither has the ``cudaHostRegister*``
flag constants nor ``hostGetDevicePointer``: the flags are the CUDA enums' values, written below,
and the device address of mapped host memory comes from ``pointerGetAttributes``.

``NullDevice`` stands in for the GPU with the same interface and no-op launch, copy and sync, so
``dpboard bench kernels --host-overhead`` measures the per-step Python cost of this exact code on a
machine without a GPU.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.snapshot import NUM_RAW

# CUDA enum values (the same in every CUDA release): CuPy 13 and 14 do not export all of them.
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped
HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable
HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped
MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost
STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking
DEV_ATTR_MULTIPROCESSOR_COUNT = 16  # cudaDevAttrMultiProcessorCount

BLOCK = 256  # threads per block (a multiple of 32)
VEC_BYTES = 16  # the kernel reads its tables in 16-byte chunks
# Blocks per multiprocessor: on an H200, 2 per SM (264 blocks) ran the counting kernel in 9.1-9.4 µs
# where 1024 blocks took 12.7-14 µs (docs/BENCHMARKS.md): fewer blocks, fewer atomics and tickets.
BLOCKS_PER_SM = 2
MAX_ENTRIES = 1 << 32  # the kernel's per-thread counts are 32-bit
RAW_BYTES = 8 * NUM_RAW

_C_TYPES = {
    np.dtype(np.int8): "signed char",
    np.dtype(np.uint8): "unsigned char",
    np.dtype(np.int16): "short",
    np.dtype(np.uint16): "unsigned short",
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "unsigned int",
    np.dtype(np.int64): "long long",
}


def kernel_name(kind: str, dtypes: tuple[np.dtype, np.dtype, np.dtype]) -> str:
    """The name expression of ``dpb_raw_counts`` / ``dpb_publish`` for these table dtypes."""
    return f"dpb_{kind}<{', '.join(_C_TYPES[np.dtype(d).newbyteorder('=')] for d in dtypes)}>"


def _noop(*args: Any) -> None:
    return None


class KernelArgs:
    """A kernel's arguments packed once in C layout, and the ``void *[]`` that ``cuLaunchKernel``
    reads: a launch passes one address; a field set between launches (a timestamp) is one store."""

    def __init__(self, names: tuple[str, ...]) -> None:
        # Every argument of dpb_raw_counts / dpb_publish is 8 bytes: a pointer or an int64.
        fields = [(name, ctypes.c_int64) for name in names]
        self.values = type("KernelArgValues", (ctypes.Structure,), {"_fields_": fields})()
        base = ctypes.addressof(self.values)
        cls = type(self.values)
        self.pointers = (ctypes.c_void_p * len(names))(*(base + getattr(cls, n).offset for n in names))
        self.address = ctypes.addressof(self.pointers)

    def set(self, **values: int) -> None:
        for name, value in values.items():
            setattr(self.values, name, int(value))


class CupyDevice:
    """The CUDA calls of the CuPy backend, through ``cupy.cuda.runtime`` and ``cupy.cuda.driver``."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        self.driver = cupy.cuda.driver
        self.launch: Callable[..., Any] = self.driver.launchKernel
        self.copy: Callable[..., Any] = self.rt.memcpyAsync
        self.sync: Callable[..., Any] = self.rt.streamSynchronize
        self._functions: dict[str, Any] = {}
        self._resident: dict[int, int] = {}

    def function(self, kind: str, dtypes: tuple[np.dtype, np.dtype, np.dtype], source: str,
                 include_dir: str) -> tuple[Any, int]:
        """(keep-alive, CUfunction) of the kernel for these dtypes (NVRTC, once per process)."""
        name = kernel_name(kind, dtypes)
        fn = self._functions.get(name)
        if fn is None:
            module = self.cupy.RawModule(code=source, options=("-std=c++17", f"-I{include_dir}"),
                                         name_expressions=[name])
            fn = self._functions[name] = module.get_function(name)
        return fn, int(fn.kernel.ptr)

    def max_blocks(self, function: int) -> int:
        """Blocks that run at once: the multiprocessors times BLOCKS_PER_SM (or fewer, if the
        kernel's registers allow fewer per multiprocessor)."""
        blocks = self._resident.get(function)
        if blocks is None:
            sms = self.rt.deviceGetAttribute(DEV_ATTR_MULTIPROCESSOR_COUNT, self.rt.getDevice())
            per_sm = self.driver.occupancyMaxActiveBlocksPerMultiprocessor(function, BLOCK, 0)
            blocks = self._resident[function] = max(1, sms * max(1, min(BLOCKS_PER_SM, per_sm)))
        return blocks

    def zeros(self, n: int, dtype: Any) -> tuple[Any, int]:
        """(keep-alive, device address) of n zeros."""
        arr = self.cupy.zeros(n, dtype=dtype)
        return arr, int(arr.data.ptr)

    def pinned(self, nbytes: int, mapped: bool = False) -> tuple[int, Callable[[], None]]:
        """(address, free) of zeroed page-locked host memory; mapped: the GPU can address it."""
        flags = HOST_ALLOC_MAPPED | HOST_ALLOC_PORTABLE if mapped else 0
        ptr = self.rt.hostAlloc(nbytes, flags)
        ctypes.memset(ptr, 0, nbytes)
        return ptr, lambda: self.rt.freeHost(ptr)

    def device_address(self, host_ptr: int) -> int:
        """The device address of mapped (registered or hostAlloc'd) host memory."""
        return int(self.rt.pointerGetAttributes(host_ptr).devicePointer)

    def register(self, ptr: int, nbytes: int) -> None:
        self.rt.hostRegister(ptr, nbytes, HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE)

    def unregister(self, ptr: int) -> None:
        self.rt.hostUnregister(ptr)

    def stream(self) -> tuple[int, Callable[[], None]]:
        """(handle, destroy) of a new non-blocking stream."""
        stream = self.rt.streamCreateWithFlags(STREAM_NON_BLOCKING)
        return stream, lambda: self.rt.streamDestroy(stream)


class NullDevice:
    """``CupyDevice``'s interface with nothing behind it: launch, copy and sync do nothing, memory
    is host memory. For measuring the host side of a step where there is no GPU."""

    launch = copy = sync = staticmethod(_noop)
    RESIDENT_BLOCKS = 264  # an H200: 132 multiprocessors x BLOCKS_PER_SM

    def function(self, kind: str, dtypes: tuple[np.dtype, np.dtype, np.dtype], source: str,
                 include_dir: str) -> tuple[Any, int]:
        kernel_name(kind, dtypes)  # the same dtype check as a real compile
        return None, 0

    def max_blocks(self, function: int) -> int:
        return self.RESIDENT_BLOCKS

    def zeros(self, n: int, dtype: Any) -> tuple[Any, int]:
        arr = np.zeros(n, dtype=dtype)
        return arr, arr.ctypes.data

    def pinned(self, nbytes: int, mapped: bool = False) -> tuple[int, Callable[[], None]]:
        buf = ctypes.create_string_buffer(nbytes)
        return ctypes.addressof(buf), lambda: buf  # freed with the closure

    def device_address(self, host_ptr: int) -> int:
        return host_ptr

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass

    def stream(self) -> tuple[int, Callable[[], None]]:
        return 0, _noop


def table_pointer(x: Any, what: str) -> tuple[int, np.dtype, int]:
    """(device address, dtype, length) of a contiguous one-dimensional device table, read from its
    ``__cuda_array_interface__`` (once per binding)."""
    cai = x.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    if len(shape) != 1:
        # A 2-D table's first dimension is not its length: the kernel would read part of it.
        raise InvalidInputError(f"{what} must be one-dimensional, got shape {shape}: pass {what}.reshape(-1)")
    if dtype not in _C_TYPES:  # also a non-native byte order: the kernels read native integers
        raise InvalidInputError(
            f"{what} has dtype {dtype.str} ({dtype.name}); the CUDA kernels take native "
            f"{', '.join(d.name for d in _C_TYPES)}: pass {what}.astype(cupy.int32)")
    strides = cai.get("strides")
    if strides not in (None, (dtype.itemsize,)) and cai["shape"][0] > 1:
        raise InvalidInputError(
            f"{what} must be contiguous on the device: pass {what}.contiguous() / cupy.ascontiguousarray({what})")
    n = int(cai["shape"][0])
    if n >= MAX_ENTRIES:
        raise InvalidInputError(f"{what} has {n} entries; the CUDA kernels count up to 2**32 - 1 per table")
    return int(cai["data"][0]), dtype, n


def grid_for(device: Any, function: int, dtypes: tuple[np.dtype, ...], num_requests: int, num_pages: int) -> int:
    """Blocks for these tables: one 16-byte chunk per thread, at most what runs at once."""
    row_chunks = -(-num_requests // (VEC_BYTES // max(dtypes[0].itemsize, dtypes[1].itemsize)))
    page_chunks = -(-num_pages // (VEC_BYTES // dtypes[2].itemsize))
    wanted = -(-max(row_chunks, page_chunks) // BLOCK)
    return max(1, min(wanted, device.max_blocks(function)))


RAW_ARGS = ("state", "seqlen", "num_requests", "pages", "num_pages", "accum", "ticket", "raw")
PUBLISH_ARGS = ("state", "seqlen", "num_requests", "pages", "num_pages", "page_size", "accum", "ticket", "slot",
                "dp_rank", "num_received_reqs", "timestamp_ns", "monotonic_ns", "writer_pid", "node_id", "status",
                "launch_id")


class PreparedLaunch:
    """One kernel bound to one set of device tables: its grid, its packed arguments, its stream,
    and its own accumulators (two bindings never share a ticket)."""

    def __init__(self, device: Any, kind: str, tables: tuple[Any, Any, Any], source: str, include_dir: str,
                 stream: int) -> None:
        (s_ptr, s_dt, n_req), (l_ptr, l_dt, n_seq), (p_ptr, p_dt, n_pages) = (
            table_pointer(x, what) for x, what in zip(tables, ("req_state", "req_seqlen", "page_state"), strict=True))
        if n_req != n_seq:
            raise InvalidInputError(f"req_state has {n_req} rows but req_seqlen has {n_seq}")
        self.device = device
        self.tables = tables  # kept alive: the pointers below are theirs
        self.num_pages = n_pages
        self._kernel, self.function = device.function(kind, (s_dt, l_dt, p_dt), source, include_dir)
        self.grid = grid_for(device, self.function, (s_dt, l_dt, p_dt), n_req, n_pages)
        self._accum, accum = device.zeros(NUM_RAW, np.uint64)
        self._ticket, ticket = device.zeros(1, np.uint32)
        self.args = KernelArgs(RAW_ARGS if kind == "raw_counts" else PUBLISH_ARGS)
        self.args.set(state=s_ptr, seqlen=l_ptr, num_requests=n_req, pages=p_ptr, num_pages=n_pages, accum=accum,
                      ticket=ticket)
        self.stream = stream

    def same_tables(self, state: Any, seqlen: Any, pages: Any) -> bool:
        t = self.tables
        return state is t[0] and seqlen is t[1] and pages is t[2]


def _release_with(owner: object, release: Callable[[], Any]) -> None:
    """Run ``release`` when ``owner`` is collected, but not at interpreter exit: CUDA may be torn
    down by then, a failed call would print, and the process's memory goes back anyway."""
    weakref.finalize(owner, release).atexit = False


class CupyRawCounts:
    """The ``cupy`` backend's raw counters of one set of device tables: a launch, an asynchronous
    72-byte copy into pinned memory, one stream synchronisation."""

    def __init__(self, device: Any, tables: tuple[Any, Any, Any], source: str, include_dir: str) -> None:
        stream, destroy = device.stream()
        _release_with(self, destroy)
        self.prepared = PreparedLaunch(device, "raw_counts", tables, source, include_dir, stream)
        self._raw_dev_keep, self._raw_dev = device.zeros(NUM_RAW, np.int64)
        self.prepared.args.set(raw=self._raw_dev)
        self._raw_host, free = device.pinned(RAW_BYTES)
        _release_with(self, free)
        self.raw = np.frombuffer((ctypes.c_int64 * NUM_RAW).from_address(self._raw_host), np.int64)
        p = self.prepared
        # The hot path's calls and arguments, looked up once.
        self._launch, self._copy, self._sync = device.launch, device.copy, device.sync
        self._launch_args = (p.function, p.grid, 1, 1, BLOCK, 1, 1, 0, stream, p.args.address, 0)
        self._copy_args = (self._raw_host, self._raw_dev, RAW_BYTES, MEMCPY_DEVICE_TO_HOST, stream)
        self._stream = stream

    def same_tables(self, state: Any, seqlen: Any, pages: Any) -> bool:
        return self.prepared.same_tables(state, seqlen, pages)

    def raw_counts(self) -> np.ndarray:
        """The nine raw counters (a view of the pinned buffer, valid until the next call)."""
        self._launch(*self._launch_args)
        self._copy(*self._copy_args)
        self._sync(self._stream)
        return self.raw


class HostBackedTable:
    """A host array presented as a device table (a plain ``__cuda_array_interface__`` dict), for
    runs on ``NullDevice``: nothing ever dereferences its address there."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = np.ascontiguousarray(host)
        self.__cuda_array_interface__ = {"shape": self.host.shape, "typestr": self.host.dtype.str,
                                         "data": (self.host.ctypes.data, False), "version": 3, "strides": None}
