"""What SGLang's load-snapshot factories return under the plugin: a writer and a reader on a board.

``BoardLoadWriter`` has the interface SGLang's schedulers use on ``ShmLoadSnapshotWriter`` and
``BoardLoadReader`` the one its DP controller, tokenizer manager and multi-tokenizer router use on
``ShmLoadSnapshotReader`` / ``ZmqShmLoadSnapshotReader``. SGLang's ``LoadSnapshot`` goes into a slot
as the dispatch fields plus the detail (everything else it carries), and comes back equal.

Only LIVE slots are handed to SGLang: a STALE, TORN or EMPTY slot reads as SGLang reads a rank that
never published (``read`` gives None, ``read_all`` leaves it out).

Multi-node (SGLang's zmq mode): a scheduler on another node publishes into its node's board and its
writer pushes the changed slot to node0 through a ``Relay``; on node0 the reader that SGLang's
``zmq_reader_owner`` names owns the ``Collector``, the single PULL socket, which writes the relayed
snapshots into node0's board.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import numpy as np
import zmq

from dpboard.board import DEFAULT_STALE_AFTER, Board, BoardReader, clean_boards, read_listing, segment_path
from dpboard.errors import AlreadyExistsError, InvalidInputError, NotFoundError, UnavailableError
from dpboard.integrations.sglang import convert
from dpboard.integrations.sglang.convert import sglang_module
from dpboard.integrations.sglang.settings import read_settings
from dpboard.multinode.collector import Collector
from dpboard.multinode.relay import Relay
from dpboard.snapshot import DETAILED_DTYPE, SlotStatus

_LIVE = int(SlotStatus.LIVE)


# -- the board of an SGLang instance ---------------------------------------------------------------


def board_name_for(key: str) -> str:
    """The board of the SGLang instance identified by ``key`` (its ``instance_id``, or in zmq mode
    the collector address every node shares): ``sglang-<key>`` when the key is a short plain name,
    as SGLang's instance ids are, else a shortened safe form plus a digest of the whole key."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key) or "default"
    name = f"sglang-{safe}"
    if safe != key or len(name) > 64:
        digest = hashlib.blake2s(key.encode(), digest_size=4).hexdigest()
        name = f"sglang-{safe[:44]}-{digest}"
    return name


def open_instance_board(name: str, n_slots: int, node_id: int, *, replace_dead: bool = False) -> Board:
    """The instance's board: attached when it exists, else created (this process then owns it and
    removes it when it exits). ``replace_dead``: a board of that name whose creator is gone (a
    previous run under a fixed name) is removed and made anew; one whose creator lives is an error."""
    if replace_dead:
        # This board's entry alone: other entries in /dev/shm (anybody's) never stop a start.
        try:
            entry = read_listing(name)
        except NotFoundError:
            entry = None
        if entry is not None and entry.header is not None and entry.header.creator_pid != os.getpid():
            if entry.creator_alive:
                raise AlreadyExistsError(
                    f"board {name!r} is in use by live process {entry.header.creator_pid}, not this SGLang "
                    f"instance: set DPBOARD_BOARD to another name, or stop that process")
            why = entry.in_use()
            if why is not None:  # its creator is gone, a process of that run still writes (a scheduler exiting)
                raise AlreadyExistsError(
                    f"board {name!r} of an earlier server under this name is still in use ({why}): wait for "
                    f"that server's processes to exit, or set DPBOARD_BOARD to another name")
            clean_boards(name)
    try:
        return Board.attach(name, n_slots=n_slots)
    except FileNotFoundError:
        return Board.create(name, n_slots, exist_ok=True, node_id=node_id)


_boards: dict[str, Board] = {}  # this process's boards by name (the owner's keeps its segment's life)
_boards_lock = threading.Lock()


def instance_board_name(port_args: Any) -> str:
    """The board of the SGLang instance ``port_args`` belongs to: DPBOARD_BOARD when set, else named
    after ``instance_id`` as SGLang names its snapshot file; in zmq mode after the collector
    address, which every node of the instance shares (each node has its own ``instance_id``)."""
    fixed = read_settings().board
    if fixed is not None:
        return fixed
    module = sglang_module()
    key = module._zmq_addr_for(port_args) if module.should_use_zmq() else port_args.instance_id
    return board_name_for(key)


