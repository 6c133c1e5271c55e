"""A stand-in for CuPy 13 or 14 on a machine without a GPU, for the host side of the ``cupy`` backend.

``fake_cupy(version)`` returns a ``cupy`` module whose ``cuda.runtime`` and ``cuda.driver`` have
exactly the names of that CuPy release (tests/support/cupy_names.py, read from CuPy's sources):
touching a name the release lacks raises AttributeError as the real module would. "Device"
memory is host memory (the address a kernel gets is a host address, as with mapped memory), and
``driver.launchKernel`` runs the launched kernel's rules in Python on that memory: the NumPy
reference for the counters and, for the publish of kernels/loads.cu, its source
(dpboard/loads/formula.py). So the packed arguments,
pointers, registration, pinned buffers and streams of dpboard's CuPy path are exercised for real;
the kernel's CUDA C is tested by nvcc (tests/loads/test_cuda_sources.py) and on a GPU.
"""

from __future__ import annotations

import ctypes
import re
import time
import types
from collections import Counter
from typing import Any

import numpy as np

from dpboard.loads import formula
from dpboard.loads.launch import PUBLISH_ARGS, RAW_ARGS
from dpboard.loads.reference import raw_counts_numpy
from dpboard.snapshot import DIRECT_SLOT_WORDS, DIRECT_STATUS_WORDS, NUM_RAW
from tests.support.cupy_names import DRIVER_NAMES, RUNTIME_NAMES

_C_DTYPES = {"signed char": np.int8, "unsigned char": np.uint8, "short": np.int16, "unsigned short": np.uint16,
             "int": np.int32, "unsigned int": np.uint32, "long long": np.int64}
PAGE = 4096


class CudaError(RuntimeError):
    """What CuPy raises for a failed CUDA call (cupy_backends...CUDARuntimeError)."""


class FakeDeviceArray:
    """A one-dimensional "device" array: host memory behind a ``__cuda_array_interface__`` that
    counts how often it is read (a prepared launch reads it once per binding)."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = np.ascontiguousarray(host)
        self.interface_reads = 0
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self.interface_reads += 1
        return {"shape": self.host.shape, "typestr": self.host.dtype.str, "data": (self.host.ctypes.data, False),
                "version": 3, "strides": None}

    def get(self) -> np.ndarray:
        return self.host.copy()


def _view(ptr: int, n: int, dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    if n == 0:
        return np.zeros(0, dtype)
    return np.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(ptr), dtype)


class FakeGpu:
    """The state behind one fake CuPy: allocations, registrations, streams, launches."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # address -> bytes
        self.host_allocs: dict[int, Any] = {}  # address -> (buffer, flags)
        self.streams: dict[int, int] = {}  # handle -> flags
        self.kernels: dict[int, tuple[str, tuple[Any, ...]]] = {}
        self.events: dict[int, int] = {}
        self.calls: Counter[str] = Counter()
        self.fail_next: set[str] = set()  # names of calls that raise once, as a failing CUDA call would
        self._next_handle = 0x1000

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.fail_next:
            self.fail_next.discard(name)
            raise CudaError(f"{name}: cudaErrorMemoryAllocation (injected)")

    # -- runtime ---------------------------------------------------------------------------------

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:
        self._call("hostRegister")
        if any(a <= ptr < a + n or ptr <= a < ptr + size for a, n in self.registered.items()):
            raise CudaError("cudaErrorHostMemoryAlreadyRegistered")
        self.registered[ptr] = size

    def hostUnregister(self, ptr: int) -> None:
        self._call("hostUnregister")
        if ptr not in self.registered:
            raise CudaError("cudaErrorHostMemoryNotRegistered")
        del self.registered[ptr]

    def hostAlloc(self, size: int, flags: int) -> int:
        self._call("hostAlloc")
        buf = ctypes.create_string_buffer(size)
        self.host_allocs[ctypes.addressof(buf)] = (buf, flags)
        return ctypes.addressof(buf)

    def freeHost(self, ptr: int) -> None:
        self._call("freeHost")
        del self.host_allocs[ptr]

    def pointerGetAttributes(self, ptr: int) -> Any:
        self._call("pointerGetAttributes")
        mapped = any(a <= ptr < a + n for a, n in self.registered.items()) or (
            ptr in self.host_allocs and self.host_allocs[ptr][1] & 2)
        if not mapped:
            raise CudaError("cudaErrorInvalidValue: not mapped host memory")
        return types.SimpleNamespace(device=0, devicePointer=ptr, hostPointer=ptr, type=1)

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._call("memcpyAsync")
        assert stream in self.streams, "a copy on a stream that does not exist"
        ctypes.memmove(dst, src, size)

    def streamCreateWithFlags(self, flags: int) -> int:
        self._call("streamCreateWithFlags")
        self._next_handle += 1
        self.streams[self._next_handle] = flags
        return self._next_handle

    def streamSynchronize(self, stream: int) -> None:
        self._call("streamSynchronize")

    def streamDestroy(self, stream: int) -> None:
        self._call("streamDestroy")
        del self.streams[stream]

    def deviceGetAttribute(self, attrib: int, device: int) -> int:
        return {16: 132}[attrib]  # cudaDevAttrMultiProcessorCount: an H200's

    def getDevice(self) -> int:
        return 0

    def getDeviceCount(self) -> int:
        return 1

    def eventCreateWithFlags(self, flags: int) -> int:
        self._call("eventCreateWithFlags")
        self._next_handle += 1
        self.events[self._next_handle] = 0
        return self._next_handle

    def eventRecord(self, event: int, stream: int) -> None:
        self.events[event] = time.perf_counter_ns()

    def eventSynchronize(self, event: int) -> None:
        pass

    def eventElapsedTime(self, start: int, end: int) -> float:
        return (self.events[end] - self.events[start]) / 1e6  # milliseconds, as CUDA's

    def eventDestroy(self, event: int) -> None:
        del self.events[event]

    # -- driver ----------------------------------------------------------------------------------

    def occupancyMaxActiveBlocksPerMultiprocessor(self, func: int, block: int, smem: int) -> int:
        return 8

    def launchKernel(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int, stream: int,
                     params: int, extra: int) -> None:
        self._call("launchKernel")
        assert stream in self.streams, "a launch on a stream that does not exist"
        kind, dtypes = self.kernels[f]
        if kind == "noop":
            return
        names = RAW_ARGS if kind == "raw_counts" else PUBLISH_ARGS
        pointers = (ctypes.c_void_p * len(names)).from_address(params)
        a = {n: ctypes.c_int64.from_address(pointers[i]).value for i, n in enumerate(names)}
        state, seqlen = _view(a["state"], a["num_requests"], dtypes[0]), _view(a["seqlen"], a["num_requests"], dtypes[1])
        pages = _view(a["pages"], a["num_pages"], dtypes[2])
        raw = raw_counts_numpy(state, seqlen, pages)
        assert not _view(a["accum"], NUM_RAW, np.uint64).any() and _view(a["ticket"], 1, np.uint32)[0] == 0
        if kind == "raw_counts":
            _view(a["raw"], NUM_RAW, np.int64)[:] = raw
        else:
            _publish(a, raw)

    # -- cupy ------------------------------------------------------------------------------------

    def raw_module(self, code: str, options: tuple[str, ...] = (), name_expressions: Any = ()) -> Any:
        functions = {}
        for name in re.findall(r'extern "C" __global__ void (\w+)', code):  # kernels that do nothing
            self._next_handle += 1
            self.kernels[self._next_handle] = ("noop", ())
            functions[name] = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=self._next_handle))
        if name_expressions:
            assert "dpb_publish" in code and any(o.startswith("-I") for o in options)
        for name in name_expressions:
            m = re.fullmatch(r"dpb_(raw_counts|publish)<(.+)>", name)
            assert m, name
            dtypes = tuple(_C_DTYPES[t.strip()] for t in m.group(2).split(","))
            self._next_handle += 1
            self.kernels[self._next_handle] = (m.group(1), dtypes)
            functions[name] = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=self._next_handle))
        return types.SimpleNamespace(get_function=functions.__getitem__)


