"""The model of one DP rank in ``dpboard sim``: a scheduler loop over a KV cache with a prefix cache.

Each rank runs steps back to back, like SGLang's scheduler loop, and picks up newly received
requests only between steps:

- Prefill has priority. A prefill step continues the request whose prompt is being chunked, then
  admits waiting requests in arrival order (no skipping ahead) while the running batch stays under
  ``max_running`` and the KV pool has room for the prompt. With chunked prefill on
  (``chunked_prefill_size > 0``, SGLang's default) a step computes at most that many prompt tokens:
  the last request admitted may get only part of its prompt and finishes it in the next steps, ahead
  of everything else. With it off, a step takes whole prompts up to ``max_prefill_tokens`` (one
  request always, however long). A step costs ``prefill_base_s + prefill_s_per_token * tokens
  + prefill_s_per_attention_pair * pairs``, counting only the tokens computed: those the prefix
  cache held are not. ``pairs`` is attention's work: each prompt token computed attends to its
  context, so a request computing ``n`` tokens after ``p`` already in KV (cached, or its earlier
  chunks) adds ``n * p + n * n / 2`` pairs; long prompts and cached prefixes cost more per token. The step that computes a
  request's last prompt token gives its first token: time to first token ends there.
- Otherwise a decode step gives every running request one token. It takes
  ``decode_base_s + decode_s_per_request * batch + decode_s_per_kv_token * kv_tokens``, where
  kv_tokens is the KV the batch holds, so decode slows down as sequences grow; the decode step
  right after a prefill step takes ``decode_after_prefill_s`` more (the prefilled requests join
  the running batch: a fitted term, 0 unless a step log says otherwise).
- The KV pool (``kv_capacity`` tokens) holds the running requests' private KV and the prefix
  cache's blocks. A request whose prompt has block ids (``SimRequest.block_ids``, one per 512 tokens)
  reuses the leading blocks the cache holds, pins them while it runs, and adds its prompt's blocks to
  the cache when its prefill ends; they stay there, evictable, after it finishes. When the pool runs
  short, unpinned blocks are evicted first (least recently used leaves); a decode step that would
  still overflow retracts the most recently admitted requests back to the head of the waiting queue
  (their private KV is freed; they are prefilled again later with what they had generated), as
  SGLang does. A request without block ids shares nothing.

- With SGLang's overlap scheduler (``overlap``) the next batch is formed before the results of the
  step under way are processed (``event_loop_overlap``, ``sglang/srt/managers/scheduler.py``
  2084-2086 before 2117-2120 of 0.5.23). So a request that finishes in step k still holds its slot
  and its KV when step k+1 is formed: it is freed only when step k's result is processed
  (``release_kv_cache``, ``scheduler_components/batch_result_processor.py`` 1466), and what step
  k+1 admits sees it in the running batch (``running_batch.filter_batch()`` at scheduler.py 3966
  drops only requests already marked finished). Its slot and KV are usable from step k+2. It does
  not decode again in step k+1 (``_reqs_finishing_inflight``, scheduler.py 4444-4456).
- Where the forward runs in the scheduler's own thread (``sync_forward``: a CPU, where
  ``run_batch`` returns only once the forward is done), that same loop processes step k's result
  only after step k+1's whole forward (scheduler.py 2109 before 2120). So under the overlap
  scheduler the tokens of step k, a first token included, reach the client once step k+1's forward
  and their processing are done (``result_share`` of step k+1's time from its start: the rest of
  the step is the loop's turn that receives and forms step k+2), or at once when nothing runs next
  (the loop then processes the last result straight away).
  On a GPU ``run_batch`` returns at the launch and the result waits only for its own forward.
  The same order undoes the overlap scheduler's admission fence there: the loop receives
  (``ingest_requests``) right before it forms the next batch, after ``run_batch`` of the step
  under way has returned, so a request received during step k joins step k+1, as without overlap.

A running request's finish is kept as the decode-step count at which it ends, so a decode step
costs O(1) plus O(log n) per request that finishes, not O(batch).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dpboard.errors import InvalidInputError
from dpboard.sim.prefix_cache import BLOCK_TOKENS, PrefixCache, prefix_tokens
from dpboard.snapshot import LoadSnapshot

# How a rank reports its queued prefill (``RankModel.queued_prefill_tokens``).
SGLANG_REPORT = "sglang"
EXACT_REPORT = "exact"
QUEUED_PREFILL_REPORTS = (SGLANG_REPORT, EXACT_REPORT)
HIT_RATE_WINDOW_S = 15.0  # SGLang's SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS default

# What a rank serves: both phases, or one side of PD disaggregation.
BOTH = "both"
PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"
ROLES = (BOTH, PREFILL_ROLE, DECODE_ROLE)
RESERVED_DECODE_TOKENS = 512  # SGLang's --num-reserved-decode-tokens default: a PD decode rank's room per request

# What a rank is doing.
IDLE = 0
PREFILL = 1
DECODE = 2


@dataclass(frozen=True)
class RankConfig:
    """One rank's capacity and speed. The defaults are the ``synthetic`` profile."""

    kv_capacity: int = 160_000  # tokens of KV cache (prefix cache included)
    max_running: int = 128  # requests in the running batch
    max_prefill_tokens: int = 16384  # with chunking off: prompt tokens per prefill step (at least one request)
    chunked_prefill_size: int = 0  # prompt tokens per prefill step, a prompt split across steps; 0 = off
    prefill_base_s: float = 0.004
    prefill_s_per_token: float = 40e-6  # 25k prompt tokens per second
    prefill_s_per_attention_pair: float = 0.0  # per (prompt token computed, context token it attends to)
    decode_after_prefill_s: float = 0.0  # what the decode step right after a prefill step takes more
    decode_base_s: float = 0.010
    decode_s_per_request: float = 0.0
    decode_s_per_kv_token: float = 60e-9  # +6 ms per step per 100k tokens in the batch
    # SGLang's new_token_ratio, held constant: admission keeps this share of every running request's
    # remaining output (and of the new request's) free in the KV pool. 0: no room kept (the model
    # retracts when a decode step would overflow instead)
    new_token_ratio: float = 0.0
    # the forward runs in the scheduler's thread (a CPU): with the overlap scheduler a step's results
    # come out at the end of the next step's forward
    sync_forward: bool = False
    # with sync_forward, where in the next step's time a step's results come out, as a share of that
    # step from its start: after its forward and the result's processing, before the loop's turn that
    # receives and forms the step after (1: at the next step's end)
    result_share: float = 1.0

    def validate(self) -> RankConfig:
        if self.kv_capacity < 1 or self.max_running < 1 or self.max_prefill_tokens < 1:
            raise InvalidInputError("rank kv_capacity, max_running and max_prefill_tokens must be >= 1")
        if self.chunked_prefill_size < 0:
            raise InvalidInputError(
                f"chunked_prefill_size must be >= 0 tokens (0 turns chunking off), got {self.chunked_prefill_size}"
            )
        for name in (
            "prefill_base_s",
            "prefill_s_per_token",
            "prefill_s_per_attention_pair",
            "decode_after_prefill_s",
            "decode_base_s",
            "decode_s_per_request",
            "decode_s_per_kv_token",
        ):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"rank {name} must be >= 0 seconds")
        if self.sync_forward not in (0, 1):
            raise InvalidInputError(f"sync_forward is 0 or 1, got {self.sync_forward!r}")
        if not 0.0 < self.result_share <= 1.0:
            raise InvalidInputError(f"result_share is a share of a step in (0, 1], got {self.result_share!r}")
        if not 0.0 <= self.new_token_ratio <= 1.0:
            raise InvalidInputError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio}")
        if self.prefill_base_s + self.prefill_s_per_token <= 0 or self.decode_base_s + self.decode_s_per_request <= 0:
            raise InvalidInputError(
                "a prefill step and a decode step must each take some time: give prefill_base_s or "
                "prefill_s_per_token, and decode_base_s or decode_s_per_request, a value > 0"
            )
        return self

    @property
    def prefill_step_tokens(self) -> int:
        """Prompt tokens one full prefill step computes."""
        return self.chunked_prefill_size or self.max_prefill_tokens

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        return self.decode_base_s + self.decode_s_per_request * batch + self.decode_s_per_kv_token * kv_tokens


