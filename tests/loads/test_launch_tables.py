"""A prepared launch checks its tables itself (issue 28, item 15).

``table_pointer`` used to take a 2-D table as its first dimension (the kernel then read part of it)
and to fail with a bare ``KeyError`` on a dtype the kernels have no instance for (uint64, float).
Both are now an ``InvalidInputError`` naming the table. Exercised on the CPU through the real
launch code: ``NullDevice`` with host-backed tables (what ``dpboard bench kernels --host-overhead``
runs), and the CuPy device over the CuPy stand-in (tests/support/fake_cupy.py).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dpboard.errors import InvalidInputError
from dpboard.loads import launch
from dpboard.loads.cuda import CupyRunner
from tests.support.fake_cupy import FakeDeviceArray, fake_cupy

N_REQ, N_PAGES = 12, 40


def good() -> dict[str, np.ndarray]:
    return {"req_state": np.zeros(N_REQ, np.int8), "req_seqlen": np.zeros(N_REQ, np.int32),
            "page_state": np.zeros(N_PAGES, np.int8)}


def null_device_launch(tables: dict[str, np.ndarray]) -> launch.PreparedLaunch:
    wrapped = tuple(launch.HostBackedTable(tables[w]) for w in ("req_state", "req_seqlen", "page_state"))
    return launch.PreparedLaunch(launch.NullDevice(), "raw_counts", wrapped, "", "", 0)


@pytest.fixture
def cupy_device(monkeypatch):
    cupy, _ = fake_cupy("14.2.0")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return launch.CupyDevice(cupy)


def cupy_launch(device: launch.CupyDevice, tables: dict[str, np.ndarray]) -> launch.CupyRawCounts:
    wrapped = tuple(FakeDeviceArray(tables[w]) for w in ("req_state", "req_seqlen", "page_state"))
    return CupyRunner(device).prepare(*wrapped)  # the backend's own path to a prepared launch


BAD = [
    ("page_state", lambda t: t.reshape(4, 10), r"page_state must be one-dimensional, got shape \(4, 10\)"),
    ("req_state", lambda t: t.reshape(3, 4), r"req_state must be one-dimensional, got shape \(3, 4\)"),
    ("req_seqlen", lambda t: t.astype(np.uint64), r"req_seqlen has dtype <u8 \(uint64\)"),
    ("page_state", lambda t: t.astype(np.float32), r"page_state has dtype <f4 \(float32\)"),
    ("req_state", lambda t: t.astype(np.float64), r"req_state has dtype <f8 \(float64\)"),
    ("req_seqlen", lambda t: t.astype(">i4"), r"req_seqlen has dtype >i4"),
]


def test_good_tables_bind_with_their_lengths():
    p = null_device_launch(good())
    assert p.num_pages == N_PAGES and p.args.values.num_requests == N_REQ


@pytest.mark.parametrize(("what", "change", "message"), BAD)
def test_a_bad_table_is_named_on_the_null_device(what, change, message):
    tables = good()
    tables[what] = change(tables[what])
    if what != "page_state" and tables[what].ndim == 2:  # keep the rows matching: only the shape is wrong
        tables["req_seqlen" if what == "req_state" else "req_state"] = np.zeros(3, np.int32)
    with pytest.raises(InvalidInputError, match=message):
        null_device_launch(tables)


@pytest.mark.parametrize(("what", "change", "message"), BAD)
def test_a_bad_table_is_named_on_the_cupy_device(cupy_device, what, change, message):
    tables = good()
    tables[what] = change(tables[what])
    with pytest.raises(InvalidInputError, match=message):
        cupy_launch(cupy_device, tables)


def test_a_bad_dtype_never_reaches_the_kernel_lookup():
    """The message lists what the kernels take, and nothing was compiled for the bad one."""
    tables = good()
    tables["page_state"] = tables["page_state"].astype(np.uint64)
    with pytest.raises(InvalidInputError) as info:
        null_device_launch(tables)
    assert "int8, uint8, int16, uint16, int32, uint32, int64" in str(info.value)
    assert not isinstance(info.value, KeyError)