def instance_board(port_args: Any, n_slots: int, *, replace_dead: bool = False) -> Board:
    name = instance_board_name(port_args)
    with _boards_lock:
        board = _boards.get(name)
        if board is None or not board.is_current():
            node_id = sglang_module().get_parallel().node_rank
            board = open_instance_board(name, n_slots, node_id, replace_dead=replace_dead)
            _boards[name] = board
        return board


# -- the writer (one per DP rank, in the rank's rank-zero scheduler) ---------------------------------


class BoardLoadWriter:
    """``ShmLoadSnapshotWriter``'s interface on a board slot.

    ``write(snapshot)`` publishes SGLang's ``LoadSnapshot`` (fields and detail in one seqlocked
    write) with ``num_received_reqs``, the requests this scheduler took in (counted by the plugin's
    hook on ``Scheduler.handle_generate_request``). ``publish_counter`` and ``publish_interval`` are
    SGLang's decode throttle, kept here because SGLang keeps them on its writer.

    An idle scheduler calls ``write`` on every turn of its loop (thousands a second) with the same
    load each time: a snapshot equal to the last one published, its timestamp aside, is published
    only when a heartbeat is due (a quarter of the stale threshold, so a live rank never reads
    stale). ``published`` and ``unchanged`` count both kinds of call.
    """

    def __init__(self, board: Board, dp_size: int, dp_rank: int, publish_interval: int = 1,
                 *, relay_to: str | None = None):
        if dp_rank < 0 or dp_rank >= dp_size:
            raise ValueError(f"invalid dp_rank={dp_rank} for dp_size={dp_size}")
        if board.n_slots != dp_size:
            raise InvalidInputError(
                f"board {board.name!r} has {board.n_slots} slots but SGLang runs {dp_size} DP ranks: it belongs to "
                f"another instance; give this one its own DPBOARD_BOARD (or leave it unset)")
        self.publish_interval = max(1, publish_interval)
        self.publish_counter = 0
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.board_name = board.name
        self.path = str(segment_path(board.name))
        self.num_received_reqs = 0
        self._writer = board.writer(dp_rank)
        self._detail = bytearray(convert.DETAIL_STRUCT.size)
        # the last snapshot published, its timestamp zeroed, and the count published with it
        self._last_bare: Any = None
        self._last_received = -1
        self._heartbeat_ns = int(0.25 * min(read_settings().stale_after, DEFAULT_STALE_AFTER) * 1e9)
        self._next_heartbeat_ns = 0
        self.published = 0
        self.unchanged = 0
        self.lockstep = lockstep_section(dp_size)  # what inflight_lockstep reads of this rank
        self._relay: Relay | None = None
        if relay_to is not None:
            self._relay = Relay(board, relay_to, board.node_id, ranks=[dp_rank])
        # As SGLang's writer: the slot holds an all-zero snapshot from here until the first publish.
        self.write(convert.sglang_module().LoadSnapshot(dp_rank=dp_rank))

    def write(self, snapshot: Any) -> None:
        if snapshot.dp_rank != self.dp_rank:
            raise ValueError(
                f"snapshot dp_rank={snapshot.dp_rank} does not match writer dp_rank={self.dp_rank}")
        now = time.monotonic_ns()
        # Compared before it is packed: SGLang's snapshot is a msgspec Struct, compared in C (about
        # 0.6 us), where packing it costs about 10 us, on every turn of an idle scheduler's loop.
        bare = convert.without_timestamp(snapshot)
        if (now < self._next_heartbeat_ns and bare is not None and bare == self._last_bare
                and self.num_received_reqs == self._last_received):
            self.unchanged += 1
            return
        convert.pack(snapshot, self._detail, self.lockstep)
        self._writer.publish(convert.dispatch_fields(snapshot, self.num_received_reqs), self._detail)
        self.published += 1
        self._last_bare = bare
        self._last_received = self.num_received_reqs
        self._next_heartbeat_ns = now + self._heartbeat_ns
        if self._relay is not None:
            self._relay.tick()  # non-blocking: a full pipe drops the frame, the next write resends

    def close(self) -> None:
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def __repr__(self) -> str:
        return f"BoardLoadWriter(board={self.board_name!r}, dp_rank={self.dp_rank}, dp_size={self.dp_size})"