class SimRequest:
    """One request of the trace, as the dispatcher and a rank see it.

    ``routed_dp_rank``, ``bootstrap_room`` and ``num_tokens`` are what the real ``Dispatcher`` reads;
    ``block_ids`` (one per 512 prompt tokens, empty when the trace has none) is what cache-aware
    policies and the rank's prefix cache read; the rest is the simulator's record of what happened.
    """

    __slots__ = (
        "rid",
        "arrival_s",
        "prompt_len",
        "output_len",
        "is_burst",
        "block_ids",
        "routed_dp_rank",
        "bootstrap_room",
        "num_tokens",
        "rank",
        "received_s",
        "admitted_s",
        "first_token_s",
        "finished_s",
        "generated",
        "finish_step",
        "epoch",
        "retractions",
        "cached_tokens",
        "prefill_left",
        "held_blocks",
        "private_kv",
        "queued_uncached",
        "prefill_rank",
        "prefilled_s",
        "kv_ready_s",
        "admit_step",
    )

    def __init__(
        self,
        rid: int,
        arrival_s: float,
        prompt_len: int,
        output_len: int,
        is_burst: bool = False,
        block_ids: tuple[int, ...] = (),
    ):
        self.rid, self.arrival_s, self.prompt_len, self.output_len = rid, arrival_s, prompt_len, output_len
        self.is_burst, self.block_ids = is_burst, block_ids
        self.routed_dp_rank: int | None = None
        self.bootstrap_room: int | None = None
        self.num_tokens = prompt_len  # the dispatcher's token estimate: the prompt length
        self.rank = -1
        self.received_s = -1.0
        self.admitted_s = -1.0  # first admission into a prefill batch
        self.first_token_s = -1.0
        self.finished_s = -1.0
        self.generated = 0
        self.finish_step = 0
        self.epoch = 0  # bumped on retraction, to drop its stale entry in the finish heap
        self.retractions = 0
        self.cached_tokens = -1  # prompt tokens the rank's cache held at first admission
        self.prefill_left = 0  # tokens still to compute in the current prefill
        self.held_blocks = 0  # leading block_ids pinned in the rank's cache
        self.private_kv = 0  # KV tokens reserved outside the prefix cache at admission (during prefill)
        self.queued_uncached = 0  # its part of the rank's waiting_uncached while it waits
        # PD disaggregation: the prefill rank, the end of its prefill there, the arrival of its KV on
        # the decode rank (its first token reaches the client with it)
        self.prefill_rank = -1
        self.prefilled_s = -1.0
        self.kv_ready_s = -1.0
        self.admit_step = 0  # the rank's first step that may admit it (the overlap scheduler's fence)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """The trace's block ids: what a cache-aware ``Dispatcher`` keys its prefix index on."""
        return self.block_ids

    @property
    def seqlen(self) -> int:
        return self.prompt_len + self.generated

    def __repr__(self) -> str:
        return f"SimRequest(rid={self.rid}, prompt={self.prompt_len}, output={self.output_len}, rank={self.rank})"


