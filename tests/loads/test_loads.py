"""compute_loads: the CPU backends against the NumPy reference, the formulas, and bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpboard import KVLoads, PageState, ReqState, compute_loads
from dpboard.loads.reference import raw_counts_numpy

CPU_BACKENDS = ("numpy", "numba", "auto")
STATE_DTYPES = (np.int8, np.uint8, np.int32, np.int64)
SEQLEN_DTYPES = (np.int32, np.int64)


def by_hand(states, seqlens, pages, page_size) -> KVLoads:
    """The formulas of docs/KERNELS.md over Python lists, as plainly as they can be written."""
    S = ReqState
    used = sum(1 for p in pages if p == PageState.USED) * page_size
    total = used + sum(n for s, n in zip(states, seqlens, strict=True) if s in (S.WAITING, S.BOOTSTRAP, S.PREALLOC, S.RETRACTED))
    awaiting = sum(n for s, n in zip(states, seqlens, strict=True) if s in (S.PREALLOC, S.TRANSFER))
    return KVLoads(
        num_running_reqs=sum(1 for s in states if s == S.RUNNING),
        num_waiting_reqs=sum(1 for s in states if s not in (S.FREE, S.RUNNING)),
        num_used_tokens=used,
        num_total_tokens=total,
        num_active_tokens=max(0, total - awaiting),
        max_total_num_tokens=len(pages) * page_size,
    )


@st.composite
def tables(draw):
    """Random tables: sizes, dtypes and value ranges drawn by hypothesis, contents from a drawn seed."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_req = draw(st.integers(0, 300))
    # below and above one 255-word block of byte pages (2040 pages), where the byte pass changes method
    n_pages = draw(st.one_of(st.integers(0, 600), st.integers(2000, 6200)))
    req_codes = draw(st.sampled_from([list(ReqState), [ReqState.FREE], [ReqState.PREALLOC, ReqState.TRANSFER]]))
    page_codes = draw(st.sampled_from([list(PageState), [PageState.FREE], [PageState.USED], [PageState.EVICTABLE]]))
    seqlen_dtype = draw(st.sampled_from(SEQLEN_DTYPES))
    low, high = draw(st.sampled_from([(0, 5000), (2**31 - 1000, 2**31 - 1), (0, 2**31 - 1)]))
    return (
        rng.choice(req_codes, n_req).astype(draw(st.sampled_from(STATE_DTYPES))),
        rng.integers(low, high, n_req, endpoint=True).astype(seqlen_dtype),
        rng.choice(page_codes, n_pages).astype(draw(st.sampled_from(STATE_DTYPES))),
        draw(st.sampled_from([1, 16, 64])),
    )


