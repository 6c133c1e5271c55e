"""The embedding API for schedulers: compute the rank's loads from its tables and publish them.

A scheduler makes one ``LoadPublisher`` when it starts and calls ``step()`` once per scheduler
iteration::

    board = Board.attach("cluster")
    publisher = LoadPublisher(board, rank, (req_state, req_seqlen, page_state), page_size=16)
    while serving:
        ...                                                # schedule, run the batch, update the tables
        publisher.step(num_received_reqs=received_so_far)  # compute + publish, ~tens of µs

See ``examples/embed_writer.py`` for a whole loop and docs/KERNELS.md for the backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.board import Board, BoardWriter
from dpboard.errors import InvalidInputError
from dpboard.loads.compute import CUDA_BACKENDS, check_raw, resolve_backend
from dpboard.loads.counters import KVLoads, finish_raw, raw_has_errors
from dpboard.loads.reference import raw_counts_numpy
from dpboard.loads.tables import check_tables
from dpboard.snapshot import NUM_RAW, LoadDetail, LoadSnapshot, pack_detail

Tables = tuple[Any, Any, Any]
TablesSource = Tables | Callable[[], Tables]


class LoadPublisher:
    """Computes one rank's ``KVLoads`` from its request and page tables and publishes them.

    Arguments:
      board: the ``Board`` (the publisher takes ``board.writer(rank)``) or a ``BoardWriter`` of the rank.
      rank: the DP rank (may be omitted when ``board`` is a writer).
      tables: ``(req_state, req_seqlen, page_state)`` (see ``dpboard.compute_loads``), or a callable
        returning them, called at every step (for schedulers that reallocate their tables). Host
        NumPy arrays or device arrays; they are read in place, never copied.
      page_size: tokens per KV page.
      backend: "auto" (the default: "numba" for host tables, a CUDA backend for device tables),
        "numpy", "numba", "numba-cuda" or "cupy".
      gpu_direct: with a CUDA backend, let the kernel write the snapshot into the board slot itself
        (no device-to-host synchronisation at all; ``step()`` then returns None). Needs a GPU; the
        slot must not be published by anything else meanwhile.
      node_id, takeover: passed to ``board.writer`` (ignored when ``board`` is already a writer).
      detail: a ``LoadDetail`` published with every snapshot, packed once here (a scheduler that
        steps in lockstep gives its ``lockstep`` section: the group's size and its prefill chunk).

    ``step(num_received_reqs=n)`` computes and publishes, returns the ``KVLoads`` it published.
    Bad tables (codes outside the enums, seqlens outside [0, 2**32]) raise ValueError and publish nothing.
    The first step of the numba backend loads its compiled code (compiled once per machine).
    """

    def __init__(
        self,
        board: Board | BoardWriter,
        rank: int | None = None,
        tables: TablesSource | None = None,
        *,
        page_size: int,
        backend: str = "auto",
        gpu_direct: bool = False,
        node_id: int | None = None,
        takeover: bool = False,
        detail: LoadDetail | None = None,
    ) -> None:
        if isinstance(board, Board):
            if rank is None:
                raise InvalidInputError("rank is required when a Board is given: LoadPublisher(board, rank, tables, ...)")
            self.writer = board.writer(rank, node_id=node_id, takeover=takeover)
        elif isinstance(board, BoardWriter):
            if rank is not None and rank != board.rank:
                raise InvalidInputError(f"rank {rank} does not match the writer's rank {board.rank}")
            self.writer = board
        else:
            raise InvalidInputError(f"board must be a dpboard Board or BoardWriter, got {type(board).__name__}")
        if tables is None:
            raise InvalidInputError("tables is required: (req_state, req_seqlen, page_state) or a callable returning them")
        self.rank = int(self.writer.rank)
        self.page_size = page_size
        self._source = tables if callable(tables) else None
        self._tables: Tables | None = None
        self._num_pages = 0
        self._raw = np.zeros(NUM_RAW, dtype=np.int64)
        self._kernel: Any = None
        self._parallel_min = (0, 0)
        self._direct: Any = None
        self._requested_backend = backend
        self.backend = ""
        self.steps = 0
        self._detail = None if detail is None else pack_detail(detail)
        self._want_direct = bool(gpu_direct)
        if gpu_direct and detail is not None:
            raise InvalidInputError("a GPU-direct kernel publishes no detail: give detail=None with gpu_direct=True")
        self._bind(tables() if callable(tables) else tables)
        if gpu_direct:
            if self.backend not in CUDA_BACKENDS:
                raise InvalidInputError(
                    f"gpu_direct=True needs a CUDA backend and device tables, but the backend is {self.backend!r}: "
                    f"pass device arrays (CuPy, PyTorch, Numba) and backend='auto', 'cupy' or 'numba-cuda'"
                )
            from dpboard.publish.gpu_direct import direct_publisher

            # The writer's node id, so that the kernel stamps what a host publish would stamp.
            self._direct = direct_publisher(self.writer, int(page_size), self.backend, self.writer.node_id)
            self._direct.bind(*self._tables)  # type: ignore[misc]

    # -- tables --------------------------------------------------------------------------------

    def _bind(self, tables: Tables) -> None:
        """Check a (new) set of tables once; steps then reuse the result."""
        if not isinstance(tables, tuple) or len(tables) != 3:
            raise InvalidInputError("tables must be (req_state, req_seqlen, page_state), or a callable returning that")
        _, self._num_pages, on_device = check_tables(*tables, self.page_size)
        backend = resolve_backend(self._requested_backend, on_device)
        if self.backend and backend != self.backend:
            raise InvalidInputError(f"the tables moved from backend {self.backend!r} to {backend!r}: keep them where they were")
        self.backend = backend
        self._tables = tables
        if backend == "numba":
            from dpboard.loads import cpu

            self._kernel = cpu.kernel_for(tables[2])
            # Looked up once here, not per step: step() is the scheduler's hot path.
            self._parallel_min = (cpu.REQ_PARALLEL_MIN, cpu.PAGE_PARALLEL_MIN)
        elif backend in CUDA_BACKENDS:
            from dpboard.loads import cuda

            if self._direct is not None or self._want_direct:
                self._kernel = None  # compute() binds its own launch if it is ever called
                if self._direct is not None:
                    self._direct.bind(*tables)
            else:
                # Pointers, grid, packed arguments, pinned buffer and stream, resolved once here.
                self._kernel = cuda.runner(backend).prepare(*tables)

    def _current_tables(self) -> Tables:
        if self._source is not None:
            tables = self._source()
            current = self._tables
            if (current is None or not isinstance(tables, tuple) or len(tables) != 3 or tables[0] is not current[0]
                    or tables[1] is not current[1] or tables[2] is not current[2]):
                self._bind(tables)
        return self._tables  # type: ignore[return-value]

    # -- the hot path --------------------------------------------------------------------------

    def compute(self) -> KVLoads:
        """The loads of the current tables, without publishing (ValueError on bad tables)."""
        state, seqlen, pages = self._current_tables()
        backend = self.backend
        if backend == "numba":
            self._kernel(state, seqlen, pages, self._raw, *self._parallel_min)
            raw = self._raw
        elif backend == "numpy":
            raw = raw_counts_numpy(state, seqlen, pages)
        else:
            if self._kernel is None:  # compute() beside GPU-direct: a raw-counts binding of its own
                from dpboard.loads import cuda

                self._kernel = cuda.runner(backend).prepare(state, seqlen, pages)
            raw = self._kernel.raw_counts().tolist()  # nine Python ints: the cheapest to read nine times
        if raw_has_errors(raw):
            check_raw(raw, state, seqlen, pages, on_device=backend in CUDA_BACKENDS)
        return finish_raw(raw, self._num_pages, self.page_size)

    def step(self, num_received_reqs: int = 0) -> KVLoads | None:
        """Compute the loads and publish them into the rank's slot; returns what was published.

        ``num_received_reqs``: how many requests this rank has received from the controller so far
        (cumulative; the controller's exact in-flight accounting uses it). With ``gpu_direct`` the
        kernel publishes on its own and this returns None at once; an earlier launch that found bad
        tables raises here (see ``poll()``).
        """
        self.steps += 1
        direct = self._direct
        if direct is not None:
            if self._source is not None:
                self._current_tables()  # rebinds the launch when the tables moved
            direct.check()
            direct.launch(num_received_reqs)
            return None
        loads = self.compute()
        if self._detail is not None:
            self.writer.publish(
                LoadSnapshot(self.rank, loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens,
                             loads.num_total_tokens, loads.num_active_tokens, loads.max_total_num_tokens,
                             num_received_reqs),
                self._detail,
            )
            return loads
        self.writer.publish_values(
            loads.num_running_reqs,
            loads.num_waiting_reqs,
            loads.num_used_tokens,
            loads.num_total_tokens,
            loads.num_active_tokens,
            loads.max_total_num_tokens,
            num_received_reqs,
        )
        return loads

    # -- GPU-direct ------------------------------------------------------------------------------

    @property
    def gpu_direct(self) -> bool:
        return self._direct is not None

    def poll(self) -> dict[str, int] | None:
        """GPU-direct only: what the last finished launch did (never waits)."""
        return None if self._direct is None else self._direct.poll()

    def synchronize(self) -> None:
        """GPU-direct only: wait for the launches in flight; ValueError if the last one found bad tables."""
        if self._direct is not None:
            self._direct.synchronize()

    def close(self) -> None:
        """Release the GPU-direct registration (waits for launches in flight). Idempotent."""
        if self._direct is not None:
            direct, self._direct = self._direct, None
            direct.close()

    def __enter__(self) -> LoadPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = ", gpu_direct" if self._direct is not None else ""
        return f"LoadPublisher(rank={self.rank}, backend={self.backend!r}{mode}, steps={self.steps})"