RequestHook = Callable[[SimRequest], None]


class RankModel:
    """One DP rank: waiting queue, running batch, KV pool with a prefix cache, and the step it is in.

    ``on_first_token`` and ``on_finish``, when set, are called with each request as its first token
    comes and as it finishes (a router that tracks its requests listens to them).

    ``role`` is what the rank serves. ``both`` (the default) prefills and decodes. Under PD
    disaggregation a ``prefill`` rank holds a request in its bootstrap queue (``hold``) until the
    decode side has pre-allocated its KV (``release``), prefills it, and hands it off at the end of
    its prefill (``handed_off``; its KV is freed, the transfer is the simulation's). A ``decode`` rank
    takes a request into its pre-allocation queue (``receive_remote``), reserves its KV when it has
    room (``preallocate``, the transfer queue), and runs it from the step after its KV has arrived
    (``kv_arrived``), as SGLang's decode scheduler does (``sglang/srt/disaggregation/decode.py``)."""

    def __init__(
        self,
        rank: int,
        config: RankConfig,
        cache: PrefixCache | None = None,
        *,
        queued_prefill: str = SGLANG_REPORT,
        role: str = BOTH,
        overlap: bool = False,
    ):
        if queued_prefill not in QUEUED_PREFILL_REPORTS:
            raise InvalidInputError(
                f"queued prefill report {queued_prefill!r} is not one of {', '.join(QUEUED_PREFILL_REPORTS)}"
            )
        if role not in ROLES:
            raise InvalidInputError(f"rank role {role!r} is not one of {', '.join(ROLES)}")
        self.role = role
        # SGLang's overlap scheduler (on by default) forms the next batch while the GPU runs the
        # current one, so a request received during step j is admitted from step j + 2 at the
        # earliest (j + 1 without it); one received while nothing runs is admitted at once.
        self.overlap = overlap
        # The same loop processes step k's result after forming step k+1: requests that finished in
        # step k keep their slot and KV through that formation (the running batch SGLang forms from)
        self._late: list[SimRequest] = []
        self._held_late = False  # the step just formed had such requests in its running batch
        # On a synchronous device the results of a step (first tokens, ends) come out only after the
        # next step's forward: (request, first token?) of the step under way, stamped at the next
        # step's end (or when the rank finds nothing to run)
        self.lagged = overlap and config.sync_forward and role == BOTH
        # the overlap scheduler forms step k+1 while step k's forward runs on the device, so a request
        # received meanwhile waits a step more; with the forward in the loop's own thread it does not
        self.fence = overlap and not config.sync_forward
        self._results: list[tuple[SimRequest, bool]] = []
        self._step_start_s = 0.0  # when the step under way began (lagged results come out inside it)
        self.step_index = 0  # steps begun (an idle batch in a lockstep group counts)
        self.rank = rank
        self.config = config.validate()
        self.queued_prefill = queued_prefill
        self.cache = cache if cache is not None else PrefixCache()
        self.waiting: deque[SimRequest] = deque()
        self.waiting_tokens = 0  # sum of seqlens in the waiting queue (they hold no KV)
        # SGLang's num_waiting_uncached_tokens: the waiting prompts less what the cache holds of them
        # when they arrived in the queue (SGLang matches the waiting queue against its radix cache)
        self.waiting_uncached = 0
        self.running: dict[int, SimRequest] = {}  # rid -> request in decode, in admission order
        self._finish_sum = 0  # sum of the running requests' finish_step: their remaining outputs in O(1)
        self._finish_heap: list[tuple[int, int, int]] = []  # (finish_step, rid, epoch)
        self.private_tokens = 0  # KV held outside the prefix cache (running and prefilling requests)
        self.decode_steps = 0
        self.decoded_tokens = 0  # tokens its decode steps gave (first tokens, from prefill, not counted)
        self.state = IDLE
        self._prefill_batch: list[tuple[SimRequest, int]] = []  # (request, tokens computed this step)
        self._chunked: SimRequest | None = None  # the request whose prompt is split across steps
        self.received = 0  # cumulative requests received from the controller
        self.finished: list[SimRequest] = []
        self.retracted = 0
        self.busy_s = 0.0  # time spent in steps (for utilisation)
        # The batch of the step under way, as SGLang's DP-attention gather counts it: prompt tokens
        # computed (prefill) or requests (decode), and the KV a decode batch holds.
        self.step_tokens = 0
        self.step_kv_tokens = 0
        self.step_pairs = 0.0  # a prefill step's attention pairs (the module's docstring)
        self.after_prefill = False  # the step that ended last was a prefill step
        self.on_first_token: RequestHook | None = None
        self.on_finish: RequestHook | None = None
        # SGLang's windowed prefix-cache hit rate (metrics_reporter.py _CacheHitRateWindow): the
        # hit and total prompt tokens of each prefill step of the last HIT_RATE_WINDOW_S seconds.
        self._hit_window: deque[tuple[float, int, int]] = deque()
        self._hit_tokens = self._hit_total = self._step_hit = self._step_total = 0
        self.recent_hit_rate = 0.0
        # The part of a chunked prompt whose KV is not allocated yet: SGLang allocates chunk by chunk.
        self._unallocated = 0
        # PD prefill: the bootstrap queue (requests whose decode side has not pre-allocated yet)
        self.bootstrap_reqs = 0
        self.bootstrap_tokens = 0
        self.handed_off: list[SimRequest] = []  # prefilled since the simulation last took them
        # PD decode: pre-allocation queue, transfer queue (KV reserved, not arrived), arrived
        self.prealloc: deque[SimRequest] = deque()
        self.prealloc_tokens = 0
        self.transfer: dict[int, SimRequest] = {}
        self.transfer_tokens = 0
        self._ready: list[SimRequest] = []

    # -- what the rank is ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        prefilling = len(self._prefill_batch)
        if self._chunked is not None and self.state != PREFILL:
            prefilling += 1
        return len(self.running) + prefilling

    @property
    def running_batch(self) -> int:
        """SGLang's ``running_batch.batch_size()`` as the next prefill pass sees it (the count the
        prefill delayer gathers and the request slots are counted from): the running requests, plus,
        under the overlap scheduler, those that finished in the step just ended."""
        return len(self.running) + len(self._late)

    @property
    def ingested_waiting(self) -> int:
        """SGLang's ``len(waiting_queue)`` as the next step's formation sees it: the waiting queue
        less the requests received while the step now ending ran, which the overlap scheduler takes
        in a pass later. Their admit steps only grow towards the tail, so they are counted from it."""
        step = self.step_index + 1
        n = len(self.waiting)
        for req in reversed(self.waiting):
            if req.admit_step <= step:
                break
            n -= 1
        return n

    @property
    def num_waiting(self) -> int:
        """SGLang's num_waiting_reqs: the waiting queue, plus the bootstrap queue of a PD prefill
        rank or the pre-allocation and transfer queues of a PD decode rank (load_inquirer.py)."""
        return len(self.waiting) + self.bootstrap_reqs + len(self.prealloc) + len(self.transfer)

    @property
    def used_tokens(self) -> int:
        """SGLang's num_used_tokens: KV that is not free and not evictable."""
        return self.private_tokens + self.cache.locked_tokens

    @property
    def total_tokens(self) -> int:
        """SGLang's num_total_tokens: KV in use plus the seqlens of requests still waiting for KV
        (the bootstrap queue of a PD prefill rank and the pre-allocation queue of a decode rank
        included; the transfer queue's KV is reserved, so it is in use)."""
        return (
            self.private_tokens + self.cache.locked_tokens + self.waiting_tokens + self.bootstrap_tokens
            + self.prealloc_tokens
        )  # fmt: skip

    @property
    def awaiting_kv_tokens(self) -> int:
        """A PD decode rank's requests whose KV has not arrived: pre-allocation and transfer queues."""
        return self.prealloc_tokens + self.transfer_tokens

    @property
    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage: the share of the pool held by live requests (cached blocks nobody
        uses count as free)."""
        return self.used_tokens / self.config.kv_capacity

    @property
    def idle(self) -> bool:
        return self.state == IDLE

    @property
    def reported_running(self) -> int:
        """SGLang's num_running_reqs: its running (decode) batch only. The batch being prefilled
        and the request being chunked join it later (load_inquirer.py get_loads)."""
        return len(self.running)

    @property
    def reported_used_tokens(self) -> int:
        """SGLang's num_used_tokens: the KV allocated, which grows chunk by chunk for a long prompt
        (the rest of the prompt being chunked is not allocated yet)."""
        return self.used_tokens - self._unallocated

    def snapshot(self, now_s: float, publish_seq: int) -> LoadSnapshot:
        """The load this rank would publish now, as SGLang reports it; the clock fields come from
        the simulated clock."""
        now_ns = int(round(now_s * 1e9))
        used = self.reported_used_tokens
        total = used + self.waiting_tokens + self.bootstrap_tokens + self.prealloc_tokens
        return LoadSnapshot(
            dp_rank=self.rank,
            num_running_reqs=self.reported_running,
            num_waiting_reqs=self.num_waiting,
            num_used_tokens=used,
            num_total_tokens=total,
            num_active_tokens=max(0, total - self.awaiting_kv_tokens),
            max_total_num_tokens=self.config.kv_capacity,
            num_received_reqs=self.received,
            timestamp_ns=now_ns,
            monotonic_ns=now_ns,
            publish_seq=publish_seq,
            writer_pid=0,
            node_id=0,
        )

    # -- events --------------------------------------------------------------------------------

    def receive(self, req: SimRequest, now_s: float, in_step: bool = False) -> None:
        """A request reaches the rank; ``in_step``: while its (group's) step runs, which with the
        overlap scheduler delays its admission by one step (not with ``sync_forward``)."""
        req.admit_step = self.step_index + (2 if in_step and self.fence else 1)
        if self.role == PREFILL_ROLE:
            req.prefill_rank = self.rank
        else:
            req.rank = self.rank
            req.received_s = now_s
        self.received += 1
        self.waiting.append(req)
        self._queue_tokens(req)

    # -- PD disaggregation ---------------------------------------------------------------------

    def hold(self, req: SimRequest) -> None:
        """A PD prefill rank: the request waits in the bootstrap queue for its decode side."""
        req.prefill_rank = self.rank
        self.received += 1
        self.bootstrap_reqs += 1
        self.bootstrap_tokens += req.seqlen

    def release(self, req: SimRequest, now_s: float, in_step: bool = False) -> None:
        """A PD prefill rank: the decode side has pre-allocated; the request joins the waiting queue."""
        self.bootstrap_reqs -= 1
        self.bootstrap_tokens -= req.seqlen
        self.received -= 1  # counted once, by receive
        self.receive(req, now_s, in_step)

    def receive_remote(self, req: SimRequest, now_s: float) -> None:
        """A PD decode rank: the request joins the pre-allocation queue."""
        req.rank = self.rank
        req.received_s = now_s
        self.received += 1
        self.prealloc.append(req)
        self.prealloc_tokens += req.seqlen

    def preallocate(self) -> list[SimRequest]:
        """A PD decode rank, between steps: reserve KV (the prompt, its first token, and SGLang's
        reserved decode room per request) for queued requests in order while the pool and the
        running limit allow. Returns the requests now in the transfer queue."""
        cfg = self.config
        done: list[SimRequest] = []
        queue = self.prealloc
        while queue:
            req = queue[0]
            active = len(self.running) + len(self.transfer) + len(self._ready)
            if active >= cfg.max_running:
                break
            need = req.seqlen + 1
            reserve = RESERVED_DECODE_TOKENS * (active + 1)
            short = self.private_tokens + self.cache.tokens + need + reserve - cfg.kv_capacity
            if short > 0:
                short -= self.cache.evict(short)
                if short > 0 and active > 0:
                    break  # a request alone on the rank is admitted however long: it fits the pool
            queue.popleft()
            self.prealloc_tokens -= req.seqlen
            self.private_tokens += need
            req.private_kv = need
            self.transfer[req.rid] = req
            self.transfer_tokens += req.seqlen
            done.append(req)
        return done

    def kv_arrived(self, req: SimRequest, now_s: float) -> int:
        """A PD decode rank: the request's KV (and its first token) arrived. It joins the running
        batch at the next step; returns 1 if it ended there (a one-token answer), else 0."""
        del self.transfer[req.rid]
        self.transfer_tokens -= req.seqlen
        req.generated = 1
        req.kv_ready_s = now_s
        req.first_token_s = now_s
        if self.on_first_token is not None:
            self.on_first_token(req)
        if req.generated >= req.output_len:
            self._finish(req, now_s)
            return 1
        self._ready.append(req)
        return 0

    def _queue_tokens(self, req: SimRequest) -> None:
        """Count a request that joins the waiting queue (new, or retracted)."""
        self.waiting_tokens += req.seqlen
        ids = req.block_ids
        cached = prefix_tokens(req.prompt_len, len(ids), self.cache.match(ids)) if ids else 0
        req.queued_uncached = max(0, req.seqlen - cached)
        self.waiting_uncached += req.queued_uncached

    @property
    def queued_prefill_tokens(self) -> int:
        """The rank's ``num_waiting_uncached_tokens``, plus the rest of the prompt whose chunked
        prefill is under way.

        ``sglang`` (the default) is SGLang's own figure under its defaults (``fcfs``, a radix cache
        that does not match the waiting queue): each waiting request counts
        ``int(seqlen * (1 - recent hit rate))``, the hit rate over the prefill steps of the last
        15 s (load_inquirer.py ``get_num_waiting_uncached_tokens``). ``exact`` is what an engine
        that matched every waiting prompt against its cache could report: each prompt less the
        prefix its cache held when it joined the queue."""
        chunked = self._chunked.prefill_left if self._chunked is not None else 0
        if self.queued_prefill == EXACT_REPORT:
            return self.waiting_uncached + chunked
        miss = 1.0 - self.recent_hit_rate
        if miss >= 1.0:
            return self.waiting_tokens + chunked
        return sum(int(req.seqlen * miss) for req in self.waiting) + chunked

    @property
    def fenced(self) -> bool:
        """The step just formed may have left waiting requests out because of the overlap
        scheduler: they were received while the previous step ran, or the requests that finished
        in it still held their slots and KV."""
        return bool(self.waiting) and (self.waiting[0].admit_step > self.step_index or self._held_late)

    def reform_unfenced(self, now_s: float, admit: bool = True) -> float | None:
        """Nothing runs after all: the scheduler's loop has no batch in flight to overlap with, so
        it forms its next batch at once with every request received. Forms this step again so."""
        for req in self.waiting:
            if req.admit_step > self.step_index:
                req.admit_step = self.step_index
        return self._choose_step(now_s, admit)

    def prefill_ready(self) -> bool:
        """Whether the next step would prefill if allowed: a prompt is being chunked, or the head of
        the waiting queue may be admitted and fits the KV pool (what SGLang's PrefillAdder reports
        to the prefill delayer as ``local_prefillable``)."""
        if self._chunked is not None:
            return True
        cfg = self.config
        waiting = self.waiting
        if not waiting or self.running_batch >= cfg.max_running or waiting[0].admit_step > self.step_index + 1:
            return False
        req = waiting[0]
        ids = req.block_ids
        cache = self.cache
        matched = cache.match(ids) if ids else 0
        cached = min(prefix_tokens(req.prompt_len, len(ids), matched), req.seqlen - 1)
        free = cfg.kv_capacity - self.private_tokens - cache.tokens - len(self.running) + cache.evictable_tokens
        return req.seqlen - cached + 1 <= free

    @property
    def prefill_batch_size(self) -> int:
        """Requests in the prefill batch of the step under way (0 when it does not prefill)."""
        return len(self._prefill_batch) if self.state == PREFILL else 0

    @property
    def chunking(self) -> bool:
        """A prompt's chunked prefill is under way (it continues whatever the prefill delayer says)."""
        return self._chunked is not None

    def begin_step(self, now_s: float, admit: bool = True) -> float | None:
        """Choose the next step and return its duration, or None when there is nothing to do.

        ``admit`` False (the prefill delayer holds prefill back this pass): no new request is
        admitted; a prompt being chunked goes on."""
        self.step_index += 1
        self._step_start_s = now_s
        return self._choose_step(now_s, admit)

    def _choose_step(self, now_s: float, admit: bool) -> float | None:
        cfg = self.config
        if self._ready:  # PD decode: requests whose KV arrived join the batch (no compute: prebuilt)
            for req in self._ready:
                req.finish_step = self.decode_steps + (req.output_len - req.generated)
                self.running[req.rid] = req
                self._finish_sum += req.finish_step
                heapq.heappush(self._finish_heap, (req.finish_step, req.rid, req.epoch))
            self._ready.clear()
        tokens = 0
        if self._chunked is not None or (admit and self.waiting and self.running_batch < cfg.max_running):
            tokens = self._form_prefill_batch(now_s, admit)
        # This step is formed: the loop now processes the previous step's result, which frees what
        # its finished requests held (batch_result_processor.py 1466)
        self._held_late = bool(self._late)
        if self._late:
            for req in self._late:
                self._drop_kv(req)
            self._late.clear()
        if tokens:
            self.state = PREFILL
            self.step_tokens = tokens
            self.step_kv_tokens = 0
            return cfg.prefill_base_s + cfg.prefill_s_per_token * tokens + cfg.prefill_s_per_attention_pair * self.step_pairs
        if self.running:
            self._make_decode_room()
            self.state = DECODE
            kv = self.private_tokens + self.cache.locked_tokens
            batch = len(self.running)
            self.step_tokens = batch
            self.step_kv_tokens = kv
            extra = cfg.decode_after_prefill_s if self.after_prefill else 0.0
            return cfg.decode_base_s + cfg.decode_s_per_request * batch + cfg.decode_s_per_kv_token * kv + extra
        self.state = IDLE
        self.step_tokens = 0
        self.step_kv_tokens = 0
        return None

    def end_step(self, now_s: float) -> int:
        """Apply the step that just ended; returns how many requests finished in it."""
        done_before = len(self.finished)
        self.after_prefill = self.state == PREFILL
        earlier, self._results = self._results, []  # the previous step's, processed after this forward
        if self.state == PREFILL:
            self._end_prefill(now_s)
        elif self.state == DECODE:
            self._end_decode(now_s)
        self.state = IDLE
        if earlier:  # out once this step's forward and their processing are done, before the loop's next turn
            start = self._step_start_s
            self._give_results(earlier, start + self.config.result_share * (now_s - start))
        return len(self.finished) - done_before

    def flush_results(self, now_s: float) -> None:
        """Nothing runs next: the loop processes the last step's result at once (``sync_forward``)."""
        if self._results:
            earlier, self._results = self._results, []
            self._give_results(earlier, now_s)

    def _result_out(self, req: SimRequest, first: bool, now_s: float) -> None:
        """``req``'s first token (``first``) or end, computed in the step ending at ``now_s``: out now,
        or with ``sync_forward`` once the next step's forward has run (``end_step``, ``flush_results``)."""
        if self.lagged:
            self._results.append((req, first))
        else:
            self._give_results(((req, first),), now_s)

    def _give_results(self, results: Iterable[tuple[SimRequest, bool]], now_s: float) -> None:
        for req, first in results:
            if first:
                req.first_token_s = now_s
                if self.on_first_token is not None:
                    self.on_first_token(req)
            else:
                req.finished_s = now_s
                if self.on_finish is not None:
                    self.on_finish(req)

    # -- prefill -------------------------------------------------------------------------------

    def _form_prefill_batch(self, now_s: float, admit: bool = True) -> int:
        """Put this step's prefill work in ``_prefill_batch``; returns the prompt tokens it computes
        (with ``admit`` False, only the rest of the prompt being chunked)."""
        cfg = self.config
        chunk = cfg.chunked_prefill_size
        budget = chunk or cfg.max_prefill_tokens
        batch = self._prefill_batch
        tokens = 0
        self._step_hit = 0
        self._unallocated = 0
        pairs = 0.0
        if self._chunked is not None:
            req = self._chunked
            take = min(req.prefill_left, budget)
            pairs += take * (req.seqlen - req.prefill_left + take / 2)  # its earlier chunks are its context
            batch.append((req, take))
            tokens = take
            budget -= take
            self._chunked = None if take == req.prefill_left else req
        # Room for the prompts plus one decode token for everything already running, and, with a
        # new_token_ratio, that share of the running requests' remaining outputs. Requests that
        # finished in the step just ended still hold their KV here (overlap) but decode no more.
        free = cfg.kv_capacity - self.private_tokens - self.cache.tokens - len(self.running)
        ratio = cfg.new_token_ratio
        if ratio:
            free -= int(ratio * (self._finish_sum - len(self.running) * self.decode_steps))
        # Slots as SGLang counts them (get_num_allocatable_reqs, scheduler.py 4034): the running batch
        # holds the requests that finished in the step just ended until its result is processed
        slots = cfg.max_running - self.running_batch - len(batch)
        waiting = self.waiting
        step = self.step_index
        while admit and waiting and slots > 0 and self._chunked is None and (budget > 0 or not batch):
            req = waiting[0]
            if req.admit_step > step:
                break  # received while the previous step ran: the overlap scheduler takes it next step
            ids = req.block_ids
            cache = self.cache
            matched = cache.match(ids) if ids else 0
            seqlen = req.seqlen
            cached = min(prefix_tokens(req.prompt_len, len(ids), matched), seqlen - 1)
            need = seqlen - cached
            if chunk == 0 and batch and need > budget:
                break  # unchunked: whole prompts only, and only the first may exceed the budget
            if matched:
                cache.acquire(ids, matched)
            room = need + 1 + (int(ratio * (req.output_len - req.generated)) if ratio else 0)
            if room > free:
                free += cache.evict(room - free)
                if room > free:
                    if matched:
                        cache.release(ids, matched)
                    break
            waiting.popleft()
            self.waiting_tokens -= seqlen
            self.waiting_uncached -= req.queued_uncached
            free -= room
            slots -= 1
            self.private_tokens += need
            req.private_kv = need
            req.held_blocks = matched
            req.prefill_left = need
            if req.admitted_s < 0:
                req.admitted_s = now_s
                req.cached_tokens = cached
                self._step_hit += cached
            take = need if chunk == 0 else min(need, budget)
            pairs += take * (cached + take / 2)
            batch.append((req, take))
            tokens += take
            budget -= take
            if take < need:
                self._chunked = req
        if self._chunked is not None:
            self._unallocated = self._chunked.prefill_left - batch[-1][1]
        # SGLang's hit rate leaves out what retracted requests compute again
        self._step_total = self._step_hit + sum(t for r, t in batch if r.retractions == 0)
        self.step_pairs = pairs
        return tokens

    def _end_prefill(self, now_s: float) -> None:
        self._note_hits(now_s)
        batch, self._prefill_batch = self._prefill_batch, []
        for req, take in batch:
            req.prefill_left -= take
            if req.prefill_left > 0:
                continue  # chunked: the rest comes in the next steps
            self._cache_prompt(req)
            if self.role == PREFILL_ROLE:
                self._hand_off(req, now_s)
                continue
            req.generated += 1
            self.private_tokens += 1
            if req.first_token_s < 0:
                self._result_out(req, True, now_s)
            if req.generated >= req.output_len:
                self._finish(req, now_s)
            else:
                req.finish_step = self.decode_steps + (req.output_len - req.generated)
                self.running[req.rid] = req
                self._finish_sum += req.finish_step
                heapq.heappush(self._finish_heap, (req.finish_step, req.rid, req.epoch))

    def _hand_off(self, req: SimRequest, now_s: float) -> None:
        """A PD prefill rank: the prompt is done; its KV goes to the decode side (freed here)."""
        req.prefilled_s = now_s
        self._leave(req, self.handed_off, first_token=True)

    def _note_hits(self, now_s: float) -> None:
        """Add this prefill step to the 15 s hit-rate window, as SGLang does after each prefill batch."""
        window = self._hit_window
        if self._step_total > 0:
            window.append((now_s, self._step_hit, self._step_total))
            self._hit_tokens += self._step_hit
            self._hit_total += self._step_total
        cutoff = now_s - HIT_RATE_WINDOW_S
        while window and window[0][0] <= cutoff:
            _, hit, total = window.popleft()
            self._hit_tokens -= hit
            self._hit_total -= total
        self.recent_hit_rate = self._hit_tokens / self._hit_total if self._hit_total > 0 else 0.0

    def _cache_prompt(self, req: SimRequest) -> None:
        """Move the request's computed prompt blocks into the prefix cache, pinned while it runs."""
        ids = req.block_ids
        if not ids:
            return  # nothing to share: its whole sequence stays private
        n = len(ids)
        if req.held_blocks < n:
            sizes = [BLOCK_TOKENS] * n
            sizes[-1] = req.prompt_len - BLOCK_TOKENS * (n - 1)
            self.cache.insert(ids, sizes, req.held_blocks)
            req.held_blocks = n
        # Its copy of the prompt now lives in the cache (or is dropped where another request stored
        # the same blocks first): what stays private is what it generated before a retraction.
        private = req.seqlen - req.prompt_len
        self.private_tokens += private - req.private_kv
        req.private_kv = private

    # -- decode --------------------------------------------------------------------------------

    def _make_decode_room(self) -> None:
        """Each running request needs one more KV token this step: evict, then retract, to make room."""
        cfg = self.config
        cache = self.cache
        short = self.private_tokens + cache.tokens + len(self.running) - cfg.kv_capacity
        if short > 0:
            short -= cache.evict(short)
        while short > 0 and len(self.running) > 1:
            short -= self._retract_newest()
            if short > 0 and cache.evictable_tokens:
                short -= cache.evict(short)

    def _end_decode(self, now_s: float) -> None:
        self.decode_steps += 1
        self.decoded_tokens += len(self.running)
        self.private_tokens += len(self.running)
        heap = self._finish_heap
        while heap and heap[0][0] <= self.decode_steps:
            _, rid, epoch = heapq.heappop(heap)
            req = self.running.get(rid)
            if req is None or req.epoch != epoch:
                continue  # retracted since this entry was pushed
            del self.running[rid]
            self._finish_sum -= req.finish_step
            req.generated = req.output_len
            self._finish(req, now_s)

    def _retract_newest(self) -> int:
        """Send the newest running request back to the head of the queue; returns the KV tokens freed."""
        rid = next(reversed(self.running))
        req = self.running.pop(rid)
        self._finish_sum -= req.finish_step
        req.generated = req.output_len - (req.finish_step - self.decode_steps)
        freed = self._drop_kv(req)
        req.epoch += 1
        req.retractions += 1
        self.retracted += 1
        self.waiting.appendleft(req)
        self._queue_tokens(req)
        return freed

    def _drop_kv(self, req: SimRequest) -> int:
        """Free the request's private KV and unpin its blocks; returns the tokens freed at once.

        Past its prefill, a request's private KV is its sequence less the prompt blocks it pins."""
        private = req.seqlen - prefix_tokens(req.prompt_len, len(req.block_ids), req.held_blocks)
        self.private_tokens -= private
        if req.held_blocks:
            self.cache.release(req.block_ids, req.held_blocks)
            req.held_blocks = 0
        return private

    def _finish(self, req: SimRequest, now_s: float) -> None:
        # the overlap scheduler frees its slot and KV after forming the next step (a PD decode
        # rank's pre-allocation has its own accounting, not modelled so)
        self._leave(req, self.finished, late=self.overlap and self.role == BOTH, tell=False)
        self._result_out(req, False, now_s)  # its end is stamped and told when the result comes out

    def _leave(self, req: SimRequest, into: list[SimRequest], first_token: bool = False, late: bool = False,
               tell: bool = True) -> None:
        """``req`` leaves this rank: its KV freed (``late``: when the next step has been formed),
        kept in ``into``, the hooks told (its first token too, for a PD prefill rank's hand-off;
        ``tell`` False: its end is told by ``_result_out``)."""
        if late:
            self._late.append(req)
        else:
            self._drop_kv(req)
        into.append(req)
        if first_token and self.on_first_token is not None:
            self.on_first_token(req)
        if tell and self.on_finish is not None:
            self.on_finish(req)