def _publish(a: dict[str, int], raw: np.ndarray) -> None:
    """dpb_publish's host-visible effect: what its last block runs, ``formula.publish_raw`` (the source
    of kernels/dpboard_loads.h), here with the host's primitives, on the status words and the slot."""
    formula.publish_raw(raw.tolist(), a["num_pages"], a["page_size"], _view(a["slot"], DIRECT_SLOT_WORDS, np.int64),
                        _view(a["status"], DIRECT_STATUS_WORDS, np.int64), a["dp_rank"], a["num_received_reqs"],
                        a["timestamp_ns"], a["monotonic_ns"], a["writer_pid"], a["node_id"], a["launch_id"])


def _restricted(name: str, names: frozenset[str], impl: Any) -> types.ModuleType:
    """A module with exactly ``names``: implemented ones call ``impl``, others fail when called."""
    mod = types.ModuleType(name)
    for n in names:
        attr = getattr(impl, n, None)
        if attr is None:
            def missing(*args: Any, _n: str = n) -> Any:
                raise NotImplementedError(f"the fake CuPy does not implement {_n}")
            attr = missing
        setattr(mod, n, attr)
    return mod


def fake_cupy(version: str) -> tuple[types.ModuleType, FakeGpu]:
    """(the ``cupy`` module, its GPU state) for CuPy ``version`` ("13.6.0" or "14.2.0")."""
    gpu = FakeGpu()
    cupy = types.ModuleType("cupy")
    cupy.__version__ = version
    runtime = _restricted("cupy.cuda.runtime", RUNTIME_NAMES[version], gpu)
    # The enum constants keep their values (the real module's ints).
    for n, v in (("memcpyDeviceToHost", 2), ("streamNonBlocking", 1), ("hostAllocMapped", 2),
                 ("hostAllocPortable", 1)):
        setattr(runtime, n, v)
    driver = _restricted("cupy.cuda.driver", DRIVER_NAMES[version], gpu)
    cupy.cuda = types.SimpleNamespace(runtime=runtime, driver=driver)
    cupy.RawModule = gpu.raw_module
    cupy.zeros = lambda n, dtype=np.float64: FakeDeviceArray(np.zeros(n, dtype))
    cupy.asarray = lambda x: FakeDeviceArray(np.asarray(x))
    return cupy, gpu
