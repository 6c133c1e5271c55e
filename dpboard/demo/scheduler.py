"""One synthetic scheduler of ``dpboard demo``: a DP rank with a request table and a KV page table.

``SchedulerModel`` keeps the tables a real scheduler keeps (docs/KERNELS.md): ``req_state`` and
``req_seqlen`` (one row per request) and ``page_state`` (one entry per KV page). Each step it admits
waiting requests in arrival order while pages last (prefill: the prompt's pages at once), decodes
one token per running request (a new page whenever a page fills; out of pages, the request is
retracted: its pages are freed and it waits again), and finishes requests that reached their
output length: their pages are freed, and with some probability the prompt's pages
stay behind as an EVICTABLE cached prefix that later allocations reclaim.

With ``dp_attention`` (``--dp-attention``) a rank runs as SGLang runs one under DP attention: a
step either prefills (admits up to ``chunk`` prompt tokens, and a batch of ``T`` tokens takes
``ceil(T / chunk)`` steps) or decodes, never both, so a prefill stalls the rank's running requests;
and the ranks of the group step together: each waits, before a step, until every rank of the group
has published the step before (their ``publish_seq`` on the board), as DP attention's gather makes
every rank wait for the others. It publishes the lockstep section (the group's size, its chunk).

Run as ``python -m dpboard.demo.scheduler ...``: it receives requests from its controller on a
ZMQ PULL socket, publishes its load into the board through the embedding API every step, and
sends one completion record per finished request to the demo (queueing delay included). A frame
it cannot use (not msgpack, not a request map, a field of the wrong type, a request larger than
its KV) is counted as received, so that its count still acknowledges deliveries in order, logged
and dropped: one bad frame never stops a rank (the controller would send it to the next one).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import deque
from typing import Any

import msgpack
import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.snapshot import PageState, ReqState

RUNNING = int(ReqState.RUNNING)
WAITING = int(ReqState.WAITING)
RETRACTED = int(ReqState.RETRACTED)
FREE_ROW = int(ReqState.FREE)
PAGE_FREE = int(PageState.FREE)
PAGE_USED = int(PageState.USED)
PAGE_EVICTABLE = int(PageState.EVICTABLE)


class SchedulerModel:
    """The request and KV page tables of one rank, and the prefill/decode/finish rules that move them."""

    def __init__(self, *, num_pages: int = 4096, page_size: int = 16, max_reqs: int = 2048,
                 max_running: int = 48, prefill_budget: int = 16384, prefix_share: float = 0.5,
                 seed: int = 0, dp_attention: bool = False, chunk: int = 512) -> None:
        if num_pages < 1 or page_size < 1 or max_reqs < 1 or max_running < 1 or chunk < 1:
            raise InvalidInputError("num_pages, page_size, max_reqs, max_running and chunk must all be >= 1")
        self.page_size = page_size
        self.max_running = max_running
        self.dp_attention = dp_attention
        self.chunk = chunk
        self.prefill_budget = chunk if dp_attention else prefill_budget
        self.prefill_steps_left = 0  # dp_attention: steps still to prefill the batch admitted last
        self.prefix_share = prefix_share
        self.rng = np.random.default_rng(seed)
        self.req_state = np.zeros(max_reqs, dtype=np.int8)
        self.req_seqlen = np.zeros(max_reqs, dtype=np.int32)
        self.page_state = np.zeros(num_pages, dtype=np.int8)
        self.target_len = np.zeros(max_reqs, dtype=np.int64)
        self.prompt_len = np.zeros(max_reqs, dtype=np.int64)
        self.arrival = np.zeros(max_reqs, dtype=np.float64)  # monotonic, at this scheduler
        self.scheduled = np.zeros(max_reqs, dtype=np.float64)
        self.rid: list[Any] = [None] * max_reqs
        self.sent_ns = [0] * max_reqs
        self.pages_of: list[list[int]] = [[] for _ in range(max_reqs)]
        self.free_rows = list(range(max_reqs - 1, -1, -1))
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.evictable: deque[int] = deque()
        self.waiting: deque[int] = deque()
        self.overflow: deque[tuple[dict[str, Any], float]] = deque()  # received while every row was taken
        self.num_received = 0
        self.num_dropped = 0  # received, and dropped: frames this rank cannot use
        self.num_running = 0
        self.num_retracted = 0
        self.capacity_tokens = num_pages * page_size

    # -- requests in -----------------------------------------------------------------------------

    def receive_frame(self, raw: bytes, now: float) -> str | None:
        """A frame from the controller. One this rank cannot use is counted as received and dropped:
        returns why (None when it was taken)."""
        try:
            req = msgpack.unpackb(raw)  # the options every scheduler uses: the controller checks frames by them
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
            why = f"not msgpack: {type(e).__name__}: {e}"
        else:
            try:
                self.receive(req, now)
                return None
            except InvalidInputError as e:
                why = str(e)
        self.num_received += 1
        self.num_dropped += 1
        return why

    def check(self, req: Any) -> None:
        """InvalidInputError unless ``req`` is a request this model can hold (checked before anything moves)."""
        if not isinstance(req, dict):
            raise InvalidInputError(f"a request is a map, got {type(req).__name__}")
        for key in ("num_tokens", "output_len", "sent_ns"):
            v = req.get(key)
            if v is not None and (type(v) is not int or v < 0):
                raise InvalidInputError(f"request {req.get('rid')!r}: {key} must be an int >= 0, got {v!r}")
        ids = req.get("input_ids")
        if ids is not None and not isinstance(ids, list):
            raise InvalidInputError(f"request {req.get('rid')!r}: input_ids must be a list, got {type(ids).__name__}")
        prompt = req.get("num_tokens") or len(ids or ())
        if prompt > self.capacity_tokens:  # it could never be admitted, and every request behind it would wait
            raise InvalidInputError(f"request {req.get('rid')!r}: a prompt of {prompt} tokens does not fit this "
                                    f"rank's KV of {self.capacity_tokens} tokens")

    def receive(self, req: dict[str, Any], now: float) -> None:
        """A request from the controller: it waits, holding no KV yet. InvalidInputError (and nothing
        counted) for one the model cannot hold."""
        self.check(req)
        self.num_received += 1
        if not self.free_rows:
            self.overflow.append((req, now))
            return
        self._enqueue(req, now)

    def _enqueue(self, req: dict[str, Any], now: float) -> None:
        row = self.free_rows.pop()
        prompt = int(req.get("num_tokens") or len(req.get("input_ids") or ()) or 1)
        self.req_state[row] = WAITING
        self.req_seqlen[row] = prompt
        self.prompt_len[row] = prompt
        output = req.get("output_len")
        self.target_len[row] = prompt + max(1, 64 if output is None else int(output))
        self.arrival[row] = now
        self.rid[row] = req.get("rid")
        self.sent_ns[row] = int(req.get("sent_ns") or 0)
        self.waiting.append(row)

    # -- pages ------------------------------------------------------------------------------------

    @property
    def pages_available(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    def _take_page(self) -> int:
        page = self.free_pages.pop() if self.free_pages else self.evictable.popleft()
        self.page_state[page] = PAGE_USED
        return page

    def _release(self, row: int) -> None:
        pages = self.pages_of[row]
        keep_prefix = self.rng.random() < self.prefix_share
        prompt_pages = int(self.prompt_len[row]) // self.page_size  # only whole pages can be shared
        for i, page in enumerate(pages):
            if keep_prefix and i < prompt_pages:
                self.page_state[page] = PAGE_EVICTABLE
                self.evictable.append(page)
            else:
                self.page_state[page] = PAGE_FREE
                self.free_pages.append(page)
        pages.clear()

    # -- one step -----------------------------------------------------------------------------------

    def step(self, now: float) -> list[dict[str, Any]]:
        """Admit, decode, finish. Returns the completion records of the requests that finished.

        Under DP attention a step that prefills does not decode (SGLang runs a prefill batch alone)."""
        while self.overflow and self.free_rows:
            req, arrived = self.overflow.popleft()
            self._enqueue(req, arrived)
        if not self.dp_attention:
            self._admit(now)
            return self._decode_and_finish(now)
        if self.prefill_steps_left > 0:
            self.prefill_steps_left -= 1
            return []
        tokens = self._admit(now)
        if tokens:
            self.prefill_steps_left = -(-tokens // self.chunk) - 1
            return []
        return self._decode_and_finish(now)

    def _admit(self, now: float) -> int:
        """Admit waiting requests while pages and the budget last; returns the prompt tokens admitted."""
        budget = self.prefill_budget
        admitted = 0
        while self.waiting and self.num_running < self.max_running:
            row = self.waiting[0]
            prompt = int(self.req_seqlen[row])
            need = -(-prompt // self.page_size)
            # Keep a page of headroom per running request, so that admitting does not force retracting.
            if need + self.num_running > self.pages_available or (prompt > budget and budget < self.prefill_budget):
                break  # no room yet (a too-long prompt still gets a whole step of its own)
            self.waiting.popleft()
            self.pages_of[row] = [self._take_page() for _ in range(need)]
            if self.req_state[row] == WAITING:  # a retracted request keeps its first scheduling time
                self.scheduled[row] = now
            self.req_state[row] = RUNNING
            self.num_running += 1
            budget -= prompt
            admitted += prompt
        return admitted

    def _decode_and_finish(self, now: float) -> list[dict[str, Any]]:
        rows = np.flatnonzero(self.req_state == RUNNING)
        if rows.size == 0:
            return []
        self.req_seqlen[rows] += 1
        need_page = rows[self.req_seqlen[rows] > self._capacity_of(rows)]
        for row in need_page.tolist():
            if self.pages_available:
                self.pages_of[row].append(self._take_page())
            else:
                self._retract(row)
        rows = rows[self.req_state[rows] == RUNNING]
        done = rows[self.req_seqlen[rows] >= self.target_len[rows]]
        records = []
        wall_ns = time.time_ns()
        for row in done.tolist():
            self._release(row)
            records.append({
                "rid": self.rid[row],
                "prompt": int(self.prompt_len[row]),
                "output": int(self.target_len[row] - self.prompt_len[row]),
                "queue_s": float(self.scheduled[row] - self.arrival[row]),
                "latency_s": (wall_ns - self.sent_ns[row]) / 1e9 if self.sent_ns[row] else None,
            })
            self.req_state[row] = FREE_ROW
            self.req_seqlen[row] = 0
            self.rid[row] = None
            self.free_rows.append(row)
            self.num_running -= 1
        return records

    def _retract(self, row: int) -> None:
        """Out of KV pages: this request gives its pages back and waits to be scheduled again (as a
        real scheduler retracts), so that the others can go on decoding."""
        for page in self.pages_of[row]:
            self.page_state[page] = PAGE_FREE
            self.free_pages.append(page)
        self.pages_of[row].clear()
        self.req_state[row] = RETRACTED
        self.num_running -= 1
        self.num_retracted += 1
        self.waiting.appendleft(row)

    def _capacity_of(self, rows: np.ndarray) -> np.ndarray:
        held = np.fromiter((len(self.pages_of[r]) for r in rows.tolist()), dtype=np.int64, count=rows.size)
        return held * self.page_size


# -- publishing ----------------------------------------------------------------------------------


class SchedulerPublisher:
    """Publishes the model's tables through the embedding API (``dpboard.publish.publisher.LoadPublisher``,
    Numba CPU kernel), with the count of requests received so far."""

    def __init__(self, board: Any, rank: int, model: SchedulerModel, group: int = 1) -> None:
        from dpboard.publish.publisher import LoadPublisher
        from dpboard.snapshot import LoadDetail, LockstepDetail

        self.model = model
        detail = LoadDetail(lockstep=LockstepDetail(group_size=group, chunk_tokens=model.chunk)) if model.dp_attention else None
        self.pub = LoadPublisher(board, rank, (model.req_state, model.req_seqlen, model.page_state),
                                 page_size=model.page_size, backend="numba", detail=detail)

    def publish(self) -> None:
        self.pub.step(num_received_reqs=self.model.num_received)


# -- the process --------------------------------------------------------------------------------


def _parent_gone(parent: int) -> bool:
    return os.getppid() != parent


class GroupBarrier:
    """DP attention's wait for the group: a rank steps once every rank of ``0..group-1`` has
    published as many times as it has (the board's ``publish_seq``), at most ``timeout`` seconds (a
    rank that is gone does not stop the others for good)."""

    POLL_S = 0.0002

    def __init__(self, board: Any, rank: int, group: int, timeout: float = 5.0) -> None:
        from dpboard.snapshot import SNAPSHOT_DTYPE

        if not 0 <= rank < group <= board.n_slots:
            raise InvalidInputError(f"rank {rank} is not in a group of {group} ranks of a {board.n_slots}-slot board")
        self.reader = board.reader()
        self.records = np.zeros(board.n_slots, SNAPSHOT_DTYPE)
        self.rank, self.group, self.timeout = rank, group, timeout
        self.late = 0  # waits that ran out

    def wait(self, keep_waiting: Any) -> bool:
        """True once the group has caught up; False when ``keep_waiting()`` turns false or time runs out."""
        deadline = time.monotonic() + self.timeout
        while True:
            seqs = self.reader.read_array(self.records)["publish_seq"][: self.group]
            if seqs.min() >= seqs[self.rank]:
                return True
            if not keep_waiting() or time.monotonic() > deadline:
                self.late += 1
                return False
            time.sleep(self.POLL_S)


def _say_dropped(n: int) -> bool:
    """Log the first ten dropped frames, then one in a thousand: a flood of them cannot flood stderr."""
    return n <= 10 or n % 1000 == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpboard.demo.scheduler")
    p.add_argument("--board", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--requests", required=True, help="ZMQ endpoint this scheduler binds its PULL to")
    p.add_argument("--results", required=True, help="ZMQ endpoint of the demo's completion PULL")
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=48)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp-attention", action="store_true",
                   help="step in lockstep with ranks 0..group-1, a prefill step decoding nothing")
    p.add_argument("--group", type=int, default=0, help="--dp-attention: ranks that step together (default: the board's)")
    p.add_argument("--chunk", type=int, default=0, help="--dp-attention: prompt tokens per prefill step (default 8192 / group)")
    args = p.parse_args(argv)

    import zmq

    from dpboard.board import Board

    parent = os.getppid()
    stopping = False

    def on_term(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo decides when to stop, not the terminal

    board = Board.attach(args.board)
    group = args.group or board.n_slots
    chunk = args.chunk or max(1, 8192 // group)  # SGLang's rule: --chunked-prefill-size 8192 over the DP size
    model = SchedulerModel(num_pages=args.num_pages, page_size=args.page_size, max_running=args.max_running,
                           seed=args.seed * 1000 + args.rank, dp_attention=args.dp_attention, chunk=chunk)
    publisher = SchedulerPublisher(board, args.rank, model, group=group)
    barrier = GroupBarrier(board, args.rank, group) if args.dp_attention else None
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(args.requests)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.setsockopt(zmq.SNDHWM, 100_000)
    push.connect(args.results)
    publisher.publish()  # the first snapshot tells the demo this rank is up
    step_s = args.step_ms / 1e3
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    def drain() -> None:
        now = time.monotonic()
        while True:
            try:
                raw = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            why = model.receive_frame(raw, now)
            if why is not None and _say_dropped(model.num_dropped):
                print(f"scheduler rank {args.rank}: dropped a request frame it cannot use ({model.num_dropped} "
                      f"so far): {why}", file=sys.stderr, flush=True)

    def serving() -> bool:
        return not stopping and not _parent_gone(parent)

    try:
        next_step = time.monotonic()
        while serving():
            timeout_ms = max(0.0, (next_step - time.monotonic()) * 1e3)
            if poller.poll(timeout_ms):
                drain()
            now = time.monotonic()
            if now < next_step:
                continue
            if barrier is not None:
                barrier.wait(serving)  # the group's previous step is done everywhere
                drain()
                now = time.monotonic()
            records = model.step(now)
            publisher.publish()
            if records:
                try:
                    push.send(msgpack.packb({"rank": args.rank, "done": records}), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the demo is gone or slow: a summary without these is better than a stall
            next_step = max(next_step + step_s, now)
    finally:
        pull.close(0)
        push.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