@settings(max_examples=80, deadline=None)
@given(tables())
def test_cpu_backends_equal_the_reference(t):
    state, seqlen, pages, page_size = t
    reference = compute_loads(state, seqlen, pages, page_size=page_size, backend="numpy")
    assert reference == by_hand(state.tolist(), seqlen.tolist(), pages.tolist(), page_size)
    for backend in ("numba", "auto"):
        assert compute_loads(state, seqlen, pages, page_size=page_size, backend=backend) == reference
    # The parallel passes too, whatever the size.
    from dpboard.loads import cpu

    serial = cpu.raw_counts(state, seqlen, pages)
    parallel = cpu.raw_counts(state, seqlen, pages, req_parallel_min=0, page_parallel_min=0)
    assert serial.tolist() == parallel.tolist() == raw_counts_numpy(state, seqlen, pages).tolist()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_state_counts_where_the_spec_says(backend):
    S = ReqState
    state = np.array([S.FREE, S.RUNNING, S.WAITING, S.BOOTSTRAP, S.PREALLOC, S.TRANSFER, S.RETRACTED], np.int8)
    seqlen = np.array([-5, 10, 100, 1_000, 10_000, 100_000, 1_000_000], np.int64)  # a FREE row's seqlen is ignored
    pages = np.array([PageState.FREE, PageState.USED, PageState.USED, PageState.EVICTABLE], np.uint8)
    loads = compute_loads(state, seqlen, pages, page_size=16, backend=backend)
    used = 2 * 16
    total = used + 100 + 1_000 + 10_000 + 1_000_000
    assert loads == KVLoads(
        num_running_reqs=1,
        num_waiting_reqs=5,
        num_used_tokens=used,
        num_total_tokens=total,
        num_active_tokens=total - 10_000 - 100_000,
        max_total_num_tokens=64,
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_active_tokens_never_negative(backend):
    state = np.array([ReqState.TRANSFER] * 3, np.int8)
    seqlen = np.array([500, 500, 500], np.int32)
    loads = compute_loads(state, seqlen, np.zeros(4, np.int8), page_size=1, backend=backend)
    assert loads.num_total_tokens == 0
    assert loads.num_active_tokens == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_and_all_free_tables(backend):
    empty = compute_loads(np.zeros(0, np.int8), np.zeros(0, np.int32), np.zeros(0, np.int8), page_size=16,
                          backend=backend)
    assert empty == KVLoads(0, 0, 0, 0, 0, 0)
    free = compute_loads(np.zeros(100, np.int8), np.full(100, 7, np.int32), np.zeros(1000, np.int8), page_size=16,
                         backend=backend)
    assert free == KVLoads(0, 0, 0, 0, 0, 16_000)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_overflow_with_huge_seqlens_and_a_million_pages(backend):
    n = 16384
    state = np.full(n, ReqState.WAITING, np.int8)
    seqlen = np.full(n, 2**31 - 1, np.int32)
    pages = np.ones(1 << 20, np.int8)
    loads = compute_loads(state, seqlen, pages, page_size=64, backend=backend)
    assert loads.num_used_tokens == (1 << 20) * 64
    assert loads.num_total_tokens == (1 << 20) * 64 + n * (2**31 - 1)
    assert loads.num_total_tokens > 2**44  # far beyond int32 and uint32


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_page_table_tail_and_strided_tables(backend):
    pages = np.array([0, 1, 2, 1, 0, 2, 2, 1, 0, 2, 1], np.int8)  # 11: one word of 8 and a tail of 3
    loads = compute_loads(np.zeros(0, np.int8), np.zeros(0, np.int32), pages, page_size=1, backend=backend)
    assert loads.num_used_tokens == 4
    strided = np.repeat(pages, 2)[::2]  # not contiguous: the byte-wise pass must not be used
    assert compute_loads(np.zeros(0, np.int8), np.zeros(0, np.int32), strided, page_size=1, backend=backend) == loads


def test_lists_are_accepted():
    assert compute_loads([1, 2], [3, 4], [1, 0], page_size=2) == KVLoads(1, 1, 2, 6, 6, 4)


# -- bad input -------------------------------------------------------------------------------------


def good():
    return np.array([1, 2], np.int8), np.array([10, 20], np.int32), np.array([0, 1, 2], np.int8)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("page_size", [0, -16, 1.5, "16", True])
def test_bad_page_size(backend, page_size):
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        compute_loads(*good(), page_size=page_size, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mismatched_lengths(backend):
    state, _, pages = good()
    with pytest.raises(ValueError, match="req_state has 2 rows but req_seqlen has 3"):
        compute_loads(state, np.zeros(3, np.int32), pages, page_size=1, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, np.uint64, np.complex64])
def test_non_integer_dtypes(backend, which, dtype):
    arrays = list(good())
    arrays[which] = arrays[which].astype(dtype)
    name = ("req_state", "req_seqlen", "page_state")[which]
    with pytest.raises(ValueError, match=f"{name} has dtype"):
        compute_loads(*arrays, page_size=1, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_two_dimensional_tables(backend):
    state, seqlen, pages = good()
    with pytest.raises(ValueError, match="page_state must be one-dimensional"):
        compute_loads(state, seqlen, pages.reshape(1, 3), page_size=1, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("code", [7, 100, -1])
def test_unknown_request_state(backend, code):
    state, seqlen, pages = good()
    state = np.array([1, 2, 1, code, 2], np.int16)
    with pytest.raises(ValueError, match=rf"outside ReqState .* req_state\[3\] = {code}"):
        compute_loads(state, np.ones(5, np.int32), pages, page_size=1, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32])
@pytest.mark.parametrize("code", [3, 127, -1])
def test_unknown_page_state(backend, dtype, code):
    if code < 0 and dtype == np.uint8:
        code = 255
    state, seqlen, _ = good()
    pages = np.zeros(21, dtype)  # the bad code sits in the word-wise part of the byte pass
    pages[9] = np.array(code).astype(dtype)
    with pytest.raises(ValueError, match=rf"outside PageState .* page_state\[9\] = {code}"):
        compute_loads(state, seqlen, pages, page_size=1, backend=backend)
    pages = np.zeros(21, dtype)  # and in the tail
    pages[20] = np.array(code).astype(dtype)
    with pytest.raises(ValueError, match=r"page_state\[20\]"):
        compute_loads(state, seqlen, pages, page_size=1, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_negative_seqlen(backend):
    state, _, pages = good()
    with pytest.raises(ValueError, match=r"outside \[0, 4294967296\].* req_seqlen\[1\] = -3"):
        compute_loads(state, np.array([5, -3], np.int32), pages, page_size=1, backend=backend)


# -- int64 sums that would overflow ----------------------------------------------------------------


OVERFLOWING = [
    # four WAITING rows of 2**62 tokens: their sum wraps to 0, and num_total_tokens used to be
    # published as the used tokens alone (32)
    ([ReqState.WAITING] * 4, [2**62] * 4),
    ([ReqState.PREALLOC, ReqState.TRANSFER], [2**63 - 1, 2**63 - 1]),  # seqlen awaiting transfer
    ([ReqState.RUNNING, ReqState.WAITING], [2**40, 10]),  # a running row is not summed, but is still wrong
    ([ReqState.WAITING], [2**32 + 1]),  # the first value past the bound
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("states", "seqlens"), OVERFLOWING)
def test_seqlens_that_would_overflow_the_sums_are_refused(backend, states, seqlens):
    from dpboard.loads import cpu

    state = np.array(states, np.int8)
    seqlen = np.array(seqlens, np.int64)
    pages = np.array([PageState.USED, PageState.USED], np.int8)
    with pytest.raises(ValueError, match=r"outside \[0, 4294967296\] \(2\*\*32 tokens\) in rows that are not FREE"):
        compute_loads(state, seqlen, pages, page_size=16, backend=backend)
    # the parallel passes count it alike
    raw = cpu.raw_counts(state, seqlen, pages, req_parallel_min=0, page_parallel_min=0)
    assert raw.tolist() == raw_counts_numpy(state, seqlen, pages).tolist()
    assert raw[8] >= 1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_largest_seqlens_sum_exactly(backend):
    n = 1000
    state = np.full(n, ReqState.WAITING, np.int8)
    state[::2] = ReqState.PREALLOC
    state[0] = ReqState.FREE
    seqlen = np.full(n, 2**32, np.int64)
    seqlen[0] = 2**62  # a FREE row's seqlen is ignored, whatever it is
    pages = np.zeros(10, np.uint8)
    loads = compute_loads(state, seqlen, pages, page_size=2**40, backend=backend)
    assert loads.num_total_tokens == (n - 1) * 2**32
    assert loads.num_active_tokens == (n - 1) * 2**32 - (n // 2 - 1) * 2**32


def test_a_request_table_whose_sums_could_overflow_is_refused():
    # shape without memory: a real array of 2**33 rows, every one the same int32 element
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), shape=(2**33,), strides=(0,))
    with pytest.raises(ValueError, match="could overflow int64 sums"):
        compute_loads(huge, huge, np.zeros(1, np.int8),
                      page_size=1, backend="numpy")


@pytest.mark.parametrize("backend", ["numpy", "numba", "auto", "numba-cuda", "cupy"])
@pytest.mark.parametrize("which", ["req_state", "req_seqlen", "page_state"])
def test_another_byte_order_is_refused_by_every_backend(backend, which):
    """'>i4' tables passed the checks, then the Numba backend raised a TypingError traceback."""
    tables = {"req_state": np.array([1, 2], np.int32), "req_seqlen": np.array([5, 7], np.int32),
              "page_state": np.array([0, 1, 2], np.int32)}
    tables[which] = tables[which].astype(">i4")
    with pytest.raises(ValueError, match=rf"{which} has dtype >i4, which is not this machine's byte order.*"
                                         rf"astype\(int32\)"):
        compute_loads(tables["req_state"], tables["req_seqlen"], tables["page_state"], page_size=1,
                      backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'numpy', 'numba', 'numba-cuda', 'cupy'"):
        compute_loads(*good(), page_size=1, backend="torch")


def test_not_an_array():
    with pytest.raises(ValueError, match="req_seqlen has dtype object"):
        compute_loads(np.zeros(2, np.int8), object(), np.zeros(2, np.int8), page_size=1)


@pytest.mark.parametrize("backend", ["cupy", "numba-cuda"])
def test_cuda_backend_without_a_gpu_names_the_fix(backend):
    from dpboard.loads import cuda

    if backend == "cupy" and cuda.cupy_available():
        pytest.skip("this machine has CuPy and a GPU")
    if backend == "numba-cuda":
        from numba import cuda

        if cuda.is_available():
            pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(RuntimeError, match="backend='numba'"):
        compute_loads(*good(), page_size=1, backend=backend)


def test_importing_loads_does_not_import_numba():
    code = "import sys, dpboard.loads, dpboard; dpboard.ReqState; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


_CACHE_PROBE = """
import sys
import numpy as np
from dpboard.loads import cpu
build = getattr(cpu, sys.argv[1])
build(np.zeros(4, np.int8), np.zeros(4, np.int32), np.zeros(9, np.int64))
print(sum(build.stats.cache_hits.values()))
"""


@pytest.mark.parametrize("first, second", [("_req_pass_parallel", "_req_pass_serial"),
                                           ("_req_pass_serial", "_req_pass_parallel")])
def test_serial_and_parallel_builds_keep_their_own_disk_cache(tmp_path, first, second):
    """Both builds of a pass come from one function, and Numba's disk cache keys a function by its name
    and bytecode, not by ``parallel=``: one build must never load the other's compiled code."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def cache_hits(build: str) -> int:
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE, build], capture_output=True, text=True,
                             timeout=120, check=True, env=env)
        return int(out.stdout)

    assert cache_hits(first) == 0
    assert cache_hits(first) == 1  # the cache does serve a build its own code
    assert cache_hits(second) == 0

@pytest.mark.parametrize("n_pages", [2040, 2047, 4080 + 13, 1 << 16])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_bad_page_codes_are_counted_exactly_in_blocks_and_tail(n_pages, dtype):
    """The byte pass counts whole 255-word blocks in byte lanes and only flags codes above 2; the
    count of bad codes must still be exact wherever they sit, serial and parallel alike."""
    from dpboard.loads import cpu

    rng = np.random.default_rng(n_pages)
    state, seqlen, _ = good()
    bad_values = [3, 7, 0x7F, 0x80, 0xFF] if dtype == np.uint8 else [3, 7, 0x7F, -1, -128]
    # each bad value alone (so that no other bad byte raises the flag for it), then several at once
    cases = [[(pos, v)] for v in bad_values for pos in (0, 2039, n_pages // 2, n_pages - 1)]
    cases.append([(5, bad_values[0]), (2039, bad_values[3]), (n_pages // 2, bad_values[4]),
                  (n_pages - 1, bad_values[2])])
    for case in cases:
        pages = rng.integers(0, 3, n_pages).astype(dtype)
        for pos, value in case:
            pages[pos] = np.array(value).astype(dtype)
        reference = raw_counts_numpy(state, seqlen, pages)
        serial = cpu.raw_counts(state, seqlen, pages)
        parallel = cpu.raw_counts(state, seqlen, pages, req_parallel_min=0, page_parallel_min=0)
        assert reference[7] == len({pos for pos, _ in case})
        assert list(serial) == list(reference), case
        assert list(parallel) == list(reference), case