def lockstep_section(dp_size: int) -> tuple[int, int] | None:
    """(group size, chunk tokens) of a rank of this server under DP attention, else None: with
    ``--enable-dp-attention`` every DP rank runs each forward with the others, and each prefills at
    most its ``--chunked-prefill-size`` after SGLang's division by the DP size (the value SGLang's
    own scheduler reads, ``get_schedule().chunked_prefill_size``; 0 when it cannot be read)."""
    try:
        from sglang.srt.runtime_context import get_parallel, get_schedule

        if not get_parallel().attn_dp_enabled:
            return None
    except Exception:  # an SGLang whose context this plugin does not know: no section, nothing breaks
        return None
    try:
        chunk = int(get_schedule().chunked_prefill_size or 0)
    except Exception:
        chunk = 0
    return dp_size, max(chunk, 0)


# -- the reader -------------------------------------------------------------------------------------


class BoardLoadReader:
    """``ShmLoadSnapshotReader``'s interface (and ``ZmqShmLoadSnapshotReader``'s for the zmq owner).

    ``read(rank)`` and ``read_all()`` give SGLang ``LoadSnapshot``s of the LIVE slots. The owner of
    node0's PULL socket (``collector``) drains it in a thread of its own, so node0's board stays
    fresh for every reader; the multi-tokenizer router, which registers ``fileno()`` with its event
    loop and calls ``poll()``, drains it there instead (``drain_in_thread=False``).
    """

    def __init__(self, board: Board, dp_size: int, *, stale_after: float,
                 collector: Collector | None = None, drain_in_thread: bool = True):
        self.dp_size = dp_size
        self.board_name = board.name
        self.path = str(segment_path(board.name))
        self._reader: BoardReader = board.reader(stale_after=stale_after)
        self._records = np.zeros(board.n_slots, DETAILED_DTYPE)
        self._raw = memoryview(self._records.view(np.uint8))
        self._unpacker = convert.Unpacker()
        # The snapshot last handed out per rank and the write it came from: an unchanged slot is not
        # decoded again (SGLang's callers only read what they get).
        self._seen_seq = np.zeros(board.n_slots, np.int64)
        self._seen_ts = np.zeros(board.n_slots, np.int64)
        self._seen: list[Any] = [None] * board.n_slots
        self._collector = collector
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if collector is not None and drain_in_thread:
            self._thread = threading.Thread(target=collector.serve, args=(self._stop,),
                                            name="dpboard-collector", daemon=True)
            self._thread.start()

    def _snapshots(self, ranks: np.ndarray) -> list[Any]:
        load = self._records["load"]
        seq, ts = load["publish_seq"], load["timestamp_ns"]
        # a LIVE slot has publish_seq >= 1, so a rank never handed out counts as changed
        changed = ranks[(seq[ranks] != self._seen_seq[ranks]) | (ts[ranks] != self._seen_ts[ranks])]
        for rank in changed.tolist():
            self._seen[rank] = self._unpacker.unpack(self._records, self._raw, rank)
        self._seen_seq[changed] = seq[changed]
        self._seen_ts[changed] = ts[changed]
        return [self._seen[rank] for rank in ranks.tolist()]

    def read(self, dp_rank: int) -> Any | None:
        if dp_rank < 0 or dp_rank >= self.dp_size:
            return None
        self._reader.read_detailed_array(self._records)
        if self._records["load"]["status"][dp_rank] != _LIVE:
            return None
        return self._snapshots(np.array([dp_rank], np.intp))[0]

    def read_all(self) -> list[Any]:
        self._reader.read_detailed_array(self._records)
        live = np.flatnonzero(self._records["load"]["status"][: self.dp_size] == _LIVE)
        return self._snapshots(live)

    def fileno(self) -> int:
        """The PULL socket's edge-triggered descriptor (the zmq owner only, drained by ``poll``)."""
        if self._collector is None or self._thread is not None:
            raise UnavailableError(
                "this load reader does not own node0's PULL socket in an event loop: only the reader "
                "made for SGLang's MultiTokenizerRouter in zmq mode has a descriptor to watch")
        return self._collector.socket.getsockopt(zmq.FD)

    def poll(self) -> None:
        """Drain the PULL socket into node0's board (the event-loop owner)."""
        if self._collector is not None and self._thread is None:
            self._collector.drain()

    def close(self) -> None:
        self._stop.set()
        collector, self._collector = self._collector, None  # first: poll() drains nothing from here on
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
        if collector is not None:
            collector.close()

    def __repr__(self) -> str:
        owner = ", owns the collector" if self._collector is not None else ""
        return f"BoardLoadReader(board={self.board_name!r}, dp_size={self.dp_size}{owner})"

